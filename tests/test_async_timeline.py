"""Timelines of both loops: CPU profiler traces hold the device work in async mode too
(everything runs on the profiled thread), GPU events count in the step that launched them
(so an async trace's device work is attributed to the right engine step), and the
overlap summary / compact timeline the GPU script records."""

from __future__ import annotations

import json

import pytest

from deepinfer import SamplingParams
from deepinfer.profiling.markers import MODEL, SAMPLE, WAIT
from deepinfer.profiling.overlap import compact_timeline, overlap_summary
from deepinfer.profiling.timeline import idle_gaps, parse_trace, step_table


@pytest.fixture(scope="module")
def engines():
    from deepinfer.workbench import tiny_llm

    return {mode: tiny_llm(max_num_seqs=4, async_scheduling=mode == "async") for mode in ("sync", "async")}


def test_cpu_traces_of_both_loops_have_the_device_lane(engines, tmp_path):
    from deepinfer.profiling.charts import timeline_figure
    from deepinfer.profiling.trace import capture_trace

    ids = [[1000 + i for i in range(n)] for n in (20, 50)]
    sp = SamplingParams(max_tokens=8, ignore_eos=True, seq_seed=3)
    tokens = {}
    for mode, llm in engines.items():
        assert (llm.async_loop is not None) == (mode == "async")
        cap = capture_trace(llm, prompt_token_ids=ids, sampling_params=sp, num_steps=4, out_dir=str(tmp_path),
                            name=mode)
        tokens[mode] = [o.token_ids for o in cap.outputs]
        steps = cap.steps
        assert len(steps) == 4 and (steps["device_busy_ms"] > 0).all() and (steps["wait_ms"] >= 0).all()
        assert (steps["host_ms"] > 0).all()
        s = overlap_summary(cap.events)
        assert s["device"] == "cpu" and s["steps"] == 4 and s["mean_gap_ms"] > 0
        assert 0 < s["gap_pct_of_step"] < 100 and s["host_ms_per_step"] > 0
        rows = compact_timeline(cap.events, num_steps=2)
        json.dumps(rows)  # recordable as is
        assert {r["step"] for r in rows} == {min(r["step"] for r in rows), min(r["step"] for r in rows) + 1}
        assert "device" in {t.name for t in timeline_figure(__import__("pandas").DataFrame(rows)).data}
    assert tokens["sync"] == tokens["async"]


def _x(name, ts, dur, cat="user_annotation", tid=1, corr=None):
    e = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def _async_gpu_trace(with_correlation: bool = True) -> dict:
    """Three host steps of 1000 us; each launches one step's kernels at +500 us, which run
    during the NEXT host step (async): step k's work = two kernels + a side-stream copy."""
    ev = []
    for k in range(3):
        t = 1000.0 * k
        ev += [_x(f"ProfilerStep#{k}", t, 1000), _x(MODEL, t + 400, 200), _x(SAMPLE, t + 620, 50),
               _x(WAIT, t + 700, 250)]
        for c in (1, 2):  # launches of the graph replay and the D2H copy
            ev.append(_x("cudaGraphLaunch" if c == 1 else "cudaMemcpyAsync", t + 500 + c, 5, "cuda_runtime",
                         corr=10 * k + c if with_correlation else None))
        start = t + 600 + 50 * k  # the device falls slightly behind: growing start offsets
        ev += [_x("gemm", start, 500, "kernel", tid=7, corr=10 * k + 1),
               _x("moe", start + 510, 490, "kernel", tid=7, corr=10 * k + 1),  # starts in the next host step
               _x("Memcpy DtoH", start + 1000, 5, "gpu_memcpy", tid=9, corr=10 * k + 2)]
    return {"traceEvents": ev}


def test_gpu_events_count_in_the_step_that_launched_them():
    ev = parse_trace(_async_gpu_trace())
    dev = ev[ev["kind"] == "device"]
    assert dev.groupby("step").size().to_dict() == {0: 3, 1: 3, 2: 3}
    gaps = idle_gaps(ev)
    # step k ends with its copy at 1605 + 1050 k; step k+1's first kernel starts at 1650 + 1050 k
    assert gaps["gap_ms"].tolist() == pytest.approx([0.045, 0.045])
    s = overlap_summary(ev)
    assert s["device"] == "gpu" and s["mean_device_period_ms"] == pytest.approx(1.05)
    assert s["gap_pct_of_step"] == pytest.approx(0.045 / 1.05 * 100)
    assert s["host_ms_per_step"] == pytest.approx(1.0 - 0.25) and s["wait_ms_per_step"] == pytest.approx(0.25)
    assert (step_table(ev)["wait_ms"] == 0.25).all()
    # labelled by their own start time instead, the kernels straddling a step boundary would
    # split one engine step's work and report a gap inside it
    naive = idle_gaps(parse_trace(_async_gpu_trace(with_correlation=False)))
    assert naive["gap_ms"].tolist() != pytest.approx(gaps["gap_ms"].tolist())
