"""Batch-invariant mode on the compiled executor, on CPU: the decode graphs (emulated on
their padded buffers) and the prefill path run the mode's op namespace
(deepinfer/models/fast/invariant.py) over the kernels' torch references
(DEEPINFER_FASTPATH=ref, DEEPINFER_FAST_PREFILL=ref; the interpreted Triton kernels of the
mode are checked beside their references in tests/kernels/ and
tests/test_batch_invariance_kernels.py: a whole engine through the interpreter takes
minutes). Checks: the compiled-invariant engine equals the reference-invariant engine on
decode, prefill and mixed steps (greedy tokens equal, log-probs within float32
tolerance); a seeded request's tokens and log-probs are bitwise the same alone and among
6 and 11 others (chunked prefill through a small token budget, so its rows land in
decode graphs, prefill and mixed steps of different sizes; with the mode off the same
path gives 3 different outputs); a prompt's next token has the same bits after decode
steps as after one prefill step."""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any deepinfer_kernels module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint  # noqa: E402


VOCAB = 256
TARGET = [(7 * j + 3) % VOCAB for j in range(41)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_fast_invariant")
    write_tiny_checkpoint(str(path), seed=9, cfg=tiny_config(vocab_size=VOCAB, sliding_window=16, index_topk=4))
    return str(path)


def _llm(ckpt: str, monkeypatch, compiled: bool, graphs: str = "1", budget: int = 512, kind: str = "ref") -> LLM:
    mode = kind if compiled else "0"
    monkeypatch.setenv("DEEPINFER_FASTPATH", mode)
    monkeypatch.setenv("DEEPINFER_FAST_PREFILL", mode)
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", graphs)
    return LLM(ckpt, dtype="float32", batch_invariant=True, max_model_len=256, max_num_seqs=16,
               block_size=128, max_num_batched_tokens=budget)


def _others(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(1, 70, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_compiled_invariant_matches_reference_invariant(ckpt, monkeypatch):
    """Prefill (prompts 1..70 tokens over CSA / HCA windows and a block end), mixed steps
    (a small token budget splits prompts while others decode) and graphed decode steps."""
    prompts = [TARGET] + _others(4, seed=1)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref_llm = _llm(ckpt, monkeypatch, compiled=False, budget=48)
    assert ref_llm.runner.fast is None and ref_llm.runner.fast_prefill is None
    ref = ref_llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    llm = _llm(ckpt, monkeypatch, compiled=True, budget=48)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    fast, prefill = llm.runner.fast, llm.runner.fast_prefill
    assert fast.ops.invariant and prefill.ops.invariant
    assert fast.stats["graph_steps"] > 0 and prefill.stats["prefill_steps"] > 0
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids
        assert all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4) for x, y in zip(a.logprobs, b.logprobs))


def _target_in(llm: LLM, others: list[list[int]]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    sp = SamplingParams(temperature=0.9, seq_seed=1234, max_tokens=5, ignore_eos=True)
    other_sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = others[: len(others) // 2] + [TARGET] + others[len(others) // 2:]
    params = [other_sp] * len(prompts)
    params[len(others) // 2] = sp
    out = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)[len(others) // 2]
    return tuple(out.token_ids), tuple(out.logprobs)


def test_request_bitwise_across_batch_sizes(ckpt, monkeypatch):
    """A seeded request alone, among 6 and among 11 others: the same tokens and log-prob
    bits, with its rows spread over differently sized decode graphs, prefill and mixed steps."""
    llm = _llm(ckpt, monkeypatch, compiled=True, budget=40)
    results = {n: _target_in(llm, _others(n - 1, seed=n)) for n in (1, 7, 12)}
    stats = llm.runner.fast.stats
    assert stats["graph_steps"] > 0 and llm.runner.fast_prefill.stats["prefill_steps"] > 0
    assert len(set(results.values())) == 1, results


def test_decode_and_prefill_write_the_same_bits(ckpt, monkeypatch):
    """The compiled executor's two step kinds agree per row: a prompt prefilled in one step
    and the same tokens fed one decode step at a time (teacher-forced by generating with
    the prompt as a prefix) give bitwise the same logits for the next token."""
    llm = _llm(ckpt, monkeypatch, compiled=True, budget=512)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    decoded = llm.generate(prompt_token_ids=[TARGET[:20]], sampling_params=sp, use_tqdm=False)[0]
    full = TARGET[:20] + list(decoded.token_ids[:-1])  # rows 20.. came from decode steps above
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm2 = _llm(ckpt, monkeypatch, compiled=True, budget=512)
    again = llm2.generate(prompt_token_ids=[full], sampling_params=one, use_tqdm=False)[0]  # one prefill step
    assert again.token_ids[0] == decoded.token_ids[-1]
    assert again.logprobs[0] == decoded.logprobs[-1]  # bitwise


def test_mode_switch_keeps_default_ops(ckpt, monkeypatch):
    """Turning the mode off gives the executors their default namespaces back."""
    llm = _llm(ckpt, monkeypatch, compiled=True, graphs="0")
    runner = llm.runner
    assert runner.fast.ops.invariant
    runner.batch_invariant = False
    assert not getattr(runner.fast.ops, "invariant", False) and runner.fast.ops is runner.fast.default_ops
    assert not getattr(runner.fast_prefill.ops, "invariant", False)
