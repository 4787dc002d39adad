"""Recorded GPU results of the compiled path, for the notebooks: the decode / prefill rows of
``benchmarks/fastpath_bench.py`` (``fastpath_bench_h200*.json``) and
``benchmarks/compiled_engine_bench.py`` (``compiled_engine_h200_*.json``) as one table, the
decode trade-off (tok/s per user vs per device) and a roofline (achieved TFLOP/s against
arithmetic intensity, under the recorded HBM and bf16 ceilings).

The numbers are whatever the files hold (each row names its file and commit); nothing
here runs a GPU. Files of other shapes are skipped, so a new benchmark does not break a
notebook.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import pandas as pd

__all__ = ["COLUMNS", "load_compiled_results", "decode_tradeoff_figure", "roofline_figure"]

COLUMNS = ["file", "bench", "commit", "hardware", "model", "phase", "batch", "tokens", "tok_s", "tok_s_per_user",
           "step_ms", "gb_s", "hbm_frac", "tflop_s", "peak_frac"]

def _rows(path: str, bench: str, rec: dict[str, Any], models: dict[str, Any]) -> list[dict[str, Any]]:
    hardware = rec.get("device") or rec.get("hardware") or "?"
    out = []
    for model, res in models.items():
        for phase in ("decode", "prefill"):
            runs = res.get(phase)
            for r in runs if isinstance(runs, list) else []:  # some records keep a count there
                if not isinstance(r, dict) or "tok_s" not in r:
                    continue
                batch = r.get("batch", 1) if phase == "decode" else 1
                out.append({"file": os.path.basename(path), "bench": bench, "commit": str(rec.get("commit", ""))[:10],
                            "hardware": hardware, "model": model, "phase": phase, "batch": batch,
                            "tokens": r.get("tokens", batch), "tok_s": r.get("tok_s"),
                            "tok_s_per_user": r["tok_s"] / batch if phase == "decode" and r.get("tok_s") else None,
                            "step_ms": r.get("step_ms", r.get("ms")), "gb_s": r.get("gb_s"),
                            "hbm_frac": r.get("hbm_frac"), "tflop_s": r.get("tflop_s"), "peak_frac": r.get("peak_frac")})
    return out


def load_compiled_results(results_dir: str) -> tuple[pd.DataFrame, dict[str, float]]:
    """(one row per recorded decode batch / prefill length, the ceilings the files name)."""
    rows: list[dict[str, Any]] = []
    ceilings: dict[str, float] = {}  # as fastpath_bench records them (HBM GB/s, dense bf16 TFLOP/s)
    for path in sorted(glob.glob(os.path.join(results_dir, "fastpath_bench_h200*.json"))):
        with open(path) as f:
            rec = json.load(f)
        ceilings.update({k: float(v) for k, v in (rec.get("ceilings") or {}).items()})
        models = {m: rec[m] for m in ("mini", "flash4") if isinstance(rec.get(m), dict)}
        rows += _rows(path, "fastpath_bench", rec, models)
    for path in sorted(glob.glob(os.path.join(results_dir, "compiled_engine_h200_*.json"))):
        with open(path) as f:
            rec = json.load(f)
        models = {m: v for m, v in rec.items() if isinstance(v, dict) and ("decode" in v or "prefill" in v)}
        rows += _rows(path, "compiled_engine_bench", rec, models)
    return pd.DataFrame(rows, columns=COLUMNS), ceilings


def decode_tradeoff_figure(df: pd.DataFrame, title: str = "Recorded decode on the compiled path"):  # noqa: ANN201
    """tok/s per user (y) vs tok/s per device (x), one line per (file, model), points labelled B."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for (file, model), d in df[df.phase == "decode"].groupby(["file", "model"], sort=False):
        d = d.sort_values("batch")
        fig.add_trace(go.Scatter(x=d.tok_s, y=d.tok_s_per_user, mode="lines+markers+text", cliponaxis=False,
                                 text=[f"B={int(b)}" for b in d.batch], textposition="top right",
                                 name=f"{model} · {file.removesuffix('.json')}"))
    fig.update_layout(title=title, template="plotly_white", height=460, xaxis_title="tokens/s per device",
                      yaxis_title="tokens/s per user", xaxis={"type": "log", "automargin": True},
                      yaxis={"automargin": True}, margin={"l": 70, "r": 30, "t": 60, "b": 60},
                      legend={"font": {"size": 10}})
    return fig


def roofline_figure(df: pd.DataFrame, ceilings: dict[str, float], title: str = "Roofline (recorded steps)"):  # noqa: ANN201
    """Achieved TFLOP/s vs arithmetic intensity (FLOP per HBM byte) of every recorded step,
    under the memory roof (GB/s x intensity) and the compute roof (drawn only when
    ``ceilings`` has ``hbm_gb_s`` and ``bf16_tflop_s``)."""
    import numpy as np
    import plotly.graph_objects as go

    d = df.dropna(subset=["gb_s", "tflop_s"])
    d = d[(d.gb_s > 0) & (d.tflop_s > 0)]
    intensity = d.tflop_s * 1e12 / (d.gb_s * 1e9)
    fig = go.Figure()
    if "hbm_gb_s" in ceilings and "bf16_tflop_s" in ceilings:
        bw, peak = ceilings["hbm_gb_s"], ceilings["bf16_tflop_s"]
        xs = np.logspace(-1, 4, 60)
        fig.add_trace(go.Scatter(x=xs, y=np.minimum(bw * 1e9 * xs, peak * 1e12) / 1e12, mode="lines",
                                 name=f"roof: {bw:.0f} GB/s, {peak:.0f} TFLOP/s", line={"color": "black"}))
    for phase, sym in (("decode", "circle"), ("prefill", "square")):
        m = d.phase == phase
        fig.add_trace(go.Scatter(
            x=intensity[m], y=d.tflop_s[m], mode="markers", marker={"symbol": sym, "size": 9}, name=phase,
            text=[f"{mo} {'B=' + str(int(b)) if phase == 'decode' else str(int(t)) + ' tok'} ({f})"
                  for mo, b, t, f in zip(d.model[m], d.batch[m], d.tokens[m], d.file[m])],
            hovertemplate="%{text}<br>%{x:.1f} FLOP/B, %{y:.2f} TFLOP/s<extra></extra>"))
    fig.update_layout(title=title, template="plotly_white", height=460, margin={"l": 70, "r": 30, "t": 60, "b": 60},
                      xaxis={"type": "log", "title": "arithmetic intensity (FLOP per HBM byte)", "automargin": True},
                      yaxis={"type": "log", "title": "achieved TFLOP/s", "automargin": True})
    return fig
