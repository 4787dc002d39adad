"""Latency distributions and engine state over time, for one run or several overlaid (aiperf
and vLLM's bench plots are the model): TTFT / TPOT per request and ITL per token as CDFs and
histograms, KV usage and queue lengths per step, and repeated runs as mean +- std bars.

Inputs are the engine's own frames: ``llm.metrics.requests_df()`` (``ttft_s``, ``tpot_s``),
``itl_df()`` (``itl_s``; a request's first row is its TTFT and is left out of ITL) and
``steps_df()`` (``t_start_s``, ``kv_usage``, ``num_running``, ``num_waiting``), or the same
tables of saved runs (:class:`~deepinfer.workbench.run_store.RunStore`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

__all__ = ["LATENCY_METRICS", "latency_values", "latency_cdf_figure", "latency_hist_figure", "kv_queue_figure",
           "repeat_stats", "error_bar_figure"]

#: metric -> (table, column): TTFT / TPOT per request, ITL per token (first token excluded).
LATENCY_METRICS = {"ttft_ms": ("requests", "ttft_s"), "tpot_ms": ("requests", "tpot_s"), "itl_ms": ("itl", "itl_s")}
_MARGIN = {"l": 70, "r": 30, "t": 60, "b": 60}


def latency_values(tables: Mapping[str, pd.DataFrame], metric: str) -> np.ndarray:
    """The ``metric`` samples (ms) of one run from its ``requests`` / ``itl`` tables."""
    if metric not in LATENCY_METRICS:
        raise ValueError(f"metric={metric!r}: must be one of {sorted(LATENCY_METRICS)}")
    table, column = LATENCY_METRICS[metric]
    df = tables.get(table)
    if df is None or column not in df:
        return np.empty(0)
    if metric == "itl_ms":  # each request's first row is its TTFT, not an inter-token gap
        df = df[df["index"] > 0]
    vals = pd.to_numeric(df[column], errors="coerce").dropna().to_numpy(float)
    return vals * 1e3


def latency_cdf_figure(runs: Mapping[str, Mapping[str, pd.DataFrame]], metric: str = "ttft_ms",
                       title: str | None = None) -> go.Figure:
    """Empirical CDF of ``metric`` per run (label -> tables), p50 / p90 / p99 in the hover."""
    fig = go.Figure()
    for label, tables in runs.items():
        v = np.sort(latency_values(tables, metric))
        if not v.size:
            continue
        p = np.arange(1, v.size + 1) / v.size
        fig.add_trace(go.Scatter(x=v, y=p, mode="lines", line={"shape": "hv"}, name=label,
                                 hovertemplate="%{x:.2f} ms: %{y:.0%} of samples<extra>" + label + "</extra>"))
    fig.update_layout(title=title or f"{metric} CDF", template="plotly_white", height=380, margin=_MARGIN,
                      xaxis={"title": metric.replace("_ms", " (ms)"), "automargin": True},
                      yaxis={"title": "fraction of samples <= x", "range": [0, 1.02], "automargin": True},
                      legend={"orientation": "h", "y": -0.25})
    return fig


def latency_hist_figure(runs: Mapping[str, Mapping[str, pd.DataFrame]], metric: str = "itl_ms",
                        bins: int = 40, title: str | None = None) -> go.Figure:
    """Histogram of ``metric`` per run on shared bins (counts normalised to a fraction)."""
    vals = {label: latency_values(t, metric) for label, t in runs.items()}
    pooled = np.concatenate([v for v in vals.values() if v.size]) if any(v.size for v in vals.values()) else np.empty(0)
    edges = np.histogram_bin_edges(pooled, bins=bins) if pooled.size else np.linspace(0, 1, bins + 1)
    fig = go.Figure()
    for label, v in vals.items():
        if not v.size:
            continue
        counts, _ = np.histogram(v, bins=edges)
        fig.add_trace(go.Bar(x=(edges[:-1] + edges[1:]) / 2, y=counts / v.size, width=np.diff(edges), name=label,
                             opacity=0.6))
    fig.update_layout(title=title or f"{metric} histogram", template="plotly_white", height=380, barmode="overlay",
                      margin=_MARGIN, xaxis={"title": metric.replace("_ms", " (ms)"), "automargin": True},
                      yaxis={"title": "fraction of samples", "automargin": True}, legend={"orientation": "h", "y": -0.25})
    return fig


def kv_queue_figure(runs: Mapping[str, pd.DataFrame], title: str = "KV usage and queues over time") -> go.Figure:
    """Per step (label -> ``steps_df()``): fullest KV pool's usage (top) and the running /
    waiting queue lengths (bottom) against the step's start time."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=("KV cache usage (fullest pool)", "requests running / waiting"))
    for label, steps in runs.items():
        if steps is None or not len(steps) or "kv_usage" not in steps:
            continue
        t = steps["t_start_s"]
        fig.add_trace(go.Scatter(x=t, y=steps["kv_usage"], mode="lines", name=f"{label} KV"), row=1, col=1)
        fig.add_trace(go.Scatter(x=t, y=steps["num_running"], mode="lines", line={"shape": "hv"},
                                 name=f"{label} running"), row=2, col=1)
        fig.add_trace(go.Scatter(x=t, y=steps["num_waiting"], mode="lines", line={"shape": "hv", "dash": "dot"},
                                 name=f"{label} waiting"), row=2, col=1)
    fig.update_yaxes(title_text="used / total", range=[0, 1.02], row=1, col=1, automargin=True)
    fig.update_yaxes(title_text="requests", rangemode="tozero", row=2, col=1, automargin=True)
    fig.update_xaxes(title_text="s since the metrics window opened", row=2, col=1)
    fig.update_layout(title=title, template="plotly_white", height=520, margin=_MARGIN,
                      legend={"orientation": "h", "y": -0.2})
    return fig


def repeat_stats(rows: Sequence[Mapping[str, Any]], by: str, metrics: Sequence[str]) -> pd.DataFrame:
    """Mean, std and count of each of ``metrics`` over the rows sharing ``by`` (repeats of one
    setting); std is the sample std (ddof=1), 0 for a single repeat."""
    df = pd.DataFrame(list(rows))
    missing = [c for c in (by, *metrics) if c not in df]
    if missing:
        raise ValueError(f"rows have no column(s) {missing}; columns: {sorted(df.columns)}")
    g = df.groupby(by)[list(metrics)]
    out = g.mean().add_suffix("_mean").join(g.std(ddof=1).fillna(0.0).add_suffix("_std")).join(
        g.size().rename("repeats"))
    return out.reset_index()


def error_bar_figure(stats: pd.DataFrame, x: str, y: str, title: str | None = None) -> go.Figure:
    """``y`` mean against ``x`` mean with +- std error bars on both (from :func:`repeat_stats`)."""
    fig = go.Figure(go.Scatter(
        x=stats[f"{x}_mean"], y=stats[f"{y}_mean"], mode="markers+lines",
        error_x={"type": "data", "array": stats[f"{x}_std"]}, error_y={"type": "data", "array": stats[f"{y}_std"]},
        text=[f"n={int(n)}" for n in stats["repeats"]], name=y))
    fig.update_layout(title=title or f"{y} vs {x} (mean +- std over repeats)", template="plotly_white", height=400,
                      margin=_MARGIN, xaxis={"title": x, "automargin": True}, yaxis={"title": y, "automargin": True})
    return fig
