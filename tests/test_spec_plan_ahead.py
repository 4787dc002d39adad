"""Speculative steps planned ahead (deepinfer/spec/plan_ahead.py) on CPU, graphs emulated on
the host buffers: on the trained default, whose MTP stage drafts real tokens, async
scheduling plans step N+1 before step N lands, feeds its placeholders from the device
token buffer (debug sentinels on) at positions shifted on the device, and gives exactly
the tokens of no speculation; the plans that cannot run on the device fall back to
landing first; window blocks the shifted rows still read are kept; preemption, stops
and a queue of waiting requests compose."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any deepinfer_kernels module is imported

import random  # noqa: E402

import pytest  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.models.default_model import trained_model_dir  # noqa: E402
from deepinfer.spec.scheduling import StepTimeCurve, assign, plan_budget  # noqa: E402

PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 3, "Once upon a time, there was a", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _llm(monkeypatch, k: int, async_scheduling: bool = True, model: str | None = None, **kw) -> LLM:
    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_WARMUP", "1")  # the start-up capture, emulated on the host
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_seqs", 4)
    llm = LLM(model or trained_model_dir(), dtype="float32", num_speculative_tokens=k, max_num_batched_tokens=64,
              async_scheduling=async_scheduling, **kw)
    if llm.async_loop is not None:
        llm.async_loop.tokens.debug = True  # a wrong or double gather fails loudly
    return llm


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    """Text prompts, or token-id lists."""
    if prompts and isinstance(prompts[0], list):
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def reference():
    """No speculation, synchronous: the tokens every run below must give."""
    mp = pytest.MonkeyPatch()
    try:
        llm = _llm(mp, 0, async_scheduling=False, max_model_len=512)
        return lambda prompts, params: _tokens(llm, prompts, params)
    finally:
        mp.undo()


@pytest.mark.parametrize("k", [1, 3])
def test_planned_ahead_steps_give_the_tokens_of_no_speculation(monkeypatch, reference, k):
    llm = _llm(monkeypatch, k)
    assert _tokens(llm, PROMPTS, GREEDY) == reference(PROMPTS, GREEDY)
    loop, planner = llm.async_loop, llm.async_loop.planner
    # all but the prompt steps and the first verify were planned (and launched) ahead
    assert planner.stats["planned_ahead"] >= 15 and planner.stats["resolved"] == 0
    assert loop.stats.overlapped == planner.stats["planned_ahead"]
    assert loop.tokens.num_gathered >= 15 * (k + 1) * len(PROMPTS) // 2
    assert sum(llm.runner.spec.metrics.accepted) > 0  # drafts fed from the device were accepted
    # the stage's catch-up and the record ran inside the verify graph (spec/mtp_verify_tail.py)
    counts = llm.runner.spec._verify.counts
    assert counts["tail_steps"] == counts["greedy_steps"] >= planner.stats["planned_ahead"]
    llm.kv_manager.assert_consistent()


def test_plans_that_leave_the_device_path_land_first(monkeypatch, reference):
    """Every other plan made ahead is refused: the step in flight lands, the plan gets its
    real tokens and positions, and the host path runs it. Memory nothing wrote reads as NaN
    here (torch.empty filled so): the later MTP passes behind such a step's verify graph ran
    at the plan's stale positions once (a memo of its rows kept them), read unwritten KV rows
    and drafted with NaN confidences, which CI caught when the garbage happened to be NaN."""
    import torch

    want = reference(PROMPTS, GREEDY)  # (its engine built with the real torch.empty)
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    llm = _llm(monkeypatch, 3)
    planner = llm.async_loop.planner
    real, calls = planner.device_step_ok, [0]

    def alternate(so):
        calls[0] += 1
        return real(so) and calls[0] % 2 == 0

    monkeypatch.setattr(planner, "device_step_ok", alternate)
    assert _tokens(llm, PROMPTS, GREEDY) == want
    assert planner.stats["resolved"] >= 5 and planner.stats["planned_ahead"] > planner.stats["resolved"]
    assert llm.runner.spec.metrics.invalid_confidences == 0  # no draft read memory nothing wrote


def test_shifted_rows_keep_the_window_blocks_they_read(monkeypatch, reference):
    """Prompts of 360-380 tokens cross the second window block boundary while generating
    (128-token window and blocks): a plan made ahead sits up to k rows below its positions,
    so the window group must keep the block those rows still read."""
    rng = random.Random(3)
    prompts = [[rng.randrange(8192) for _ in range(n)] for n in (360, 371, 380)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = _llm(monkeypatch, 3, max_model_len=512)
    assert llm.kv_manager.window_slack == 3
    assert _tokens(llm, prompts, params) == reference(prompts, params)
    assert llm.async_loop.planner.stats["planned_ahead"] > 10


def test_preemption_stops_and_a_waiting_queue(monkeypatch, reference):
    """Two seats for five requests (a queue: no plan is made ahead while one waits), a pool
    small enough to preempt, and EOS stops: the same tokens and finish reasons."""
    prompts = PROMPTS + ["Hello world, this is", "In the beginning"]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (30, 12, 40, 25, 18)]
    want = reference(prompts, params)
    llm = _llm(monkeypatch, 3, max_num_seqs=2, num_kv_blocks=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert llm.async_loop.planner.stats["planned_ahead"] > 0
    llm.kv_manager.assert_consistent()
    assert all(p.num_free == p.num_blocks for p in llm.kv_manager.pools.values())


def _drafts_by_output_length(monkeypatch, llm: LLM) -> dict[tuple[str, int], tuple[list[int], list[float]]]:
    """Every attached draft keyed by (request, its output length when drafted): a function of
    the tokens alone, whichever loop ran (the loops cap how many are verified differently)."""
    spec, attach, seen = llm.runner.spec, llm.runner.spec.attach, {}

    def recording_attach(scheduler, structured=None, in_flight=frozenset()):
        for rid, d in spec.drafts.items():
            req = scheduler.requests.get(rid)
            if req is not None:
                seen[(rid, req.num_output_tokens)] = (d.tokens, d.confidences)
        attach(scheduler, structured, in_flight)

    monkeypatch.setattr(spec, "attach", recording_attach)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return seen


def test_planned_ahead_drafts_equal_the_synchronous_loops(monkeypatch):
    """k = 3: the drafts made behind a verify graph at shifted positions (the stage's catch-up
    and later passes) equal, with their confidences, the synchronous loop's at the same
    output length."""
    got = _drafts_by_output_length(monkeypatch, _llm(monkeypatch, 3))
    want = _drafts_by_output_length(monkeypatch, _llm(monkeypatch, 3, async_scheduling=False))
    common = sorted(set(got) & set(want))
    assert len(common) >= 30
    for key in common:
        assert got[key][0] == want[key][0], key
        assert got[key][1] == pytest.approx(want[key][1], rel=1e-4, abs=1e-6), key


DSPARK = "deepinfer-tiny-dspark"


def _no_speculation(prompts, params) -> list[list[int]]:
    """The DSpark model's tokens without speculation, synchronous loop."""
    mp = pytest.MonkeyPatch()
    try:
        return _tokens(_llm(mp, 0, async_scheduling=False, model=DSPARK, max_model_len=512), prompts, params)
    finally:
        mp.undo()


def test_dspark_planned_ahead_steps_give_the_tokens_of_no_speculation(monkeypatch):
    """DSpark k = 5 (the trained drafter): its feature writes and block pass behind the verify
    graph read positions and pool rows shifted on the device, for prompts that also cross
    a window block boundary while generating: the tokens of no speculation."""
    rng = random.Random(5)
    prompts = [[rng.randrange(8192) for _ in range(n)] for n in (12, 40, 250, 372)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = _no_speculation(prompts, params)
    llm = _llm(monkeypatch, 5, model=DSPARK, max_model_len=512, max_num_seqs=8)
    assert _tokens(llm, prompts, params) == want
    planner = llm.async_loop.planner
    assert planner.stats["planned_ahead"] >= 15 and planner.stats["resolved"] == 0
    assert llm.runner.spec.drafter.graphs.stats["after_verify_steps"] >= planner.stats["planned_ahead"]
    assert sum(llm.runner.spec.metrics.accepted) > 0
    llm.kv_manager.assert_consistent()


def test_dspark_planned_ahead_drafts_equal_the_synchronous_loops(monkeypatch):
    """The DSpark blocks drafted at shifted positions equal, with their confidences, the
    synchronous loop's at the same output length."""
    got = _drafts_by_output_length(monkeypatch, _llm(monkeypatch, 5, model=DSPARK))
    want = _drafts_by_output_length(monkeypatch, _llm(monkeypatch, 5, async_scheduling=False, model=DSPARK))
    common = sorted(set(got) & set(want))
    assert len(common) >= 30
    for key in common:
        assert got[key][0] == want[key][0], key
        assert got[key][1] == pytest.approx(want[key][1], rel=1e-4, abs=1e-6), key


def test_dspark_scheduled_verification_is_planned_ahead(monkeypatch):
    """Confidence-scheduled verification (enable_mtp_varlen) plans ahead too: each plan made
    ahead verifies the draft counts its budget gives (some requests fewer than k, under a
    step-time curve that makes verify rows costly) and gives the tokens of no speculation."""
    rng = random.Random(7)
    prompts = [[rng.randrange(8192) for _ in range(n)] for n in (12, 40, 96, 250, 300, 372)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = _no_speculation(prompts, params)
    llm = _llm(monkeypatch, 5, model=DSPARK, max_model_len=512, max_num_seqs=8, enable_mtp_varlen=True)
    spec = llm.runner.spec
    spec.curve = StepTimeCurve([1, 8, 16, 24, 32, 48], [1.0, 1.0, 1.6, 2.4, 3.2, 4.8])  # rows past 8 cost
    lengths: list[int] = []
    planned = spec.planned_ahead_lengths
    monkeypatch.setattr(spec, "planned_ahead_lengths", lambda ids: lengths.extend(planned(ids)) or lengths[-len(ids):])
    assert _tokens(llm, prompts, params) == want
    planner = llm.async_loop.planner
    assert planner.stats["planned_ahead"] >= 15 and planner.stats["resolved"] == 0
    assert min(lengths) < 5 and max(lengths) > 0 and 0 < sum(lengths) < 5 * len(lengths)
    assert llm.runner.spec.drafter.graphs.stats["after_verify_steps"] >= planner.stats["planned_ahead"]
    llm.kv_manager.assert_consistent()


def test_dspark_plan_after_a_short_verify_reads_no_freed_window_block(monkeypatch):
    """A plan made ahead of a step that verified few drafts sits at most that many positions
    below its plan, while the window blocks below an earlier plan's (k drafts, none accepted)
    window are already freed. Verify counts alternating 5 / 0 put such plans at every window
    block crossing of these prompts (230..237 tokens; the window is one 128-row block): the
    drafter's layout reads only what each request's own shift can reach, with the tokens of
    no speculation (it read freed blocks and raised on the H200 before)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(8192) for _ in range(230 + i)] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = _no_speculation(prompts, params)
    llm = _llm(monkeypatch, 5, model=DSPARK, max_model_len=512, max_num_seqs=8, enable_mtp_varlen=True)
    spec, calls = llm.runner.spec, []
    monkeypatch.setattr(spec, "planned_ahead_lengths", lambda ids: calls.append(1) or [5 * (len(calls) % 2)] * len(ids))
    assert _tokens(llm, prompts, params) == want
    planner = llm.async_loop.planner
    assert planner.stats["planned_ahead"] >= 15 and planner.stats["resolved"] == 0
    assert spec.drafter.graphs.stats["after_verify_steps"] >= planner.stats["planned_ahead"]
    llm.kv_manager.assert_consistent()


def test_planned_ahead_lengths_split_the_older_budget_with_the_host_confidences():
    """The first plan made ahead verifies every draft; later ones take their budget from the
    plan before and split it by the confidences of the drafts in flight; a request without
    any verifies all k; fixed-length verification always k."""
    from deepinfer.spec.runner import SpecDecoder

    curve = StepTimeCurve([1, 2, 3, 4, 6], [1.0, 1.0, 1.2, 2.0, 3.0])  # one extra row pays, two do not
    spec = SpecDecoder(drafter=None, num_speculative_tokens=2, varlen=True, curve=curve)
    spec.confidences = {"a": [0.9, 0.8], "b": [0.1, 0.1]}
    assert spec.planned_ahead_lengths(["a", "b"]) == [2, 2]
    assert spec.older_confidences == [[0.9, 0.8], [0.1, 0.1]]
    spec.confidences = {"a": [0.2, 0.1], "b": [0.9, 0.9]}
    # the budget (one extra row) from the older confidences goes to b, which the newest favour
    got = spec.planned_ahead_lengths(["a", "b", "c"])
    want_budget = plan_budget([[0.9, 0.8], [0.1, 0.1]], curve)
    assert got[2] == 2 and got[:2] == assign([[0.2, 0.1], [0.9, 0.9]], want_budget)
    assert want_budget == 1 and got == [0, 1, 2]
    spec.varlen = False
    assert spec.planned_ahead_lengths(["a", "b"]) == [2, 2]


def test_feed_placeholders_equals_the_token_buffers_fill():
    """The lane graphs' in-graph feed (`feed_placeholders`) gives the ids and positions the
    host-driven `DeviceTokenBuffer.fill` gives, on fresh random buffers and plans."""
    import torch

    from deepinfer.engine.outputs import ScheduledRequest, SchedulerOutput
    from deepinfer.engine.request import PLACEHOLDER_TOKEN_ID
    from deepinfer.engine.token_buffer import DeviceTokenBuffer
    from deepinfer_kernels.spec_lane import feed_placeholders_ref
    from deepinfer.models.paged_batch import ForwardBatch

    gen = torch.Generator().manual_seed(11)
    width, seats = 4, 6
    buf = DeviceTokenBuffer(seats, torch.device("cpu"), width=width)
    buf.last.copy_(torch.randint(0, 8192, buf.last.shape, generator=gen))
    buf.shift.copy_(-torch.randint(0, width, buf.shift.shape, generator=gen))
    reqs, ids, positions = [], [], []
    for i, slot in enumerate((4, 0, 2)):
        planned = i != 1  # request 1 was not planned ahead: real ids, no shift
        toks = [PLACEHOLDER_TOKEN_ID] * width if planned else [int(t) for t in torch.randint(0, 8192, (2,))]
        start = 50 + 20 * i
        reqs.append(ScheduledRequest(f"r{i}", toks, start, {}, slot, False, True, GREEDY, 5,
                                     num_draft_tokens=len(toks) - 1))
        ids += toks
        positions += range(start, start + len(toks))
    so = SchedulerOutput(reqs, len(ids))
    batch = ForwardBatch(torch.tensor(ids), torch.tensor(positions), [])
    buf.fill(so, batch)
    rows, index = buf.placeholder_index(so)
    src = torch.full((len(ids),), -1, dtype=torch.int32)
    src[rows] = torch.tensor(index, dtype=torch.int32)
    host_ids = torch.tensor(ids, dtype=torch.int32).clamp(min=0)
    fed, pos, row_shift = feed_placeholders_ref(buf.last, buf.shift, host_ids,
                                                torch.tensor(positions, dtype=torch.int32), src)
    assert fed.tolist() == batch.input_ids.tolist() and pos.tolist() == batch.positions.tolist()
    assert row_shift.tolist() == batch.position_shift.tolist() and any(row_shift.tolist())


def test_paged_slots_of_equals_paged_slots_per_request():
    """The batched pool-row lookup (DSpark's after-verify layout) == `paged_slots` per
    request, on random tables with freed window blocks, and raises on a freed block."""
    import numpy as np

    from deepinfer.models.paged_batch import padded_tables, paged_slots, paged_slots_of

    gen = np.random.default_rng(7)
    per_block = 16
    tables = [list(gen.permutation(200)[:n]) for n in (3, 9, 5)]
    for t in tables:
        t[0] = -1  # the window's oldest block was freed
    start = np.array([20, 100, 50])
    pos = start[:, None] + np.arange(24)
    valid = pos < np.array([48, 144, 80])[:, None]
    got = paged_slots_of(padded_tables(tables), pos, valid, per_block)
    for i, t in enumerate(tables):
        want = paged_slots(t, int(pos[i, 0]), pos.shape[1], per_block, valid=valid[i])
        assert got[i].tolist() == want.tolist()
    with pytest.raises(RuntimeError, match="freed block"):
        paged_slots_of(padded_tables(tables), pos - 10, pos - 10 >= 0, per_block)


def test_v41_dspark_planned_ahead_steps_give_the_tokens_of_no_speculation(monkeypatch, tmp_path):
    """V4.1 (three DSpark stages, shared KV sources, ratio-2 rings, Engram) plans its steps
    ahead too, with the tokens of no speculation. Simulated FP8 / FP4 KV rounding is off here:
    with it, the verify rows' other GEMM shapes move a stored value by one rounding step now
    and then, which changes a later token of these random weights (0.05 nats apart) in the
    synchronous speculative loop just the same: numerics, not planning."""
    import dataclasses

    from deepinfer.models.tiny import tiny_v41_config, write_tiny_checkpoint

    cfg = dataclasses.replace(tiny_v41_config(vocab_size=1024, sliding_window=32), simulate_kv_quant=False)
    write_tiny_checkpoint(str(tmp_path), seed=11, cfg=cfg)
    rng = random.Random(5)
    prompts = [[rng.randrange(1024) for _ in range(n)] for n in (5, 40, 97)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    mp = pytest.MonkeyPatch()
    try:
        want = _tokens(_llm(mp, 0, async_scheduling=False, model=str(tmp_path)), prompts, params)
    finally:
        mp.undo()
    llm = _llm(monkeypatch, 3, model=str(tmp_path))
    assert _tokens(llm, prompts, params) == want
    planner = llm.async_loop.planner
    assert planner.stats["planned_ahead"] >= 10 and planner.stats["resolved"] == 0
    assert llm.runner.spec.drafter.family.name == "deepseek_v41"
    llm.kv_manager.assert_consistent()
