"""profiling/decode_grid.py (issue 23's decode grid): its analysis on hand-made rows, and the
whole script on CPU (--tiny, the fast path's torch references with emulated graphs)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiling"))

from decode_grid_analysis import affine_fit, analyse, diagnose, trend_flags  # noqa: E402

CTX = [128, 2048, 16384, 131072]


def test_a_smooth_row_stays_on_its_trend_and_a_cliff_stands_out():
    smooth = [1.0 + 1e-4 * c for c in CTX]  # fixed cost + attention over the context
    assert all(abs(r - 1) < 1e-6 for r in trend_flags(CTX, smooth))
    cliff = smooth[:2] + [smooth[2] * 3] + smooth[3:]
    ratios = trend_flags(CTX, cliff)
    assert ratios[2] > 2.5 and max(ratios[:2] + ratios[3:]) < 1.5
    assert trend_flags([128, 2048], [1.0, 1.1]) == [None, None]  # a row of two has no trend


def test_a_row_flat_then_linear_is_not_a_cliff():
    """The 1M engine's b64 row on an H200 (decode_grid_h200_61c6cdb.json): flat while the
    fixed cost dominates, linear once attention does. The log-log line of the first analysis
    put its fastest cell (ctx 128) at 4.2x over trend; the affine trend keeps every cell
    under the cliff limit."""
    row = [1.484, 1.572, 3.61, 12.99]
    assert max(trend_flags(CTX, row)) < 1.5


def test_the_affine_fit_keeps_its_bounds():
    assert affine_fit([(1, 3.0), (2, 2.0), (3, 1.0)]) == (2.0, 0.0)  # falling: flat through the mean
    a, b = affine_fit([(1, 1.0), (2, 3.0), (3, 5.0)])  # intercept -1: through the origin instead
    assert a == 0.0 and abs(b - 22 / 14) < 1e-12


def _cell(batch, ctx, step, **diag):
    return {"batch": batch, "context": ctx, "step_ms": step, "first_over_steady": 1.0, "diag": diag}


def test_a_warmed_cell_slower_than_fresh_gets_a_diagnosis():
    fresh = _cell(64, 128, 1.5, graph_gpu_ms=1.2, host_busy_ms_per_step=0.9, device_mallocs=0)
    device = _cell(64, 128, 2.5, graph_gpu_ms=2.2, host_busy_ms_per_step=0.9, device_mallocs=0)
    host = _cell(64, 128, 2.5, graph_gpu_ms=1.2, host_busy_ms_per_step=2.0, device_mallocs=0)
    alloc = _cell(64, 128, 2.5, graph_gpu_ms=1.2, host_busy_ms_per_step=0.9, device_mallocs=40)
    assert diagnose(fresh, device)["verdict"].startswith("device")
    assert diagnose(fresh, host)["verdict"].startswith("host")
    assert diagnose(fresh, alloc)["verdict"].startswith("allocator")
    assert diagnose(fresh, _cell(64, 128, 2.5))["verdict"].startswith("unclear")


def _engine(fresh, warmed, measured, accounted, equal=True):
    return {"fresh": fresh, "warmed": warmed, "first_generate": {"ratio": 1.05}, "check": {"equal": equal},
            "graphs": {"measured_bytes": measured, "accounted_bytes": accounted, "captures_after_start": 0}}


def test_targets_flag_the_warmed_cliff_the_memory_mismatch_and_unequal_tokens():
    fresh = [_cell(64, c, 1.5 + 1e-4 * c) for c in (128, 2048, 16384)]
    warmed = [_cell(64, 128, 2.5)] + [_cell(64, c, 1.5 + 1e-4 * c) for c in (2048, 16384)]
    good = {"a": _engine(fresh, fresh, 1.02, 1.0), "b": _engine(fresh, fresh, 0.97, 1.0)}
    flags, targets, diagnoses = analyse(good)
    met = {t["name"]: t["met"] for t in targets}
    assert not flags and not diagnoses and all(met.values())
    bad = {"a": _engine(fresh, warmed, 3.98, 3.30), "b": _engine(fresh, fresh, 5.01, 8.98, equal=False)}
    flags, targets, diagnoses = analyse(bad)
    met = {t["name"]: t["met"] for t in targets}
    # off its row's trend, and slower than its twins (engine b warmed, engine a fresh)
    assert sorted(f["why"] for f in flags) == ["row trend", "vs a fresh", "vs b warmed"]
    assert {(f["engine"], f["state"], f["context"]) for f in flags} == {("a", "warmed", 128)}
    assert [(d["engine"], d["context"]) for d in diagnoses] == [("a", 128)]
    assert not met["graph memory measured / accounted (within 5%)"]
    assert not met["greedy tokens equal on every engine, fresh and warmed"]
    assert next(t for t in targets if t["name"].startswith("graph memory"))["value"] == round(5.01 / 8.98, 3)


def test_the_script_runs_on_cpu(tmp_path, monkeypatch):
    """--tiny end to end with the fast path's torch references and emulated graphs: every
    engine's greedy tokens agree fresh and warmed, nothing is captured after start, each
    cell's steady call names the graph it replayed, the JSON has its targets."""
    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_WARMUP", "1")
    monkeypatch.setenv("DEEPINFER_COMMIT", "cputest")
    import decode_grid

    out = decode_grid.main(["--tiny", "--out", str(tmp_path), "--batches", "1,2", "--contexts", "40,160",
                            "--max-model-lens", "256,512", "--new", "3", "--long", "200", "--mixed", "4", "--first-prompt", "12", "--check-tokens", "3",
                            "--max-cell-tokens", "200", "--budget-s", "600"])
    saved = json.loads((tmp_path / "decode_grid_cpu_cputest.json").read_text())
    assert [t["name"] for t in saved["targets"]] == [t["name"] for t in out["targets"]] and len(out["targets"]) == 7
    for name, eng in out["engines"].items():
        assert eng["check"]["equal"], (name, eng["check"])
        assert eng["graphs"]["captures_after_start"] == 0 and eng["graphs"]["sealed"]
        cells = eng["fresh"] + eng["warmed"]
        assert {(c["batch"], c["context"]) for c in cells} == {(1, 40), (2, 40), (1, 160)}  # 2 x 160 > 200
        for c in cells:
            assert c["diag"]["graph_keys"] and c["diag"]["steps"] >= 2 and c["diag"]["graph_gpu_ms"] is None
            assert c["diag"]["host_busy_ms_per_step"] > 0
            reps = c["steady_step_ms_repeats"]  # the cell's step time is the median steady call's
            assert len(reps) == 3 and c["step_ms"] == sorted(reps)[1]
            calls = c["steady_call_s_repeats"]  # every steady call, beside the first, for their spread
            assert len(calls) == 3 and c["steady_call_s"] in calls and c["first_call_s"] > 0
        assert eng["first_generate"]["first_probe"]["steps"] >= 3
    remedy = out["engines"]["max_model_len=256"]["remedies"]
    assert remedy["batch"] in (1, 2) and remedy["after_sorting_free_blocks"] > 0
    spread = out["engines"]["max_model_len=256"]["warmed"][0]["diag"]["window_blocks"]
    assert spread["blocks"] >= 1 and spread["pages_2mib"] >= 1 and spread["id_span"] >= spread["blocks"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
