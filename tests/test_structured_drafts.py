"""Speculative drafts under grammars (small-vocabulary tiny models, MTP and DSpark).

Constrained requests get drafts: each is truncated at its first grammar-rejected token,
every verify row is masked with the grammar state after the drafts before it, and the
matcher only ever moves by accepted tokens. Greedy constrained output with speculation
(fixed and confidence-scheduled) equals the output without it token for token, in a
batch mixing JSON Schema / regex / EBNF / a trigger grammar / an unconstrained request;
every "stop" output validates. Random-weight drafters propose almost nothing the grammar
accepts, so a prefix of each draft is replaced by the known continuation (accepted,
grammar-valid drafts of every length occur) and its tail stays the drafter's own
(usually rejected by the grammar: truncation occurs too). Seeded sampling with
speculation still yields valid output (lossless sampling under masks: test_spec_stats).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.tiny import tiny_config, tiny_dspark_config, write_tiny_checkpoint
from deepinfer.spec.scheduling import StepTimeCurve

from structured_common import VOCAB, train_small_tokenizer

xgr = pytest.importorskip("xgrammar")
pytest.importorskip("tokenizers")
EOS, MAX_TOKENS = 1, 32
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 300}},
          "required": ["name", "n"]}
ARRAY = {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}
REGEX = r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"
EBNF = 'root ::= term (("+" | "*") term)*\nterm ::= [0-9]+ | "(" root ")"'
SPECS = [{"json": SCHEMA}, {"json": ARRAY}, {"regex": REGEX}, {"ebnf": EBNF}, {"json_object": True}]
PROMPTS = ['{"name": "ab", "n": 5}', "write: ", "mail me at", "(1+2)*3 =", "{}"]


def _ebnf_ok(s: str) -> bool:
    """root := term (("+" | "*") term)*; term := [0-9]+ | "(" root ")"."""
    def root(i: int) -> int:
        i = term(i)
        while i < len(s) and s[i] in "+*":
            i = term(i + 1)
        return i

    def term(i: int) -> int:
        j = i
        while j < len(s) and s[j] in "0123456789":
            j += 1
        if j > i:
            return j
        if i < len(s) and s[i] == "(":
            i = root(i + 1)
            if i < len(s) and s[i] == ")":
                return i + 1
        raise ValueError(s)
    try:
        return root(0) == len(s)
    except (ValueError, RecursionError):
        return False


def valid(spec: dict, text: str) -> bool:
    # strict parsing: raw control characters inside strings are invalid JSON (the compiler
    # closes xgrammar's gap for length-bounded strings, deepinfer/structured/compiler.py)
    try:
        if "json" in spec:
            jsonschema.validate(json.loads(text), spec["json"])
            return True
        if "json_object" in spec:
            return isinstance(json.loads(text), dict)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    if "regex" in spec:
        return re.fullmatch(spec["regex"], text) is not None
    return _ebnf_ok(text)


def _checkpoint(tmp_path_factory, name: str, cfg) -> str:
    path = tmp_path_factory.mktemp(name)
    write_tiny_checkpoint(str(path), seed=3, cfg=cfg)
    train_small_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {"mtp": _checkpoint(tmp_path_factory, "so_mtp", tiny_config(vocab_size=VOCAB, sliding_window=32)),
            "dspark": _checkpoint(tmp_path_factory, "so_dspark",
                                  tiny_dspark_config(vocab_size=VOCAB, sliding_window=32))}


def make(ckpt: str, **kw) -> LLM:
    return LLM(ckpt, dtype="float32", max_model_len=256, max_num_batched_tokens=48, max_num_seqs=8, **kw)


def workload(llm: LLM, trigger: int) -> tuple[list[list[int]], list[SamplingParams], list[dict | None]]:
    specs = SPECS + [{"regex": "(yes|no)[0-9]", "trigger": [trigger]}, None]
    prompts = [llm.tokenizer.encode(p) * 2 for p in PROMPTS + ["think then answer", "free"]]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_output=s) if s else
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) for s in specs]
    return prompts, params, specs


def _trigger(llm: LLM) -> int:
    """A token the unconstrained greedy output of the trigger prompt emits first at index >= 2."""
    ids = llm.tokenizer.encode("think then answer") * 2
    free = llm.generate(prompt_token_ids=[ids], use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    return next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, tuple]:
    out = {}
    for name, ckpt in checkpoints.items():
        llm = make(ckpt)
        trigger = _trigger(llm)
        prompts, params, specs = workload(llm, trigger)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        out[name] = (trigger, [o.token_ids for o in outs], [o.finish_reason for o in outs])
    return out


def _partly_known_drafts(llm: LLM, reference: list[list[int]] | None) -> dict[str, int]:
    """Replace a prefix (0..k tokens, varying per step) of each real draft by the known
    greedy continuation (``reference``, None: keep the drafts); count how often the
    grammar truncated a draft."""
    drafter, structured = llm.runner.spec.drafter, llm.structured
    real_propose, real_check = drafter.propose, structured.valid_draft_prefix
    seen = {"steps": 0, "truncated": 0}

    def propose(ctx, k):
        out = real_propose(ctx, k)
        seen["steps"] += 1
        for r, emitted in zip(ctx.scheduled, ctx.emitted):
            d = out.get(r.req_id)
            if d is None or emitted is None or reference is None:
                continue
            ref = reference[int(r.req_id.split("-")[1])]
            done, j = r.output_len + len(emitted), seen["steps"] % (k + 1)
            d.tokens = (ref[done: done + j] + d.tokens[j:])[: len(d.tokens)]
        return out

    def check(req, drafts):
        n = real_check(req, drafts)
        seen["truncated"] += n is not None and n < len(drafts)
        return n

    drafter.propose, structured.valid_draft_prefix = propose, check
    return seen


def _verified_drafts_are_grammar_valid(llm: LLM) -> dict[str, int]:
    """Every draft a greedy constrained request verifies is one its grammar accepts (the
    truncation keeps rows for nothing the mask would reject anyway)."""
    spec, structured, real = llm.runner.spec, llm.structured, llm.runner.spec.launch
    seen = {"drafts": 0}

    def launch(runner, so, grammar=None):
        for r in so.scheduled:
            g = structured.grammars.get(r.req_id)
            if g is not None and r.num_draft_tokens:
                drafts = r.token_ids[-r.num_draft_tokens:]
                assert g.valid_prefix(drafts) == len(drafts), (r.req_id, drafts)
                seen["drafts"] += len(drafts)
        return real(runner, so, grammar)

    spec.launch = launch
    return seen


def _matchers_follow_accepted_tokens(llm: LLM) -> dict[str, int]:
    """After every advance, a constrained request's matcher has consumed exactly its output
    and allows what a fresh matcher replaying that output allows."""
    structured, real = llm.structured, llm.structured.advance
    seen = {"checked": 0}

    def advance(req):
        g = structured.grammars.get(req.req_id)
        done = real(req)
        if g is not None and g.trigger is None and not g.is_terminated:
            assert g.num_seen == len(req.output_token_ids)
            fresh = xgr.GrammarMatcher(g.compiled)
            assert all(fresh.accept_token(t) for t in req.output_token_ids)
            a, b = xgr.allocate_token_bitmask(1, VOCAB), xgr.allocate_token_bitmask(1, VOCAB)
            g.fill(a, 0)
            fresh.fill_next_token_bitmask(b, 0)
            assert torch.equal(a, b)
            seen["checked"] += 1
        return done

    structured.advance = advance
    return seen


@pytest.mark.parametrize("method,k,varlen", [("mtp", 3, False), ("mtp", 4, True), ("dspark", 3, False),
                                             ("dspark", 5, True)])
def test_greedy_constrained_speculation_equals_no_speculation(checkpoints, references, method, k, varlen):
    trigger, ref_tokens, ref_reasons = references[method]
    llm = make(checkpoints[method], num_speculative_tokens=k, enable_mtp_varlen=varlen)
    if varlen:  # free verify rows: the scheduler admits the (partly known, so accepted) drafts
        llm.runner.spec.curve = StepTimeCurve([1, 1024], [0.01, 0.01])
    prompts, params, specs = workload(llm, trigger)
    seen = _partly_known_drafts(llm, ref_tokens)
    checked = _matchers_follow_accepted_tokens(llm)
    verified = _verified_drafts_are_grammar_valid(llm)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref_tokens
    assert [o.finish_reason for o in outs] == ref_reasons
    for spec, out in zip(specs[:len(SPECS)], outs):
        if out.finish_reason == "stop":
            assert out.token_ids[-1] == EOS and valid(spec, llm.tokenizer.decode(out.token_ids)), out.token_ids
    assert sum(r == "stop" for r in ref_reasons[:len(SPECS)]) >= 3  # the references are not all truncated
    trig = outs[len(SPECS)].token_ids
    assert trigger in trig and re.fullmatch("(yes|no)[0-9]", llm.tokenizer.decode(trig[trig.index(trigger) + 1:]))
    m = llm.runner.spec.metrics
    assert m.acceptance_per_position()[0] > 0.3 and m.effective_tokens_per_step > 1.3
    assert seen["truncated"] > 0 and checked["checked"] > 20 and verified["drafts"] > 20
    assert not llm.structured.grammars and llm.structured.stats.steps > 0


def test_seeded_sampling_with_speculation_stays_valid(checkpoints):
    llm = make(checkpoints["mtp"], num_speculative_tokens=3)
    prompts = [llm.tokenizer.encode(p) * 2 for p in PROMPTS]
    params = [SamplingParams(temperature=1.0, seq_seed=40 + i, max_tokens=MAX_TOKENS, structured_output=s)
              for i, s in enumerate(SPECS)]
    seen = _partly_known_drafts(llm, None)  # the drafter's own (sampled) drafts
    outs = [llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False) for _ in range(2)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]  # seeded: reproducible
    for spec, out in zip(SPECS, outs[0]):
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "stop":
            assert valid(spec, llm.tokenizer.decode(out.token_ids)), out.token_ids
        else:
            assert len(out.token_ids) == MAX_TOKENS and EOS not in out.token_ids
    assert sum(o.finish_reason == "stop" for o in outs[0]) >= 3
    assert seen["truncated"] > 0 and llm.runner.spec.metrics.steps > 0
