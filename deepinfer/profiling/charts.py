"""Plotly figures: the two standard sweep charts, the latency/throughput curve and the
profiler timeline. Every builder returns a ``go.Figure`` (or a ``go.FigureWidget`` with
``widget=True``); :func:`refresh_figure` updates a FigureWidget in place from a new figure.

* Prefill chart: ms per prefill step (y) vs non-cached input tokens/s per device (x).
* Decode chart: tokens/s per user (y) vs tokens/s per device (x), both with the
  effective tokens per step (accepted drafts + 1 with speculative decoding, named in the
  title); pick a per-user target first, then read throughput there.
* Timeline: ``go.Bar`` with ``base`` and ``orientation="h"`` (``px.timeline`` assumes
  datetimes and mangles microseconds), one trace per phase kind, lanes on the y axis.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from deepinfer.profiling.timeline import LANE_ORDER

__all__ = ["prefill_chart", "decode_chart", "latency_throughput_chart", "steps_figure", "timeline_figure",
           "refresh_figure"]

_KIND_COLORS = {"step": "#d0d0d0", "schedule": "#1f77b4", "update": "#9467bd", "prepare_inputs": "#17becf",
                "model": "#2ca02c", "logits": "#98df8a", "sample": "#ff7f0e", "wait": "#7f7f7f", "device": "#d62728"}


def _make(fig: go.Figure, widget: bool) -> go.Figure:
    return go.FigureWidget(fig) if widget else fig


def _subtitle(df: pd.DataFrame) -> str:
    parts = [str(df[c].iloc[0]) for c in ("model", "device", "dtype") if c in df and len(df)]
    return " | ".join(parts)


def prefill_chart(df: pd.DataFrame, widget: bool = False) -> go.Figure:
    """ms per prefill step vs non-cached input tok/s per device, one point per token budget."""
    d = df[df["kind"] == "prefill"].sort_values("max_num_batched_tokens") if "kind" in df else df.iloc[0:0]
    fig = go.Figure(go.Scatter(
        x=d.get("prefill_tok_s_per_device", []), y=d.get("prefill_ms_per_step", []), mode="lines+markers+text",
        cliponaxis=False, text=[f"{int(b)} tok" for b in d.get("max_num_batched_tokens", [])], textposition="top left",
        name="prefill", hovertemplate="%{x:.0f} tok/s<br>%{y:.2f} ms/step<br>budget %{text}<extra></extra>"))
    fig.update_layout(title=f"Prefill: ms per step vs input tok/s per device<br><sub>{_subtitle(d)}</sub>",
                      xaxis_title="non-cached input tokens/s per device", yaxis_title="ms per prefill step",
                      template="plotly_white", height=420)
    return _make(fig, widget)


def decode_chart(df: pd.DataFrame, widget: bool = False) -> go.Figure:
    """tok/s per user vs tok/s per device, one point per decode batch size."""
    d = df[df["kind"] == "decode"].sort_values("batch_size") if "kind" in df else df.iloc[0:0]
    eff = d["effective_tokens_per_step"] if "effective_tokens_per_step" in d else pd.Series(dtype=float)
    fig = go.Figure(go.Scatter(
        x=d.get("tok_s_per_device", []), y=d.get("tok_s_per_user", []), mode="lines+markers+text",
        cliponaxis=False, text=[f"B={int(b)}" for b in d.get("batch_size", [])], textposition="top right", name="decode",
        customdata=np.stack([eff.to_numpy(), d.get("decode_step_ms", eff).to_numpy()], axis=-1) if len(d) else None,
        hovertemplate=("%{x:.1f} tok/s/device<br>%{y:.1f} tok/s/user<br>%{text}<br>"
                       "%{customdata[0]:.2f} tokens/step, %{customdata[1]:.1f} ms/step<extra></extra>")))
    eff_txt = f"{eff.mean():.2f}" if len(eff) else "n/a"
    if len(d) and "spec_num_speculative_tokens" in d and d["spec_num_speculative_tokens"].notna().any():
        first = d[d["spec_num_speculative_tokens"].notna()].iloc[0]
        mode = "scheduled" if bool(first.get("spec_varlen", False)) else "fixed"
        eff_txt += f", speculative {first['spec_method']} k={int(first['spec_num_speculative_tokens'])} {mode}"
    fig.update_layout(title=(f"Decode: tok/s per user vs tok/s per device (effective tokens/step {eff_txt})"
                             f"<br><sub>{_subtitle(d)}</sub>"),
                      xaxis_title="tokens/s per device", yaxis_title="tokens/s per user",
                      template="plotly_white", height=420)
    return _make(fig, widget)


def latency_throughput_chart(df: pd.DataFrame, latency: str = "mean_tpot_ms", widget: bool = False) -> go.Figure:
    """Closed-loop workload points (or any rows with ``output_tok_s``): latency vs throughput."""
    d = df[df["kind"] == "workload"] if "kind" in df else df
    labels = [f"seqs={int(s)} tok={int(t)}" for s, t in zip(d.get("max_num_seqs", []),
                                                             d.get("max_num_batched_tokens", []))]
    fig = go.Figure(go.Scatter(x=d.get("output_tok_s", []), y=d.get(latency, []), mode="markers+text",
                               cliponaxis=False, text=labels,
                               textposition="top center", marker={"size": 10}, name=latency,
                               hovertemplate="%{x:.1f} out tok/s<br>%{y:.1f} ms<br>%{text}<extra></extra>"))
    fig.update_layout(title="Latency vs throughput", xaxis_title="output tokens/s", yaxis_title=latency,
                      template="plotly_white", height=380)
    return _make(fig, widget)


def steps_figure(steps: pd.DataFrame, widget: bool = False) -> go.Figure:
    """Per engine step (from ``llm.metrics.steps_df()``): prefill and decode tokens as
    stacked bars, step time as a line on the right axis."""
    x = steps["step"] if "step" in steps else []
    fig = go.Figure([
        go.Bar(x=x, y=steps.get("prefill_tokens", []), name="prefill tokens", marker={"color": "#1f77b4"}),
        go.Bar(x=x, y=steps.get("decode_tokens", []), name="decode tokens", marker={"color": "#ff7f0e"}),
        go.Scatter(x=x, y=steps.get("step_ms", []), name="step ms", yaxis="y2", mode="lines+markers",
                   line={"color": "#2ca02c"}),
    ])
    # the right axis needs its own margin (automargin): clipped, its line reads against the token axis
    fig.update_layout(title="Engine steps", barmode="stack", template="plotly_white", height=380,
                      xaxis_title="step", yaxis={"title": "scheduled tokens", "automargin": True},
                      yaxis2={"title": "step ms", "overlaying": "y", "side": "right", "rangemode": "tozero",
                              "automargin": True, "showgrid": False, "title_font": {"color": "#2ca02c"},
                              "tickfont": {"color": "#2ca02c"}},
                      margin={"l": 70, "r": 70, "t": 80, "b": 50},
                      legend={"orientation": "h", "x": 0, "y": 1.02, "yanchor": "bottom"})
    return _make(fig, widget)


def _merge(starts: np.ndarray, ends: np.ndarray, gap: float) -> tuple[np.ndarray, ...]:
    """Merge intervals closer than ``gap``: starts, ends, event counts and busy time of each."""
    if starts.size == 0:
        return starts, ends, np.zeros(0, dtype=int), np.zeros(0)
    order = np.argsort(starts)
    s, e = starts[order], ends[order]
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > np.maximum.accumulate(e)[:-1] + gap
    idx = np.flatnonzero(new)
    return s[idx], np.maximum.reduceat(e, idx), np.diff(np.append(idx, s.size)), np.add.reduceat(e - s, idx)


def timeline_figure(events: pd.DataFrame, merge_us: float = 20.0, widget: bool = False,
                    title: str = "Engine timeline") -> go.Figure:
    """Horizontal bars per lane (ms since the first traced step). Device events closer than
    ``merge_us`` are drawn as one bar whose opacity is its busy fraction (a launch-bound
    stretch of tiny kernels stays faint); hover gives the event count and busy time."""
    lanes = [ln for ln in LANE_ORDER if ln in set(events["lane"])]
    lanes += sorted(set(events["lane"]) - set(lanes))
    traces = []
    for kind, color in _KIND_COLORS.items():
        d = events[events["kind"] == kind]
        opacity: Any = 1.0
        if kind == "device":
            parts = [(*_merge(g["start_us"].to_numpy(float), g["end_us"].to_numpy(float), merge_us), lane)
                     for lane, g in d.groupby("lane")]
            s, e, n, busy = (np.concatenate([p[k] for p in parts]) if parts else np.zeros(0) for k in range(4))
            y = [p[4] for p in parts for _ in range(len(p[0]))]
            frac = np.clip(busy / np.maximum(e - s, 1e-9), 0.0, 1.0)
            opacity = np.maximum(frac, 0.15).tolist()
            hover = [f"{int(k)} device op(s), busy {b / 1e3:.3f} of {(t1 - t0) / 1e3:.3f} ms ({f:.0%})"
                     for t0, t1, k, b, f in zip(s, e, n, busy, frac)]
        else:
            s, e, y = d["start_us"].to_numpy(float), d["end_us"].to_numpy(float), list(d["lane"])
            hover = [f"{n} (step {st}), {(b - a) / 1e3:.3f} ms"
                     for n, st, a, b in zip(d["name"], d["step"], s, e)]
        traces.append(go.Bar(base=s / 1e3, x=(e - s) / 1e3, y=y, orientation="h", name=kind, hovertext=hover,
                             hoverinfo="text", marker={"color": color, "opacity": opacity}, width=0.7))
    fig = go.Figure(traces)
    fig.update_layout(title=title, barmode="overlay", template="plotly_white", height=140 + 45 * len(lanes),
                      xaxis_title="ms since first traced step",
                      yaxis={"categoryorder": "array", "categoryarray": lanes[::-1]},
                      legend={"orientation": "h", "x": 0, "y": 1.02, "yanchor": "bottom"})
    return _make(fig, widget)


def refresh_figure(target: go.Figure, new: go.Figure) -> None:
    """Make ``target`` (e.g. a displayed FigureWidget) show ``new`` without replacing the
    object: traces are updated in place when their count matches, else swapped."""
    with target.batch_update():
        if len(target.data) == len(new.data):
            for old, fresh in zip(target.data, new.data):
                old.update(fresh.to_plotly_json(), overwrite=True)
        else:
            target.data = ()
            target.add_traces(list(new.data))
        target.layout.update(new.layout.to_plotly_json(), overwrite=True)
