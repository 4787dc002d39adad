"""Constrained greedy decoding equals a brute-force reference on a small vocabulary.

The checkpoint is a tiny random model with a 448-wide head and its own byte-level
BPE tokenizer (399 tokens trained here on JSON-like text; ids 399..447 exist in the
logits but not in the tokenizer, so they must never be allowed). The engine masks
logits with xgrammar's bitmask; the reference runs the same model through the
standalone runner (no scheduler, no bitmask) and, at every step, tries *every*
token id with the matcher (accept_token + rollback) and takes the argmax over the
accepted ones (lowest id on ties, like torch.argmax).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.standalone import StandaloneRunner
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint
from deepinfer.structured.spec import StructuredOutputSpec

from structured_common import TOKENIZER_VOCAB, VOCAB, train_small_tokenizer

xgr = pytest.importorskip("xgrammar")
tokenizers = pytest.importorskip("tokenizers")
MAX_TOKENS = 40

SPECS = [
    StructuredOutputSpec("json", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 4}, "n": {"type": "integer", "minimum": 0, "maximum": 300},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}, "required": ["name", "n"]}),
    StructuredOutputSpec("json", {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}),
    StructuredOutputSpec("regex", r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"),
    StructuredOutputSpec("ebnf", 'root ::= term (("+" | "*") term)*\nterm ::= [0-9]+ | "(" root ")"'),
    StructuredOutputSpec("json_object"),
]


@pytest.fixture(scope="module")
def small_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = tmp_path_factory.mktemp("small_vocab_ckpt")
    write_tiny_checkpoint(str(path), seed=3, cfg=tiny_config(vocab_size=VOCAB))
    train_small_tokenizer(path)
    return LLM(str(path), dtype="float32", max_model_len=256, max_num_batched_tokens=24, max_num_seqs=8)


def brute_force_greedy(llm: LLM, prompt: list[int], compiled: object) -> list[int]:
    runner = StandaloneRunner(llm.model, max_seqs=1, max_len=256)
    matcher = xgr.GrammarMatcher(compiled)
    logits = runner.step([(0, prompt)])[0][-1]
    out: list[int] = []
    while len(out) < MAX_TOKENS:
        allowed = []
        for t in range(VOCAB):  # every candidate, checked with the matcher itself
            if matcher.accept_token(t):
                allowed.append(t)
                matcher.rollback(1)
        assert allowed, "the grammar must always allow a token until it terminates"
        best = max(allowed, key=lambda t: (logits[t].item(), -t))
        assert matcher.accept_token(best)
        out.append(best)
        if matcher.is_terminated():
            break
        logits = runner.step([(0, [best])])[0][-1]
    return out


def test_engine_equals_brute_force_reference(small_llm: LLM) -> None:
    tok = small_llm.tokenizer
    prompts = [tok.encode(p) for p in ('{"name": "ab", "n": 5}', "write: ", "mail me at", "(1+2)*3 =", "{}")]
    prompts = [p * 3 for p in prompts]  # longer than the 24-token budget: chunked prefill
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_output=s) for s in SPECS]
    # plus one unconstrained request in the same batch
    outs = small_llm.generate(prompt_token_ids=prompts + [prompts[0]],
                              sampling_params=params + [SamplingParams(temperature=0.0, max_tokens=8)],
                              use_tqdm=False)
    stops = 0
    for prompt, spec, out in zip(prompts, SPECS, outs):
        compiled = small_llm.structured.pool.submit(spec).result()
        ref = brute_force_greedy(small_llm, prompt, compiled)
        assert out.token_ids == ref, f"{spec.kind}: engine {out.token_ids} != reference {ref}"
        assert all(t < TOKENIZER_VOCAB for t in out.token_ids)  # padded ids never allowed
        stops += out.finish_reason == "stop"
        assert out.finish_reason == ("stop" if ref[-1] == 1 else "length")
    assert stops >= 3  # the references are not all truncated
    assert max(outs[-1].token_ids) >= 0 and len(outs[-1].token_ids) == 8


def test_logits_width_is_the_bitmask_width(small_llm: LLM) -> None:
    pool = small_llm.structured.pool
    assert pool.compiler is not None
    info = pool.submit(SPECS[2]).result().tokenizer_info
    assert info.vocab_size == VOCAB == small_llm.model_config.vocab_size
    assert set(range(TOKENIZER_VOCAB, VOCAB)) <= set(info.special_token_ids)
    assert torch.equal(torch.tensor(info.stop_token_ids), torch.tensor([1]))
