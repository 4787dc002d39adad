"""GPU fast path (deepinfer/models/fast) on CPU: the batched pure-decode path, run with the
kernels' torch references (DEEPINFER_FASTPATH=ref), must give the reference path's
greedy tokens and log-probs on a tiny model; and the dispatch picks the right path."""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any deepinfer_kernels module is imported

import pytest  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.models.fast.runner import FastPath  # noqa: E402
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint  # noqa: E402

VOCAB = 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_fast")
    write_tiny_checkpoint(str(path), seed=5, cfg=tiny_config(vocab_size=VOCAB, sliding_window=32, index_topk=4))
    return str(path)


def _run(ckpt, monkeypatch, mode, graphs="0"):
    monkeypatch.setenv("DEEPINFER_FASTPATH", mode)
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", graphs)
    # decode crosses block ends (127, 255: tails, an HCA window) and many CSA windows (ratio 4)
    llm = LLM(ckpt, dtype="float32", max_model_len=512, max_num_seqs=8, block_size=128)
    prompts = [[(3 * i + 7 * j) % VOCAB for j in range(n)] for i, n in enumerate((1, 5, 37, 120, 250))]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, top_logprobs=3)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    # a prefix-cache hit on the block that decode completed restores the CSA ring from its tail
    again = [o.prompt_token_ids + o.token_ids for o in outs[3:]]
    outs += llm.generate(prompt_token_ids=again, sampling_params=sp, use_tqdm=False)
    return llm, outs


@pytest.mark.parametrize("graphs", ["0", "1"])  # "1": the graph path's padded static buffers, run eagerly
def test_fast_decode_matches_reference(ckpt, monkeypatch, graphs):
    ref_llm, ref = _run(ckpt, monkeypatch, "0")
    assert ref_llm.runner.fast is None
    fast_llm, fast = _run(ckpt, monkeypatch, "ref", graphs)
    stats = fast_llm.runner.fast.stats
    assert stats["fast_steps"] > 0 and (stats["graph_steps"] > 0) == (graphs == "1")
    for a, b in zip(ref, fast):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4)
        for ta, tb in zip(a.top_logprobs, b.top_logprobs):
            assert [t for t, _ in ta] == [t for t, _ in tb]
            for (_, x), (_, y) in zip(ta, tb):
                assert math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4)


def _short_run(ckpt, monkeypatch, mode, graphs, params):
    monkeypatch.setenv("DEEPINFER_FASTPATH", mode)
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", graphs)
    llm = LLM(ckpt, dtype="float32", max_model_len=256, max_num_seqs=4, block_size=128)
    prompts = [[(5 * i + 3 * j) % VOCAB for j in range(n)] for i, n in enumerate((3, 40, 130))]
    return llm, llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


def test_greedy_lane_samples_inside_the_graph(ckpt, monkeypatch):
    """All-greedy graphed decode steps without top log-probs take the graph's own argmax /
    log-sum-exp (no sampler launch, one packed copy): the reference path's tokens and
    log-probs. A batch with a random row samples through the sampler, which reuses the
    graph's log-sum-exp: the same tokens and log-probs as without graphs."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    _, ref = _short_run(ckpt, monkeypatch, "0", "0", greedy)
    lane_llm, lane = _short_run(ckpt, monkeypatch, "ref", "1", greedy)
    assert lane_llm.runner.greedy_lane_steps >= 7
    for a, b in zip(ref, lane):
        assert a.token_ids == b.token_ids
        assert all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4) for x, y in zip(a.logprobs, b.logprobs))
    mixed = [greedy, SamplingParams(temperature=0.9, seq_seed=7, max_tokens=8, ignore_eos=True), greedy]
    eager_llm, eager = _short_run(ckpt, monkeypatch, "ref", "0", mixed)
    graph_llm, graphed = _short_run(ckpt, monkeypatch, "ref", "1", mixed)
    assert graph_llm.runner.greedy_lane_steps == 0 and graph_llm.runner.fast.stats["graph_steps"] >= 7
    for a, b in zip(eager, graphed):
        assert a.token_ids == b.token_ids
        assert all(math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-5) for x, y in zip(a.logprobs, b.logprobs))


def test_fast_path_selection(ckpt, monkeypatch):
    monkeypatch.delenv("DEEPINFER_FASTPATH", raising=False)
    llm = LLM(ckpt, dtype="float32", max_model_len=256, max_num_seqs=2)
    assert llm.runner.fast is None  # CPU keeps the reference path
    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    fast = FastPath.create(llm.runner.model, llm.runner.cache)
    assert fast is not None and not fast.graphs_enabled and fast.ops.kind == "ref"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
def test_fast_decode_triton_interpreted(ckpt, monkeypatch):
    """The real kernels (interpreted) behind the same dispatch, a short run."""
    prompts = [[(5 * j + 1) % VOCAB for j in range(n)] for n in (6, 37)]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = {}
    for mode in ("0", "triton"):
        monkeypatch.setenv("DEEPINFER_FASTPATH", mode)
        llm = LLM(ckpt, dtype="float32", max_model_len=256, max_num_seqs=4)
        outs[mode] = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    assert llm.runner.fast.ops.kind == "triton" and llm.runner.fast.stats["fast_steps"] == 4
    for a, b in zip(outs["0"], outs["triton"]):
        assert a.token_ids == b.token_ids
        assert all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4) for x, y in zip(a.logprobs, b.logprobs))


def test_expert_parallel_layers_keep_the_reference_path(ckpt, monkeypatch):
    """An expert-parallel MoE replacement (this rank's expert slots, all-to-all inside) is not
    something the fused MoE can run: a model with one takes the reference path for decode."""
    import torch

    from deepinfer.parallel.comm import EPComm
    from deepinfer.parallel.expert_parallel import ExpertParallelMoE

    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    llm = LLM(ckpt, dtype="float32", max_model_len=256, max_num_seqs=2)
    layer = llm.runner.model.layers[1]
    layer.ffn = ExpertParallelMoE(layer.ffn, 1, torch.arange(layer.ffn.n_experts), EPComm())
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=sp, use_tqdm=False)
    assert len(out[0].token_ids) == 3 and llm.runner.fast.stats["fast_steps"] == 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_fast_decode_on_quantized_experts(tmp_path, monkeypatch, expert_dtype):
    """A checkpoint in the official quantized layout (FP8 32x32-block dense weights, FP4 or
    FP8 experts): the fast path runs the routed experts from their checkpoint bytes through
    the weight-only quantized MoE kernels (interpreted) and their torch references, with
    no dense expert weights anywhere, and decodes the reference path's greedy tokens."""
    cfg = tiny_config(vocab_size=VOCAB, sliding_window=32, index_topk=4, fp8_block=(32, 32),
                      expert_dtype=expert_dtype)
    write_tiny_checkpoint(str(tmp_path), seed=11, quantize=True, cfg=cfg)
    prompts = [[(5 * j + 2 * i + 1) % VOCAB for j in range(n)] for i, n in enumerate((3, 40))]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = {}
    for mode in ("0", "ref", "triton"):
        monkeypatch.setenv("DEEPINFER_FASTPATH", mode)
        llm = LLM(str(tmp_path), dtype="float32", max_model_len=256, max_num_seqs=4, cpu_dense_weights=False)
        outs[mode] = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        if mode != "0":
            assert llm.runner.fast.stats["fast_steps"] > 0
            for layer in llm.runner.model.layers:
                stacks = layer.ffn._fast_qstacks
                assert stacks.fmt == expert_dtype
                assert all(ex.w1._parameters.get("weight") is None for ex in layer.ffn.experts)
                assert layer.ffn.experts[1].w2.quantized.data.data_ptr() == stacks.w2[1].data_ptr()  # views
    for mode in ("ref", "triton"):
        for a, b in zip(outs["0"], outs[mode]):
            assert a.token_ids == b.token_ids, mode
            for x, y in zip(a.logprobs, b.logprobs):
                assert math.isclose(x, y, rel_tol=1e-3, abs_tol=1e-3), mode


def test_graph_warmup_shapes_largest_first():
    shapes = FastPath.warmup_shapes(max_num_seqs=40, max_model_len=1000, block_size=128)
    rows = sorted({r for r, _ in shapes}, reverse=True)
    assert rows == [64, 32, 16, 8, 4, 2, 1]  # up to the first bucket holding 40 rows
    assert sorted({w for _, w in shapes}) == [1, 2, 4, 8]  # 1001 tokens: 8 blocks
    assert shapes[0] == (64, 8) and shapes[-1] == (1, 1) and len(shapes) == 28
    assert all(a[0] > b[0] or (a[0] == b[0] and a[1] > b[1]) for a, b in zip(shapes, shapes[1:]))


def test_graph_warmup_leaves_results_unchanged(ckpt, monkeypatch):
    """Warm-up runs dummy decode steps of every shape (here eagerly on the host cache, as on a
    GPU it captures them) writing block 0 / slot 0: a run after it decodes what a run
    without it does."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_WARMUP", "0")
    cold_llm, cold = _short_run(ckpt, monkeypatch, "ref", "1", params)
    assert cold_llm.graphs_warmed == 0
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_WARMUP", "1")
    warm_llm, warm = _short_run(ckpt, monkeypatch, "ref", "1", params)
    # rows 4/2/1 x widths 2/1: a decode step's table holds at most max_model_len - 1 = 255 tokens
    assert warm_llm.graphs_warmed == len(warm_llm.runner.fast.warmed) == 6
    assert warm_llm.runner.fast.warmed[0] == (4, 2)
    for a, b in zip(cold, warm):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
