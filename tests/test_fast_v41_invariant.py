"""DeepSeek-V4.1 in batch-invariant mode on the compiled executor, on CPU: the decode steps
(v41/fast/forward.py, graphs emulated on their padded buffers) and the prefill / mixed
steps (v41/fast/prefill.py, every row through the decode step's per-row pieces) run the
mode's op namespace over the kernels' torch references (DEEPINFER_FASTPATH=ref,
DEEPINFER_FAST_PREFILL=ref). Checks: a seeded request's tokens and log-probs are bitwise
the same alone and among 6 and 63 others (a small token budget spreads its rows over
prefill, mixed and decode steps of different sizes); a prompt's next token has the same
bits after decode steps as after one prefill step; the compiled-invariant engine equals
the reference-invariant engine (greedy tokens, log-probs within float32 tolerance)."""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any deepinfer_kernels module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.models.tiny import tiny_v41_config, write_tiny_checkpoint  # noqa: E402

VOCAB = 256
TARGET = [(7 * j + 3) % VOCAB for j in range(41)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_v41_invariant")
    cfg = tiny_v41_config(vocab_size=VOCAB, sliding_window=16, index_topk=8, candidate_topk_blocks=2,
                          simulate_kv_quant=True)
    write_tiny_checkpoint(str(path), seed=5, cfg=cfg)
    return str(path)


def _llm(ckpt: str, monkeypatch, compiled: bool, budget: int, seqs: int = 64) -> LLM:
    mode = "ref" if compiled else "0"
    monkeypatch.setenv("DEEPINFER_FASTPATH", mode)
    monkeypatch.setenv("DEEPINFER_FAST_PREFILL", mode)
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
    return LLM(ckpt, dtype="float32", batch_invariant=True, max_model_len=128, max_num_seqs=seqs, block_size=16,
               max_num_batched_tokens=budget, enable_prefix_caching=False)


def _others(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(1, 24, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _target_in(llm: LLM, others: list[list[int]]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    sp = SamplingParams(temperature=0.9, seq_seed=1234, max_tokens=4, ignore_eos=True)
    other_sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    mid = len(others) // 2
    prompts = others[:mid] + [TARGET] + others[mid:]
    params = [other_sp] * len(prompts)
    params[mid] = sp
    out = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)[mid]
    return tuple(out.token_ids), tuple(out.logprobs)


def test_v41_request_bitwise_across_batch_sizes(ckpt, monkeypatch):
    """Alone, among 6 and among 63 others: the same tokens and log-prob bits."""
    llm = _llm(ckpt, monkeypatch, compiled=True, budget=48)
    assert llm.runner.fast.ops.invariant and llm.runner.fast_prefill.ops.invariant
    results = {n: _target_in(llm, _others(n - 1, seed=n)) for n in (1, 7, 64)}
    assert llm.runner.fast.stats["graph_steps"] > 0 and llm.runner.fast_prefill.stats["prefill_steps"] > 0
    assert len(set(results.values())) == 1, results


def test_v41_decode_and_prefill_write_the_same_bits(ckpt, monkeypatch):
    """A prompt prefilled in one step and the same tokens fed one decode step at a time
    give bitwise the same next-token log-prob."""
    llm = _llm(ckpt, monkeypatch, compiled=True, budget=256, seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    decoded = llm.generate(prompt_token_ids=[TARGET[:20]], sampling_params=sp, use_tqdm=False)[0]
    full = TARGET[:20] + list(decoded.token_ids[:-1])  # rows 20.. came from decode steps above
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    again = llm.generate(prompt_token_ids=[full], sampling_params=one, use_tqdm=False)[0]  # one prefill step
    assert again.token_ids[0] == decoded.token_ids[-1]
    assert again.logprobs[0] == decoded.logprobs[-1]  # bitwise


def test_v41_compiled_invariant_matches_reference_invariant(ckpt, monkeypatch):
    prompts = [TARGET] + _others(4, seed=1)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ref_llm = _llm(ckpt, monkeypatch, compiled=False, budget=32, seqs=8)
    assert ref_llm.runner.fast is None and ref_llm.runner.fast_prefill is None
    ref = ref_llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    llm = _llm(ckpt, monkeypatch, compiled=True, budget=32, seqs=8)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    assert llm.runner.fast_prefill.stats["prefill_steps"] > 0
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids
        assert all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4) for x, y in zip(a.logprobs, b.logprobs))


@pytest.mark.parametrize("replay", ["mask", "compact"])
def test_v41_invariant_under_bounded_replay(ckpt, monkeypatch, replay):
    """Bounded replay in the mode (decode_attention's per-row window floor at the cut): a
    seeded request with a prompt longer than keep has the same bits alone and among 6
    others, and the compiled engine's greedy tokens equal the reference-invariant engine's."""
    prompt = [(5 * j + 1) % VOCAB for j in range(60)]  # keep 22 -> cut 38

    def run(compiled: bool, others: list[list[int]]) -> list:
        mode = "ref" if compiled else "0"
        monkeypatch.setenv("DEEPINFER_FASTPATH", mode)
        monkeypatch.setenv("DEEPINFER_FAST_PREFILL", mode)
        monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
        llm = LLM(ckpt, dtype="float32", batch_invariant=True, max_model_len=128, max_num_seqs=8, block_size=16,
                  max_num_batched_tokens=32, enable_prefix_caching=False, swa_replay_mode=replay, swa_replay_keep=22)
        params = [SamplingParams(temperature=0.9, seq_seed=7, max_tokens=4, ignore_eos=True)] + \
            [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)] * len(others)
        out = llm.generate(prompt_token_ids=[prompt] + others, sampling_params=params, use_tqdm=False)
        if compiled:
            assert llm.runner.fast_prefill.stats["prefill_steps"] > 0
        return [(tuple(o.token_ids), tuple(o.logprobs)) for o in out]

    alone, among = run(True, [])[0], run(True, _others(6, seed=3))[0]
    assert alone == among
    ref = run(False, [])[0]
    assert ref[0] == alone[0]
    assert all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4) for x, y in zip(ref[1], alone[1]))
