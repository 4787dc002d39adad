"""Prefill fast path (deepinfer/models/v4/fast/prefill*.py) on CPU: prefill and mixed steps run
batched over all requests with the kernels' torch references (DEEPINFER_FAST_PREFILL=ref)
or the interpreted kernels (=triton) and must give the reference path's greedy tokens
and log-probs on a tiny model: whole prompts, chunked prefill with chunk boundaries
inside compression windows, decode rows mixed into prefill steps, prefix-cache hits
(the CSA ring restored from a block's tail) and preemption."""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any deepinfer_kernels module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.errors import ConfigError  # noqa: E402
from deepinfer.models.v4.fast.prefill import PrefillPath  # noqa: E402
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint  # noqa: E402

VOCAB = 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_fast_prefill")
    write_tiny_checkpoint(str(path), seed=11, cfg=tiny_config(vocab_size=VOCAB, sliding_window=32, index_topk=4))
    return str(path)


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, VOCAB, (130,), generator=g).tolist()  # one full 128-token block + 2
    lens = (1, 7, 33, 129, 262)  # window 32, CSA windows of 4, HCA of 128, blocks of 128
    out = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]
    return out + [shared + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 60)]


def _generate(ckpt, monkeypatch, mode, prompts, **engine):
    monkeypatch.setenv("DEEPINFER_FAST_PREFILL", mode)
    llm = LLM(ckpt, dtype="float32", max_model_len=512, max_num_seqs=8, block_size=128, **engine)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, top_logprobs=2)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    # the same prompts again: prefix-cache hits resume at block boundaries
    outs += llm.generate(prompt_token_ids=prompts[3:], sampling_params=sp, use_tqdm=False)
    return llm, outs


def _assert_same(ref, fast):
    for a, b in zip(ref, fast):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4), (x, y)
        for ta, tb in zip(a.top_logprobs, b.top_logprobs):
            assert [t for t, _ in ta] == [t for t, _ in tb]


# 50-token budget: chunks end mid-window and steps mix decode rows with prefill chunks;
# a 6-block pool forces preemption by recompute.
@pytest.mark.parametrize("engine", [{}, {"max_num_batched_tokens": 50},
                                    {"num_kv_blocks": 6, "max_num_batched_tokens": 128}],
                         ids=["whole", "chunked-mixed", "preempt"])
def test_fast_prefill_matches_reference(ckpt, monkeypatch, fresh_seed, engine):
    prompts = _prompts(fresh_seed)
    ref_llm, ref = _generate(ckpt, monkeypatch, "0", prompts, **engine)
    assert ref_llm.runner.fast_prefill is None
    fast_llm, fast = _generate(ckpt, monkeypatch, "ref", prompts, **engine)
    assert fast_llm.runner.fast_prefill.stats["prefill_steps"] > 0
    assert sum(o.metrics.num_cached_tokens for o in fast[len(prompts):]) >= 3 * 128, "prefix hits ran"
    if "num_kv_blocks" in engine:
        assert sum(o.metrics.num_preemptions for o in fast) > 0
    _assert_same(ref, fast)


def test_fast_prefill_triton_interpreted(ckpt, monkeypatch):
    """The prefill kernels (interpreted) behind the same dispatch, a short chunked run; the
    ops shared with the decode path (mHC, router, fused MoE) keep their torch references
    here (their interpreted kernels have their own tests and take minutes end to end)."""
    from deepinfer_kernels import prefill_attention, prefill_indexer

    prompts = [[(5 * j + 1) % VOCAB for j in range(n)] for n in (6, 45)]  # chunks, CSA + HCA entries
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs = {}
    for mode in ("0", "ref"):
        monkeypatch.setenv("DEEPINFER_FAST_PREFILL", mode)
        llm = LLM(ckpt, dtype="float32", max_model_len=256, max_num_seqs=4, block_size=128,
                  max_num_batched_tokens=24)
        if mode == "ref":
            ops = llm.runner.fast_prefill.ops
            ops.prefill_attention = prefill_attention.prefill_attention
            ops.prefill_indexer_topk = prefill_indexer.prefill_indexer_topk
        outs[mode] = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    assert llm.runner.fast_prefill.stats["prefill_steps"] >= 2
    for a, b in zip(outs["0"], outs["ref"]):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4), (x, y)


def test_fast_prefill_selection(ckpt, monkeypatch):
    monkeypatch.delenv("DEEPINFER_FAST_PREFILL", raising=False)
    llm = LLM(ckpt, dtype="float32", max_model_len=256, max_num_seqs=2)
    assert llm.runner.fast_prefill is None  # CPU: the reference path
    monkeypatch.setenv("DEEPINFER_FAST_PREFILL", "ref")
    assert PrefillPath.create(llm.runner.model, llm.runner.cache).ops.kind == "ref"
    monkeypatch.setenv("DEEPINFER_FAST_PREFILL", "yes")
    with pytest.raises(ConfigError, match="DEEPINFER_FAST_PREFILL='yes'.*auto, 0, triton, ref"):
        PrefillPath.create(llm.runner.model, llm.runner.cache)
