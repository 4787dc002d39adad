"""Kernel breakdown of a GPU trace (``capture_trace`` on CUDA, or any PyTorch profiler
chrome trace): the top kernels by GPU time, GPU busy vs idle per engine step, and where the
idle time went (the GPU waiting on the host to launch, or on the kernels before it).

Top kernels and idle attribution come from HolisticTraceAnalysis (Meta's HTA, which parses
these traces as they are): ``get_gpu_kernel_breakdown`` and ``get_idle_time_breakdown``
(``host_wait``: idle because the next kernel was launched after the previous one ended;
``kernel_wait``: short gaps between queued kernels; ``other``). HTA's step view is
per-iteration over the whole trace, so busy / idle *per engine step* is the project's own
timeline (``deepinfer.profiling.timeline.step_table``: device time of the kernels each step
launched, and the rest of the step). A CPU-only trace has no kernels: the tables come back
empty and ``has_gpu`` is False.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any

import pandas as pd

__all__ = ["KernelBreakdown", "kernel_breakdown", "kernel_breakdown_figure"]


@dataclass
class KernelBreakdown:
    """What :func:`kernel_breakdown` found in one trace."""

    path: str
    top_kernels: pd.DataFrame  # name, total_us, mean_us, max_us, min_us, share (of all kernel time)
    idle: pd.DataFrame  # idle_category, idle_us, ratio (per stream, summed over streams)
    steps: pd.DataFrame  # step, step_ms, device_busy_ms, device_idle_ms
    source: str

    @property
    def has_gpu(self) -> bool:
        return len(self.top_kernels) > 0


def _hta(path: str, top: int) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    import hta
    from hta.trace_analysis import TraceAnalysis

    log = logging.getLogger("hta")
    level = log.level
    log.setLevel(logging.WARNING)  # HTA reports every parse step at INFO: noise in a notebook
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            analysis = TraceAnalysis(trace_files={0: os.path.abspath(path)}, trace_dir=os.path.dirname(os.path.abspath(path)),
                                     include_last_profiler_step=True)
            _, kernels = analysis.get_gpu_kernel_breakdown(visualize=False, num_kernels=top, duration_ratio=1.0)
            idle, _ = analysis.get_idle_time_breakdown(visualize=False)
    finally:
        log.setLevel(level)
    k = kernels.rename(columns={"sum (us)": "total_us", "mean (us)": "mean_us", "max (us)": "max_us",
                                "min (us)": "min_us"})
    k = k[~k["name"].str.startswith("Others")] if len(k) else k
    total = float(k["total_us"].sum()) if len(k) else 0.0
    k = k.assign(share=k["total_us"] / total if total else 0.0)[["name", "total_us", "mean_us", "max_us", "min_us", "share"]]
    k = k.sort_values("total_us", ascending=False).head(top).reset_index(drop=True)
    i = idle.groupby("idle_category", as_index=False)["idle_time"].sum().rename(columns={"idle_time": "idle_us"})
    i["ratio"] = i["idle_us"] / i["idle_us"].sum() if i["idle_us"].sum() else 0.0
    return k, i, f"HolisticTraceAnalysis {getattr(hta, '__version__', '')}".strip()


def kernel_breakdown(path: str | os.PathLike[str], top: int = 15) -> KernelBreakdown:
    """Top ``top`` kernels, idle attribution and per-step busy / idle of the trace at ``path``."""
    from deepinfer.profiling.timeline import parse_trace, step_table

    path = os.fspath(path)
    events = parse_trace(path)
    steps = step_table(events) if len(events) else pd.DataFrame()
    cols = [c for c in ("step", "step_ms", "device_busy_ms", "device_idle_ms") if c in steps]
    steps = steps[cols].reset_index(drop=True) if cols else steps
    if not (events["kind"] == "device").any() or not any(str(lane).startswith("device s") for lane in events["lane"]):
        empty_k = pd.DataFrame(columns=["name", "total_us", "mean_us", "max_us", "min_us", "share"])
        return KernelBreakdown(path, empty_k, pd.DataFrame(columns=["idle_category", "idle_us", "ratio"]), steps,
                               "no GPU kernels in the trace")
    kernels, idle, source = _hta(path, top)
    return KernelBreakdown(path, kernels, idle, steps, source)


def kernel_breakdown_figure(kb: KernelBreakdown, title: str | None = None) -> Any:
    """Top kernels (bars), per-step GPU busy vs idle (stacked) and idle attribution (bars)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=3, column_widths=[0.45, 0.35, 0.2], horizontal_spacing=0.12,
                        subplot_titles=("top kernels (GPU time, us)", "per step: GPU busy / idle (ms)",
                                        "idle time attribution"))
    k = kb.top_kernels.iloc[::-1]
    fig.add_trace(go.Bar(x=k["total_us"], y=[n[:48] for n in k["name"]], orientation="h", name="kernel time",
                         hovertext=list(k["name"]), showlegend=False), row=1, col=1)
    if len(kb.steps):
        fig.add_trace(go.Bar(x=kb.steps["step"], y=kb.steps["device_busy_ms"], name="busy"), row=1, col=2)
        fig.add_trace(go.Bar(x=kb.steps["step"], y=kb.steps["device_idle_ms"], name="idle"), row=1, col=2)
    fig.add_trace(go.Bar(x=kb.idle["idle_category"], y=kb.idle["idle_us"] / 1e3, name="idle ms",
                         showlegend=False), row=1, col=3)
    fig.update_layout(title=title or f"Kernel breakdown ({kb.source})", template="plotly_white", height=440,
                      barmode="stack", margin={"l": 200, "r": 30, "t": 80, "b": 60},
                      legend={"orientation": "h", "y": -0.2})
    fig.update_yaxes(automargin=True)
    return fig
