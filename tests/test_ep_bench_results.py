"""The expert placement notebook's table of recorded EP benchmarks: old and new records load,
one row per (run, EPLB stage, phase), and the figure draws both phases."""

from __future__ import annotations

import json
import os

from deepinfer.workbench.ep_bench_results import COLUMNS, ep_bench_figure, load_ep_bench

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiling", "results")


def _record(ranks: int, routing: str, before: float, after: float) -> dict:
    phases = [{"eplb": stage, "phase": phase, "requests": 64 * ranks, "tok_s": 1000.0 * ranks,
               "tok_s_per_rank": 1000.0, "imbalance_max_over_mean": imb, "a2a_ms_per_step": [0.5, 0.7][:ranks]}
              for stage, imb in (("before", before), ("after", after)) for phase in ("prefill", "decode")]
    return {"args": {"size": "mini", "ranks": ranks, "routing": routing, "decode_batch_per_rank": 64},
            "hardware": {"gpu": "NVIDIA H200", "gpu_count": ranks}, "phases": phases,
            "rebalance": {"seconds": 0.25}, "commit": "0123456789abcdef"}


def test_records_load_old_and_new(tmp_path):
    (tmp_path / "ep_bench_mini_gpu_r2_b64.json").write_text(json.dumps(_record(2, "skewed", 1.8, 1.05)))
    (tmp_path / "ep_bench_mini_balanced_gpu_r2_b64.json").write_text(json.dumps(_record(2, "balanced", 1.1, 1.02)))
    (tmp_path / "notes.json").write_text("{}")  # not an EP bench record: ignored
    df = load_ep_bench(str(tmp_path))
    assert list(df.columns) == COLUMNS and len(df) == 8
    row = df[(df.routing == "skewed") & (df.eplb == "before") & (df.phase == "decode")].iloc[0]
    assert row.device == "NVIDIA H200" and row.batch_per_rank == 64 and row.imbalance == 1.8
    assert abs(row.a2a_ms_per_step - 0.6) < 1e-12 and row.commit == "0123456789"
    fig = ep_bench_figure(df)
    assert len(fig.data) == 8 and {t.name for t in fig.data} >= {"tok/s per rank, before EPLB"}


def test_recorded_results_load():
    df = load_ep_bench(RESULTS)
    assert len(df) >= 8 and df.tok_s_per_rank.gt(0).all()
    assert set(df.eplb) == {"before", "after"} and set(df.phase) == {"prefill", "decode"}
