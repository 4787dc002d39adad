"""The graphed DSpark draft step (fast/draft_graphs.py, fast/draft_dspark.py, v4/fast/draft.py) on the host:
the fast path forced with the kernels' torch references, graphs emulated on the padded
bucket buffers. Every draft step of a real generation is also run by the eager drafter
(the fused-kernel pass and the reference modules): same draft tokens, same confidences
(within float32 rounding) for greedy requests, same tokens for seeded stochastic ones
and the same draft distributions; greedy output with the graphed drafter equals
greedy output without speculation. V4 and V4.1 (three stages, shifted hyper-connections)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any deepinfer_kernels module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.models.tiny import tiny_dspark_config, tiny_v41_config, write_tiny_checkpoint  # noqa: E402

from spec_common import VOCAB, assert_same_drafts, mixed_prompts, run_recording_drafts  # noqa: E402

GREEDY = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 9, 14)]
SEEDED = [SamplingParams(temperature=0.8, seq_seed=s, max_tokens=10, ignore_eos=True) for s in (1, 2, 3)]


def _checkpoint(path, family: str) -> str:
    cfg = (tiny_dspark_config(vocab_size=VOCAB, sliding_window=32) if family == "v4"
           else tiny_v41_config(vocab_size=VOCAB, sliding_window=32))
    write_tiny_checkpoint(str(path), seed=3, cfg=cfg)
    return str(path)


@pytest.fixture(scope="module", params=["v4", "v41"])
def ckpt(request, tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp(f"draft_graphs_{request.param}"), request.param)


def _llm(ckpt: str, monkeypatch, spec: int) -> LLM:
    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
    return LLM(ckpt, dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
               num_speculative_tokens=spec)


def _compare_every_step(llm: LLM) -> list[tuple]:
    """Wrap the drafter: each step's graphed drafts next to the eager fused-kernel drafts and
    the reference modules' drafts of the same context (feature writes are idempotent)."""
    drafter = llm.runner.spec.drafter
    real, steps = drafter.propose, []

    def propose(ctx, k):
        graphs, ops = drafter.graphs, drafter.fast_ops
        drafter.graphs = None
        fused = real(ctx, k)
        drafter.fast_ops = None
        ref = real(ctx, k)
        drafter.graphs, drafter.fast_ops = graphs, ops
        out = real(ctx, k)
        steps.append((dict(out), fused, ref))  # the spec runner empties the dict it keeps
        return out

    drafter.propose = propose
    return steps


def _prompts() -> list[list[int]]:
    return [p[:40] for p in mixed_prompts()[:3]]


@pytest.mark.parametrize("params", ["greedy", "seeded"])
def test_graphed_drafts_equal_eager_drafter(ckpt, monkeypatch, params):
    llm = _llm(ckpt, monkeypatch, 4)
    drafter = llm.runner.spec.drafter
    assert drafter.graphs is not None and drafter.graphs.graphs.sealed
    assert len(drafter.graphs.graphs.captured) == 2 * len(drafter.graphs.buckets)  # greedy + sample per bucket
    steps = _compare_every_step(llm)
    llm.generate(prompt_token_ids=_prompts(), sampling_params=GREEDY if params == "greedy" else SEEDED,
                 use_tqdm=False)
    assert drafter.graphs.stats["graph_steps"] == len(steps) > 3
    assert drafter.graphs.stats["eager_steps"] == 0
    for out, fused, ref in steps:
        for other in (fused, ref):
            assert sorted(out) == sorted(other)
            for rid, d in out.items():
                e = other[rid]
                assert d.tokens == e.tokens and len(d.tokens) == 4
                assert d.confidences == pytest.approx(e.confidences, abs=1e-5)
                assert (d.probs is None) == (e.probs is None) == (params == "greedy")
                if d.probs is not None:
                    torch.testing.assert_close(d.probs, e.probs, atol=1e-5, rtol=1e-4)


def test_greedy_speculation_with_graphed_drafter_equals_off(ckpt, monkeypatch):
    off = _llm(ckpt, monkeypatch, 0)
    want = [o.token_ids for o in off.generate(prompt_token_ids=_prompts(), sampling_params=GREEDY, use_tqdm=False)]
    llm = _llm(ckpt, monkeypatch, 4)
    got = [o.token_ids for o in llm.generate(prompt_token_ids=_prompts(), sampling_params=GREEDY, use_tqdm=False)]
    assert got == want
    assert llm.runner.spec.drafter.graphs.stats["graph_steps"] > 0


def test_filtered_sampling_keeps_the_eager_drafter(tmp_path, monkeypatch):
    """top-k / top-p requests are outside the captured modes: their steps take the eager
    drafter (counted), whose drafts they get."""
    llm = _llm(_checkpoint(tmp_path, "v4"), monkeypatch, 3)
    steps = _compare_every_step(llm)
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seq_seed=5, max_tokens=6, ignore_eos=True)]
    llm.generate(prompt_token_ids=_prompts()[:1], sampling_params=params, use_tqdm=False)
    stats = llm.runner.spec.drafter.graphs.stats
    assert stats["graph_steps"] == 0 and stats["eager_steps"] == len(steps) > 0
    for out, fused, _ in steps:
        assert {r: d.tokens for r, d in out.items()} == {r: d.tokens for r, d in fused.items()}


def test_draft_graphs_refuse_bad_limits():
    from deepinfer.models.fast.draft_graphs import DraftGraphs

    with pytest.raises(ValueError, match="max_rows"):
        DraftGraphs(lambda inp, g: (inp, None), 4, 0, torch.device("cpu"))
    with pytest.raises(ValueError, match="cols"):
        DraftGraphs(lambda inp, g: (inp, None), 0, 4, torch.device("cpu"))


def test_graphed_feature_writes_equal_eager_writes(ckpt, monkeypatch):
    """Every step's feature rows written through the feature graphs (padded to a power of two,
    pad rows repeating row 0) leave each stage's window pool as the eager writes do."""
    llm = _llm(ckpt, monkeypatch, 4)
    drafter = llm.runner.spec.drafter
    feats, real = drafter.feature_graphs, drafter._write_features
    assert feats is not None and feats.graphs.sealed and len(feats.graphs.captured) == len(feats.sizes)
    pools = [drafter.cache.swa[drafter._cache_id(s)] for s in range(len(drafter.stages))]
    checked = []

    def write(ctx):
        before = [p.clone() for p in pools]
        drafter.feature_graphs = None
        real(ctx)
        eager = [p.clone() for p in pools]
        for p, b in zip(pools, before):
            p.copy_(b)
        drafter.feature_graphs = feats
        real(ctx)
        for p, e, b in zip(pools, eager, before):
            torch.testing.assert_close(p, e, atol=1e-6, rtol=1e-5, equal_nan=True)  # unwritten rows: raw memory
        checked.append(any(not torch.equal(e.nan_to_num(), b.nan_to_num()) for e, b in zip(eager, before)))

    drafter._write_features = write
    llm.generate(prompt_token_ids=_prompts(), sampling_params=GREEDY, use_tqdm=False)
    assert len(checked) > 3 and all(checked)  # every step wrote rows
    assert feats.stats["graph_steps"] > 0


def test_batch_invariant_engine_keeps_the_eager_invariant_drafter(ckpt, monkeypatch):
    """In batch-invariant mode the drafter is not captured (its pass would run the mode's
    reference MoE inside a capture, which the GPU refuses): it drafts eagerly in the mode,
    and greedy speculation still equals the invariant engine without it."""
    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")

    def invariant(spec: int) -> LLM:
        return LLM(ckpt, dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                   num_speculative_tokens=spec, batch_invariant=True)

    want = [o.token_ids for o in invariant(0).generate(prompt_token_ids=_prompts(), sampling_params=GREEDY,
                                                       use_tqdm=False)]
    llm = invariant(4)
    assert llm.runner.spec.drafter.graphs is None
    got = [o.token_ids for o in llm.generate(prompt_token_ids=_prompts(), sampling_params=GREEDY, use_tqdm=False)]
    assert got == want


DSPARK_PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 3, "Once upon a time, there was a", "def f(n):"]


def test_drafts_behind_the_verify_graph_equal_host_drafts(monkeypatch):
    """Greedy-lane steps draft on the device behind the verify graph (features of every verify
    row written, each block's window picked by the accepted count): the same drafts and
    confidences at every step as drafting from the host result, the same output."""
    # the trained deepinfer-tiny-dspark: real acceptance, so the compared drafts matter
    spec, tokens, steps = run_recording_drafts(monkeypatch, "deepinfer-tiny-dspark", 5, DSPARK_PROMPTS, True)
    spec0, tokens0, steps0 = run_recording_drafts(monkeypatch, "deepinfer-tiny-dspark", 5, DSPARK_PROMPTS, False)
    assert spec.drafter.graphs.stats["after_verify_steps"] > 0
    assert spec0.drafter.graphs.stats["after_verify_steps"] == 0
    # every greedy-lane step wrote its features and staged its blocks inside the verify graph
    assert spec._verify.counts["tail_steps"] == spec._verify.counts["greedy_steps"] > 0
    assert tokens == tokens0 and list(spec.metrics.accepted) == list(spec0.metrics.accepted)
    assert sum(spec.metrics.accepted) > 0  # real drafts were accepted, so the compared drafts mattered
    assert_same_drafts(steps, steps0)



@pytest.mark.parametrize("greedy", [1, 0])
def test_draft_body_on_the_triton_kernels_equals_its_torch_references(ckpt, monkeypatch, fresh_seed, greedy):
    """The graph body on the interpreted Triton kernels (block attention with the inverse
    RoPE, the Markov greedy draws, fused mHC / MoE, norm + RoPE) drafts what it drafts on
    the kernels' torch references, which the tests above hold to the reference modules:
    same tokens, confidences within float32 rounding. Two blocks on fresh context K/V,
    one of them near the sequence start (padded context rows)."""
    from deepinfer.models.fast.decode import kernel_ops
    from deepinfer.models.fast.draft_dspark import INPUT_COLUMNS

    llm = _llm(ckpt, monkeypatch, 4)
    drafter = llm.runner.spec.drafter
    g = torch.Generator().manual_seed(fresh_seed)
    for s in range(len(drafter.stages)):
        pool = drafter.cache.swa[drafter._cache_id(s)]
        pool.copy_(torch.randn(pool.shape, generator=g).to(pool.dtype))
    rows = drafter.cache.swa[drafter._cache_id(0)].view(-1, drafter.cache.swa[drafter._cache_id(0)].shape[-1]).shape[0]
    cols = dict(zip(INPUT_COLUMNS, range(len(INPUT_COLUMNS))))
    inp = torch.zeros(2, drafter.graphs.cols, dtype=torch.int64)
    for r, last_pos in enumerate((40, 6)):
        inp[r, cols["last_token"]] = int(torch.randint(VOCAB, (1,), generator=g))
        inp[r, cols["last_pos"]], inp[r, cols["greedy"]], inp[r, cols["seed"]] = last_pos, greedy, 11 + r
        inp[r, cols["temperature_bits"]] = int(torch.tensor(0.9).view(torch.int32))
        inp[r, len(INPUT_COLUMNS):] = torch.randperm(rows, generator=g)[:drafter.graphs.cols - len(INPUT_COLUMNS)]
    hidden = drafter.family.dspark_stages_hidden()
    out = {}
    for kind in ("ref", "triton"):
        drafter._graph_ops = kernel_ops(kind)
        with torch.no_grad():
            packed, q = drafter._graph_body(hidden, inp, bool(greedy))
        out[kind] = (packed, q)
    (p_ref, q_ref), (p_tri, q_tri) = out["ref"], out["triton"]
    n = p_ref.shape[1] // 2
    assert torch.equal(p_tri[:, :n], p_ref[:, :n])  # the draft tokens
    conf = lambda p: p[:, n:].to(torch.int32).view(torch.float32)  # noqa: E731
    torch.testing.assert_close(conf(p_tri), conf(p_ref), atol=1e-5, rtol=1e-4)
    assert (q_tri is None) == (q_ref is None) == bool(greedy)
    if q_ref is not None:
        torch.testing.assert_close(q_tri, q_ref, atol=1e-5, rtol=1e-4)


def test_a_tailed_dspark_step_launches_almost_nothing_outside_its_graphs(monkeypatch):
    """With the verify graph's DSpark tail (features, block inputs, plan-ahead record inside
    the graph) an async greedy spec step is its verify and draft graph replays plus the drafts'
    record in the token buffer: a few launches outside any graph (about forty before, to gather
    features, pick each block's window and feed the feature and draft graphs)."""
    import deepinfer.models.fast.decode_graphs as dg
    from deepinfer.models.fast.launches import LaunchCounter

    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_WARMUP", "1")
    llm = LLM("deepinfer-tiny-dspark", dtype="float32", max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=64, num_speculative_tokens=5)
    counters, replay = [], dg.DecodeGraphs.replay

    def counted_replay(self, *args, **kwargs):
        with counters[-1].skipping():
            return replay(self, *args, **kwargs)

    core, step = llm.engine, type(llm.engine).step

    def counted_step(self):
        counters.append(LaunchCounter())
        with counters[-1]:
            return step(self)

    monkeypatch.setattr(dg.DecodeGraphs, "replay", counted_replay)
    monkeypatch.setattr(type(core), "step", counted_step)
    llm.generate([DSPARK_PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    verify = llm.runner.spec._verify
    assert verify.counts["tail_steps"] == verify.counts["greedy_steps"] > 3
    assert llm.runner.spec.drafter.feature_graphs.stats["graph_steps"] == 0  # the tail wrote the features
    spec_steps = counters[1:-1]  # past the prompt's step, before the drain
    assert spec_steps and max(c.total for c in spec_steps) <= 4, [c.torch_ops for c in spec_steps]
