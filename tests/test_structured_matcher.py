"""xgrammar over the real V4 vocabulary, without a model: the vocab table, masks
against a brute-force reference on a vocabulary slice, rollback, the trigger, the
bitmask apply, and admission errors."""

from __future__ import annotations

import json
import random

import pytest
import torch

from deepinfer.errors import InvalidRequestError
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured.batch import BitmaskBuffers, MaskStats, StructuredOutputBatch
from deepinfer.structured.manager import StructuredOutputManager
from deepinfer.structured.matcher import GrammarViolation, RequestGrammar
from deepinfer.structured.spec import StructuredOutputSpec
from deepinfer.structured.vocab import token_bytes
from deepinfer.tokenizer import load_tokenizer

xgr = pytest.importorskip("xgrammar")
V, EOS = 129280, 1
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "minItems": 1, "maxItems": 3},
    "n": {"type": "integer", "minimum": -5, "maximum": 500}}, "required": ["name", "tags"]}
INSTANCE = {"name": "Zoë q", "tags": ["bc", "a"], "n": 42}


@pytest.fixture(scope="module")
def manager() -> StructuredOutputManager:
    return StructuredOutputManager(load_tokenizer(), V, EOS, "cpu", max_rows=4)


def compiled(manager: StructuredOutputManager, spec: StructuredOutputSpec) -> object:
    manager.pool.check(spec)
    return manager.pool.submit(spec).result(timeout=60)


def allowed(bitmask: torch.Tensor, row: int, ids: list[int]) -> set[int]:
    return {i for i in ids if (int(bitmask[row, i // 32]) >> (i % 32)) & 1}


def test_vocab_table_matches_the_detokenizer(manager: StructuredOutputManager) -> None:
    tok = manager.tokenizer
    table = token_bytes(tok, V + 64)  # wider than the tokenizer: the padding is never allowed
    assert len(table) == V + 64 and table[V:] == [b""] * 64
    assert table[tok.bos_token_id] == b"" and table[tok.token_to_id("<think>")] == b"<think>"
    assert table[tok.token_to_id("Ġworld")] == b" world"
    rng = random.Random(0)
    whole = [i for i in range(3, 128000) if "\ufffd" not in tok.decode([i])]
    for _ in range(50):
        ids = [rng.choice(whole) for _ in range(30)]
        assert tok.decode(ids).encode() == b"".join(table[i] for i in ids)


def test_vocab_table_agrees_with_xgrammars_huggingface_path(manager: StructuredOutputManager) -> None:
    """An independent construction (transformers, test-only): same bytes for every
    non-special id; specials differ on purpose (xgrammar would let their text through)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=manager.tokenizer.backend)
    theirs = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=V, stop_token_ids=[EOS]).decoded_vocab
    ours = token_bytes(manager.tokenizer, V)
    special = set(manager.tokenizer.all_special_ids)
    assert [i for i in range(V) if i not in special and ours[i] != theirs[i]] == []


def test_masks_equal_brute_force_on_a_vocab_slice(manager: StructuredOutputManager) -> None:
    tok = manager.tokenizer
    m = xgr.GrammarMatcher(compiled(manager, StructuredOutputSpec("json", SCHEMA)))
    text = json.dumps(INSTANCE, ensure_ascii=False)
    ids = tok.encode(text, add_bos=False)
    rng = random.Random(1)
    special = tok.all_special_ids
    probe = sorted(set(range(0, 2500)) | set(special) | set(rng.sample(range(V), 2500)) | set(ids))
    bitmask = xgr.allocate_token_bitmask(1, V)
    for step, token in enumerate(ids + [EOS]):
        m.fill_next_token_bitmask(bitmask, 0)
        brute = set()
        for t in probe:  # the reference: try every candidate, undo it
            if m.accept_token(t):
                brute.add(t)
                m.rollback(1)
        assert allowed(bitmask, 0, probe) == brute, f"step {step}"
        assert not brute & (set(special) - {EOS}), "special tokens must never be allowed"
        assert m.accept_token(token)
    assert m.is_terminated()


def test_rollback_restores_the_mask(manager: StructuredOutputManager) -> None:
    cg = compiled(manager, StructuredOutputSpec("json", SCHEMA))
    ids = manager.tokenizer.encode(json.dumps(INSTANCE, ensure_ascii=False), add_bos=False)
    g = RequestGrammar(cg)
    g.advance(ids)
    a, b = xgr.allocate_token_bitmask(1, V), xgr.allocate_token_bitmask(1, V)
    for keep in (len(ids) - 1, len(ids) // 2, 0):
        g.rollback(g.num_seen - keep)
        fresh = xgr.GrammarMatcher(cg)
        for t in ids[:keep]:
            assert fresh.accept_token(t)
        g.fill(a, 0)
        fresh.fill_next_token_bitmask(b, 0)
        assert torch.equal(a, b) and g.num_seen == keep
    g.advance(ids)  # replays after a full rollback
    assert g.num_seen == len(ids) and g.is_completed


def test_trigger_switches_the_grammar_on_and_rolls_back(manager: StructuredOutputManager) -> None:
    tok = manager.tokenizer
    think_end = tok.token_to_id("</think>")
    g = RequestGrammar(compiled(manager, StructuredOutputSpec("regex", "(yes|no)")), trigger=(think_end,))
    out = tok.encode(" free text {", add_bos=False)
    g.advance(out)
    assert not g.active and g.matcher is None  # unconstrained before the trigger
    out += [think_end]
    g.advance(out)
    assert g.active and g.trigger_end == len(out)
    bad = tok.encode("maybe", add_bos=False)[0]
    with pytest.raises(GrammarViolation, match="rejected by the grammar"):
        g.accept(bad)
    out += tok.encode("yes", add_bos=False)
    g.advance(out)
    assert g.is_completed
    g.rollback(2)  # back across the trigger: the grammar is off again
    assert g.matcher is None and not g.active
    g.advance(out[:-1])
    assert g.active  # the trigger is seen again


def test_bitmask_apply_masks_only_constrained_rows(manager: StructuredOutputManager) -> None:
    g = RequestGrammar(compiled(manager, StructuredOutputSpec("regex", "[0-9]+")))
    stats = MaskStats()
    batch = StructuredOutputBatch({"c": g}, BitmaskBuffers(V, torch.device("cpu"), rows=1), stats)
    logits = torch.randn(3, V)
    before = logits.clone()
    batch.apply(logits, ["u0", "c", "u1"])  # grows the buffers to 3 rows
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    host = batch.buffers.host[batch.buffers._slot]
    ok = torch.tensor([(int(host[1, i // 32]) >> (i % 32)) & 1 for i in range(V)], dtype=torch.bool)
    assert torch.equal(torch.isinf(logits[1]), ~ok) and torch.equal(logits[1][ok], before[1][ok])
    digits = [manager.tokenizer.token_to_id(d) for d in "0123456789"]
    assert all(ok[d] for d in digits) and not ok[EOS]  # "" is not a match of [0-9]+
    assert stats.steps == 1 and stats.rows == 1
    with pytest.raises(ValueError, match="logits width"):
        batch.apply(torch.zeros(3, V - 1), ["u0", "c", "u1"])


@pytest.mark.parametrize("spec, fragment", [
    ({"regex": r"a\bb"}, r"'\b'"),
    ({"regex": "(ab"}, "invalid regex"),
    ({"ebnf": "root ::= foo"}, 'Rule "foo" is not defined'),
    ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),  # neither backend enforces these
    ({"json": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}, "oneOf"),
    ({"json": {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}}, "'contains'"),
])
def test_admission_rejects_with_index_and_reason(manager: StructuredOutputManager, spec: dict,
                                                 fragment: str) -> None:
    params = [SamplingParams(), SamplingParams(structured_output=spec)]
    with pytest.raises(InvalidRequestError) as info:
        manager.check(params)
    msg = str(info.value)
    assert msg.startswith("sampling_params[1]: SamplingParams.structured_output") and fragment in msg
    assert "/project/cpp" not in msg  # xgrammar's log prefix is stripped


def test_trigger_text_is_tokenized(manager: StructuredOutputManager) -> None:
    spec = SamplingParams(structured_output={"regex": "a", "trigger": "</think>"}).structured_output
    assert manager.trigger_ids(spec) == (manager.tokenizer.token_to_id("</think>"),)
    bad = SamplingParams(structured_output={"regex": "a", "trigger": [V]})
    with pytest.raises(InvalidRequestError, match="trigger"):
        manager.check([bad])
