"""The recorded expert-parallel benchmarks (``benchmarks/ep_bench.py`` result files) as one
table and one figure, for the expert placement notebook: throughput per rank, the
max / mean rank load and the all-to-all time per step, before and after EPLB, per run.

Older records (before the per-rank and all-to-all fields) load with those columns empty.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import pandas as pd

COLUMNS = ["run", "device", "size", "routing", "ranks", "batch_per_rank", "eplb", "phase", "tok_s", "tok_s_per_rank",
           "imbalance", "a2a_ms_per_step", "rebalance_s", "commit"]


def _run_name(rec: dict[str, Any], device: str, routing: str, batch: int) -> str:
    return f"{rec['args']['size']} {routing} {device} x{rec['args']['ranks']} b{batch}"


def load_ep_bench(results_dir: str) -> pd.DataFrame:
    """One row per (run, EPLB stage, phase) of every ``ep_bench_*.json`` under ``results_dir``."""
    rows = []
    for path in sorted(glob.glob(os.path.join(results_dir, "ep_bench_*.json"))):
        with open(path) as f:
            rec = json.load(f)
        args, hw = rec["args"], rec.get("hardware", {})
        device = hw.get("gpu", "cpu") if hw.get("gpu_count") else "cpu"
        routing = args.get("routing", "skewed")
        ranks = args["ranks"]
        decode = next((p for p in rec["phases"] if p["phase"] == "decode"), None)
        batch = args.get("decode_batch_per_rank") or (decode["requests"] // ranks if decode else 0)
        for p in rec["phases"]:
            a2a = [v for v in p.get("a2a_ms_per_step") or [] if v is not None]
            rows.append({"run": _run_name(rec, device, routing, batch), "device": device, "size": args["size"],
                         "routing": routing, "ranks": ranks, "batch_per_rank": batch, "eplb": p["eplb"],
                         "phase": p["phase"], "tok_s": p["tok_s"],
                         "tok_s_per_rank": p.get("tok_s_per_rank", p.get("tok_s_per_gpu", p["tok_s"] / ranks)),
                         "imbalance": p["imbalance_max_over_mean"],
                         "a2a_ms_per_step": sum(a2a) / len(a2a) if a2a else None,
                         "rebalance_s": rec["rebalance"]["seconds"], "commit": rec.get("commit", "")[:10]})
    return pd.DataFrame(rows, columns=COLUMNS)


def ep_bench_figure(df: pd.DataFrame):  # noqa: ANN201 - a plotly Figure (plotly imported lazily)
    """Decode and prefill throughput per rank (bars) and max / mean rank load (markers, right
    axis) per run, before and after EPLB."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("decode", "prefill"),
                        specs=[[{"secondary_y": True}, {"secondary_y": True}]])
    for col, phase in enumerate(("decode", "prefill"), start=1):
        part = df[df.phase == phase]
        for stage, color in (("before", "#d62728"), ("after", "#2ca02c")):
            rows = part[part.eplb == stage]
            fig.add_trace(go.Bar(x=rows.run, y=rows.tok_s_per_rank, name=f"tok/s per rank, {stage} EPLB",
                                 marker_color=color, opacity=0.6, showlegend=col == 1), row=1, col=col)
            fig.add_trace(go.Scatter(x=rows.run, y=rows.imbalance, mode="markers", marker_symbol="diamond",
                                     marker_size=10, marker_color=color, name=f"max/mean rank load, {stage}",
                                     showlegend=col == 1), row=1, col=col, secondary_y=True)
        fig.update_yaxes(title_text="tok/s per rank", row=1, col=col)
        fig.update_yaxes(title_text="max / mean rank load", row=1, col=col, secondary_y=True)
    fig.update_layout(barmode="group", height=420, title="Recorded EP benchmarks (benchmarks/ep_bench.py)")
    return fig
