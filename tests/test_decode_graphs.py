"""Decode graph coverage (deepinfer/models/fast/decode_graphs.py) on CPU, with emulated graphs
(DEEPINFER_FASTPATH=ref, DEEPINFER_CUDA_GRAPHS=1, DEEPINFER_CUDA_GRAPH_WARMUP=1): every
(rows bucket, width class) the limits allow is captured at start, nothing after it, a step
takes its own width class's graph, outputs equal the reference path's, for V4 and V4.1;
and the graph set's memory is measured by the memory profile before the KV cache is sized."""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any deepinfer_kernels module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.config import EngineConfig  # noqa: E402
from deepinfer.engine.memory_profile import LAZY_GRAPH_RESERVE_BYTES, MemoryProfile, decode_graph_memory  # noqa: E402
from deepinfer.models.fast.decode_graphs import (BUCKETS, DecodeGraphs, GraphMemory, allocation_bytes,  # noqa: E402
                                                 graph_shapes, input_bytes, rows_bucket, width_class)
from deepinfer.models.registry import build_model  # noqa: E402
from deepinfer.models.tiny import init_random, tiny_config, tiny_v41_config, write_tiny_checkpoint  # noqa: E402

VOCAB = 512
GIB = 1 << 30


@pytest.mark.parametrize("max_num_seqs,max_model_len,block_size", [(40, 1000, 128), (256, 1 << 20, 128),
                                                                    (1, 64, 16), (300, 5000, 64)])
def test_every_step_shape_the_limits_allow_is_in_the_set(max_num_seqs, max_model_len, block_size):
    """Any plain decode step (1..max_num_seqs requests, longest table of up to
    max_model_len - 1 tokens: the last step feeds position max_model_len - 2) maps to a
    shape of the set; the set is no larger than those shapes' buckets / width classes;
    largest first."""
    shapes = graph_shapes(max_num_seqs, max_model_len, block_size)
    assert len(set(shapes)) == len(shapes)
    assert all(a > b for a, b in zip(shapes, shapes[1:]))  # (rows, width) descending: largest first
    lens = sorted({1, 2, block_size - 1, block_size, block_size + 1, max_model_len // 3, max_model_len - 1} - {0})
    needed = {(rows_bucket(n) or BUCKETS[-1], width_class(-(-ctx // block_size)))
              for n in range(1, min(max_num_seqs, BUCKETS[-1]) + 1) for ctx in lens}
    assert needed <= set(shapes)
    widths = sorted({w for _, w in shapes})
    assert widths == [1 << i for i in range(len(widths))] and widths[-1] == max(w for _, w in needed)
    assert max(r for r, _ in shapes) == max(r for r, _ in needed)


def test_a_sealed_set_never_captures():
    graphs = DecodeGraphs(torch.device("cpu"))
    calls = []
    graphs.capture((2, 4), None, calls.append)
    graphs.seal()
    assert graphs.replay((2, 4), "a", lambda x: calls.append(x) or x) == "a"
    assert graphs.replay((4, 4), "b", lambda x: calls.append(x) or x) == "b"  # missing: eager, counted
    assert graphs.stats == {"captures": 1, "uncaptured_steps": 1} and graphs.captured == [(2, 4)]
    assert dict(graphs.replays) == {(2, 4): 1} and calls == ["a", "b"]
    with pytest.raises(RuntimeError, match="sealed"):
        graphs.capture((4, 4), None, calls.append)


@pytest.fixture(scope="module")
def v4_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_graphs_v4")
    write_tiny_checkpoint(str(path), seed=5, cfg=tiny_config(vocab_size=VOCAB, sliding_window=32, index_topk=4))
    return str(path)


@pytest.fixture(scope="module")
def v41_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_graphs_v41")
    cfg = tiny_v41_config(vocab_size=VOCAB, sliding_window=32, index_topk=8, candidate_topk_blocks=4)
    write_tiny_checkpoint(str(path), seed=13, cfg=cfg)
    return str(path)


def _engine(ckpt, monkeypatch, mode, block_size):
    monkeypatch.setenv("DEEPINFER_FASTPATH", mode)
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_WARMUP", "1")
    return LLM(ckpt, dtype="float32", max_model_len=8 * block_size, max_num_seqs=4, block_size=block_size,
               enable_prefix_caching=False)


@pytest.mark.parametrize("family,block_size", [("v4", 128), ("v41", 16)])
def test_steps_replay_their_own_width_class_and_nothing_is_captured_after_start(
        v4_ckpt, v41_ckpt, monkeypatch, family, block_size):
    ckpt = v4_ckpt if family == "v4" else v41_ckpt
    llm = _engine(ckpt, monkeypatch, "ref", block_size)
    fast = llm.runner.fast
    shapes = graph_shapes(4, 8 * block_size, block_size)
    assert fast.graphs.sealed and fast.graphs.captured == shapes == fast.warmed  # rows 4/2/1 x widths 8..1
    assert max(w for _, w in shapes) == 8
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    short = [[(3 * j + 1) % VOCAB for j in range(3)]]  # 3..8 tokens: one block
    pair = [[(5 * j + 2) % VOCAB for j in range(n)] for n in (3, block_size + 5)]  # longest table: 2 blocks
    outs = []
    for prompts, expect in ((short, {(1, 1)}), (pair, {(2, 2)})):
        fast.graphs.replays.clear()
        outs += llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        assert set(fast.graphs.replays) == expect  # its own class, never the 16-block one
        assert sum(fast.graphs.replays.values()) == 5  # every decode step (6 tokens, the first from prefill)
    stats = fast.stats
    assert stats["captures"] == len(shapes) and stats["uncaptured_steps"] == 0 and stats["eager_steps"] == 0
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "0")
    ref_llm = _engine(ckpt, monkeypatch, "0", block_size)
    assert ref_llm.runner.fast is None
    ref = [o for prompts in (short, pair)
           for o in ref_llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)]
    for a, b in zip(ref, outs):
        assert a.token_ids == b.token_ids
        assert all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4) for x, y in zip(a.logprobs, b.logprobs))


def _model():
    model = build_model(tiny_config(vocab_size=VOCAB, sliding_window=32, index_topk=4), torch.float32)
    init_random(model, 3)
    return model.eval()


def _v41_model():
    model = build_model(tiny_v41_config(vocab_size=VOCAB, sliding_window=32, index_topk=4), torch.float32)
    init_random(model, 3)
    return model.eval()


def test_graph_memory_is_profiled_before_the_cache_is_sized(monkeypatch):
    """The probe captures the largest shape over a one-block cache and measures its outputs
    per row (float32 logits of the vocabulary, the greedy lane's packed pair, log-sum-exp,
    argmax, its log-prob, state slots); the set's bound grows by exactly the outputs and
    input buffers of the shapes a longer max_model_len adds."""
    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_WARMUP", "1")
    model, cpu = _model(), torch.device("cpu")
    small = EngineConfig(max_model_len=512, max_num_seqs=4, block_size=128, accelerator="cpu")
    large = EngineConfig(max_model_len=2048, max_num_seqs=4, block_size=128, accelerator="cpu")
    mem, bound = decode_graph_memory(model, small, cpu)
    assert mem.probe == (4, 4) and mem.n_groups == 3 and mem.pool_bytes is None  # no allocator on a host
    assert mem.shapes == tuple(graph_shapes(4, 512, 128))  # the set the warm-up captures
    assert mem.output_row_bytes == (VOCAB * 4, 16, 4, 8, 4, 8)
    mem_large, bound_large = decode_graph_memory(model, large, cpu)
    assert mem_large.probe == (4, 16) and mem_large.output_row_bytes == mem.output_row_bytes
    added = set(graph_shapes(4, 2048, 128)) - set(graph_shapes(4, 512, 128))
    assert added == {(r, w) for r in (4, 2, 1) for w in (8, 16)}
    extra = sum(mem.outputs_bytes(r) + allocation_bytes(input_bytes(r, w, 3)) for r, w in added)
    assert bound_large - bound == extra > 0
    assert bound == sum(mem.outputs_bytes(r) + allocation_bytes(input_bytes(r, w, 3))
                        for r, w in graph_shapes(4, 512, 128))
    # no graph set to size: graphs off, batch-invariant mode; speculative decoding captures
    # on first use (a fixed reserve on CUDA, nothing on a host)
    assert decode_graph_memory(model, EngineConfig(max_model_len=512, max_num_seqs=4, batch_invariant=True,
                                                   accelerator="cpu"), cpu) == (None, 0)
    spec = EngineConfig(max_model_len=512, max_num_seqs=4, num_speculative_tokens=2, accelerator="cpu")
    assert decode_graph_memory(model, spec, cpu) == (None, 0) and LAZY_GRAPH_RESERVE_BYTES > 0
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "0")
    assert decode_graph_memory(model, small, cpu) == (None, 0)


def test_a_measured_set_is_its_own_bound_and_a_host_gets_the_outputs_floor():
    """On CUDA the probe captures the whole set the warm-up will capture and measures it:
    that measurement is the bound for exactly those shapes (no model of the pool's
    temporaries, which over- or under-counted on an H200). Without one (a host, or another
    shape list) the bound is every graph's outputs plus every input buffer."""
    shapes = graph_shapes(8, 4 * 128 - 1, 128)
    floor = sum(allocation_bytes((3 << 20) * r) + allocation_bytes(16 * r) + allocation_bytes(input_bytes(r, w, 2))
                for r, w in shapes)
    measured = GraphMemory((8, 4), pool_bytes=40 << 20, output_row_bytes=(3 << 20, 16), eager_peak_bytes=GIB,
                           n_groups=2, shapes=tuple(shapes))
    assert measured.bound(shapes) == 40 << 20  # the measurement, even below the outputs' floor
    assert measured.bound(shapes[1:]) == floor - allocation_bytes((3 << 20) * 8) - allocation_bytes(16 * 8) \
        - allocation_bytes(input_bytes(8, 4, 2))  # another set: the floor of its own shapes
    host = GraphMemory((8, 4), None, (3 << 20, 16), None, 2, tuple(shapes))
    assert host.bound(shapes) == floor
    assert allocation_bytes(1) == 512 and allocation_bytes((1 << 20) + 1) == 2 << 20
    # what the KV budget keeps free: the larger eager peak plus the graphs
    assert MemoryProfile(6 * GIB, 2 * GIB, measured).total == 8 * GIB
    assert MemoryProfile(6 * GIB, 2 * GIB, GraphMemory((1, 1), 0, (4,), 7 * GIB, 3)).total == 9 * GIB
    assert MemoryProfile(6 * GIB, 0, None).total == 6 * GIB


def test_a_step_wider_than_the_largest_bucket_runs_eagerly_without_a_capture(v4_ckpt, monkeypatch):
    """A short last prompt chunk joins three decoding requests: 3 + 7 rows, more than the
    largest bucket (4 = max_num_seqs). Before the set was sealed such a step captured a
    10-row graph while serving; now it runs eagerly on the fast path (counted), and the
    tokens stay the reference path's."""
    prompts = [[(7 * j + i) % VOCAB for j in range(n)] for i, n in enumerate((3, 3, 3, 14))]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = {}
    for mode in ("0", "ref"):
        monkeypatch.setenv("DEEPINFER_FASTPATH", mode)
        monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
        monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_WARMUP", "1")
        llm = LLM(v4_ckpt, dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16,
                  enable_prefix_caching=False, async_scheduling=False)
        outs[mode] = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    stats = llm.runner.fast.stats
    assert stats["captures"] == len(llm.runner.fast.warmed) == 6  # rows 4/2/1 x widths 2/1 (255-token tables)
    assert stats["eager_steps"] >= 1 and stats["uncaptured_steps"] == 0 and stats["graph_steps"] > 0
    for a, b in zip(outs["0"], outs["ref"]):
        assert a.token_ids == b.token_ids
        assert all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4) for x, y in zip(a.logprobs, b.logprobs))


@pytest.mark.parametrize("fast_prefill,max_model_len,ran", [("ref", 512, 4), ("ref", 160, 3), ("0", 512, 0)])
@pytest.mark.parametrize("family", ["v4", "v41"])
def test_prefill_step_kinds_warm_on_the_engines_prefill_path(monkeypatch, fast_prefill, max_model_len, ran, family):
    """The start-up compile warm-up runs each prefill kind the limits allow (one-token prompt,
    odd lengths, a second chunk beside a decoding row, 16 prompts) on the prefill executor the
    engine builds for the model's family (V4.1's too: it warmed nothing when the warm-up named
    V4's path); none without a compiled one."""
    from deepinfer.engine.prefill_warmup import warm_prefill_kinds

    monkeypatch.setenv("DEEPINFER_FAST_PREFILL", fast_prefill)
    cfg = EngineConfig(max_model_len=max_model_len, max_num_seqs=16, block_size=128, accelerator="cpu")
    model = _model() if family == "v4" else _v41_model()
    real_empty = torch.empty

    def garbage(*shape, **kw):  # what an uninitialised allocation may hold (V4.1's Engram reads indices)
        t = real_empty(*shape, **kw)
        return t.fill_(1 << 40) if not t.is_floating_point() else t.fill_(float("nan"))
    monkeypatch.setattr(torch, "empty", garbage)
    assert warm_prefill_kinds(model, cfg, torch.device("cpu")) == ran


def test_the_token_ladder_covers_every_token_band_the_limits_allow():
    """The GPU warm-up's ladder of prefill token counts stops at the step budget, splits each
    total over 8 new prompts, over more when max_model_len needs it, never over more than
    max_num_seqs (a total that still does not fit is dropped)."""
    from deepinfer.engine.prefill_warmup import LADDER_TOKENS, token_ladder

    steps = token_ladder(max_tokens=8192, max_seqs=256, max_model_len=65536)
    totals = [sum(n for _, n, _ in kind) for kind in steps]
    assert totals == [t for t in LADDER_TOKENS if t <= 8192] and 800 in totals
    assert all(len(kind) == 8 and all(start == 0 and new for start, _, new in kind) for kind in steps)
    assert [n for _, n, _ in steps[totals.index(800)]] == [100] * 8
    two = token_ladder(max_tokens=100, max_seqs=2, max_model_len=40)
    assert [[n for _, n, _ in kind] for kind in two] == [[24, 24], [32, 32]]  # 96 would need 48 > 40
    short = token_ladder(max_tokens=8192, max_seqs=64, max_model_len=448)  # serve_h200's engine
    assert sum(n for _, n, _ in short[-1]) == 8192 and len(short[-1]) == 19  # not 8 prompts of 1024
    assert all(max(n for _, n, _ in kind) <= 448 for kind in short)


def test_the_prefix_ladder_spans_every_table_width_class_on_a_small_cache():
    """Table widths double from 2 blocks up to the cap, each as a table ending on a block
    boundary (2**k blocks: a width divisible by 16 from 16 on, as the decode grid's first
    b1 x 2048-token cell had) and one block past it; the throwaway cache gives the cached
    prefix one shared block, so a 1M-token prefix costs a handful of blocks."""
    from deepinfer.engine.prefill_warmup import _step, prefix_ladder

    kinds = prefix_ladder(block_size=128, max_model_len=1 << 20, max_tokens=8192)
    widths = [-(-(start + n) // 128) for (start, n, new), in kinds]
    assert widths == [w for k in range(1, 14) for w in (2 ** k, 2 ** k + 1)][:-1]  # 8193 blocks > 1M tokens
    assert ((1920, 128, False),) in kinds and all(not new and start % 128 == 0 for (start, _, new), in kinds)
    batch, blocks = _step(((1 << 19, 200, False),), 128, ["swa", "csa"], torch.device("cpu"), VOCAB)
    table = batch.seqs[0].block_table["swa"]
    assert blocks == 1 + 2  # the shared prefix block + two blocks for tokens 524288..524487
    assert len(table) == 4096 + 2 and set(table[:4096]) == {0} and table[4096:] == [1, 2]
    assert batch.positions[0].item() == 1 << 19 and len(batch.input_ids) == 200


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_the_token_ladder_runs_on_the_prefill_path(family, monkeypatch):
    """With the ladder on (a GPU's default) the warm-up runs its steps after the kinds, each
    within the step budget: 4 kinds + totals 48..256 (6 steps) of 8 prompts + one request
    continuing on tables of 2, 3, 4 blocks (3 steps; 5 blocks would pass max_model_len)."""
    from deepinfer.engine.prefill_warmup import warm_prefill_kinds

    monkeypatch.setenv("DEEPINFER_FAST_PREFILL", "ref")
    cfg = EngineConfig(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256, block_size=128,
                       accelerator="cpu")
    model = _model() if family == "v4" else _v41_model()
    assert warm_prefill_kinds(model, cfg, torch.device("cpu"), ladder=True) == 4 + 6 + 3
    assert warm_prefill_kinds(model, cfg, torch.device("cpu")) == 4  # off on a CPU


def test_the_sampler_warms_every_lane_before_the_first_generate():
    """Every prefill step samples through ``Sampler.sample`` (the decode graphs' greedy lane
    compiled only the packed reduction): each lane runs once at start on logits of the
    model's vocabulary; a single row cannot hold a greedy row beside a sampled one."""
    from deepinfer.engine.prefill_warmup import warm_sampler

    assert warm_sampler(VOCAB, torch.device("cpu")) == ["greedy", "sampled", "top_logprobs"]
    with pytest.raises(ValueError, match="rows must be >= 2"):
        warm_sampler(VOCAB, torch.device("cpu"), rows=1)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_that_reaches_max_model_len_never_leaves_the_graph_set(v4_ckpt, monkeypatch, async_scheduling):
    """The widest class holds a table of max_model_len - 1 tokens (graph_shapes): a request
    generating up to max_model_len = 2 blocks exactly (so a table for max_model_len + 1
    tokens would need a 3rd block and the 4-wide class) runs every decode step on a graph
    of the 2-wide set, nothing uncaptured, and stops at max_model_len."""
    block_size = 128  # the tiny model's largest compress ratio
    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_WARMUP", "1")
    llm = LLM(v4_ckpt, dtype="float32", max_model_len=2 * block_size, max_num_seqs=2, block_size=block_size,
              enable_prefix_caching=False, async_scheduling=async_scheduling)
    fast = llm.runner.fast
    assert max(w for _, w in fast.warmed) == 2
    prompts = [[(3 * j + i) % VOCAB for j in range(n)] for i, n in enumerate((2 * block_size - 6, 2 * block_size - 9))]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=64,
                                                                                 ignore_eos=True), use_tqdm=False)
    assert [len(o.prompt_token_ids) + len(o.token_ids) for o in outs] == [2 * block_size] * 2
    assert fast.stats["uncaptured_steps"] == 0 and fast.stats["eager_steps"] == 0 and fast.stats["graph_steps"] > 0
    assert {w for _, w in fast.graphs.replays} == {2}
