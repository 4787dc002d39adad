"""Kernel breakdown of a GPU trace (``capture_trace`` on CUDA, or any PyTorch profiler
chrome trace): the top kernels by GPU time, GPU busy vs idle per engine step, and where the
idle time went (the GPU waiting on the host to launch, or on the kernels before it).

Idle attribution comes from HolisticTraceAnalysis (Meta's HTA, which parses these traces as
they are): ``get_idle_time_breakdown`` (``host_wait``: idle because the next kernel was
launched after the previous one ended; ``kernel_wait``: short gaps between queued kernels;
``other``), with HTA's rounding of nanosecond timestamps to whole microseconds turned off for
the call: that rounding shrinks every kernel by up to 2 us, so on a decode trace of
few-microsecond kernels it drops most of their time into "idle".

The top-kernel table is the project's own, from the same parsed device events as the
per-step view (``deepinfer.profiling.timeline``), because HTA's ``get_gpu_kernel_breakdown``
does not fit a real trace: past ``num_kernels`` names it re-aggregates the table, so every
row's mean / max / min become the row's total, it leaves copies and memsets out by default,
and it keeps one ``others`` row per kernel type. Here every kernel, copy and memset counts;
the top ``top`` names by total time get a row each and the rest one ``other (N kernels)``
row, so the shares sum to 1 over all device time. HTA still names each row's kind
(COMPUTATION / COMMUNICATION / MEMORY). HTA's step view is per-iteration over the whole
trace, so busy / idle *per engine step* is the project's timeline too (``step_table``:
device time of the kernels each step launched, and the rest of the step). A CPU-only trace
has no kernels: the tables come back empty and ``has_gpu`` is False.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pandas as pd

__all__ = ["KernelBreakdown", "kernel_breakdown", "kernel_breakdown_figure", "top_kernels"]


_KERNEL_COLUMNS = ["name", "kind", "launches", "total_us", "mean_us", "max_us", "min_us", "share"]
_IDLE_COLUMNS = ["idle_category", "idle_us", "ratio"]
_NO_ROUNDING = "HTA_DISABLE_NS_ROUNDING"  # HTA's own switch (hta.configs.env_options)


@dataclass
class KernelBreakdown:
    """What :func:`kernel_breakdown` found in one trace."""

    path: str
    # name, kind (HTA's kernel type), launches, total_us, mean_us / max_us / min_us (per
    # launch), share (of all device time; the shares sum to 1 with the ``other`` row)
    top_kernels: pd.DataFrame
    idle: pd.DataFrame  # idle_category, idle_us, ratio (per stream, summed over streams)
    steps: pd.DataFrame  # step, step_ms, device_busy_ms, device_idle_ms
    source: str

    @property
    def has_gpu(self) -> bool:
        return len(self.top_kernels) > 0


def top_kernels(device: pd.DataFrame, top: int) -> pd.DataFrame:
    """Per kernel name of ``device`` (rows of ``parse_trace`` with ``name`` and ``dur_us``):
    launches and per-launch times, the ``top`` names by total time, the rest as one row."""
    from hta.utils.utils import get_kernel_type

    if top < 1:
        raise ValueError(f"top must be >= 1 (kernel rows to keep), got {top}")
    if not len(device):
        return pd.DataFrame(columns=_KERNEL_COLUMNS)
    g = device.groupby("name")["dur_us"].agg(launches="size", total_us="sum", mean_us="mean", max_us="max",
                                              min_us="min")
    g = g.sort_values(["total_us", "launches"], ascending=False, kind="stable").reset_index()
    g.insert(1, "kind", [get_kernel_type(str(n)) for n in g["name"]])
    head, rest = g.head(top), g.iloc[top:]
    if len(rest):
        launches = int(rest["launches"].sum())
        other = {"name": f"other ({len(rest)} kernels)", "kind": "/".join(sorted(set(rest["kind"]))),
                 "launches": launches, "total_us": float(rest["total_us"].sum()),
                 "mean_us": float(rest["total_us"].sum()) / launches, "max_us": float(rest["max_us"].max()),
                 "min_us": float(rest["min_us"].min())}
        head = pd.concat([head, pd.DataFrame([other])], ignore_index=True)
    total = float(g["total_us"].sum())
    return head.assign(share=head["total_us"] / total if total else 0.0)[_KERNEL_COLUMNS]


@contextmanager
def _exact_quiet_hta() -> Iterator[None]:
    """HTA with nanosecond timestamps kept and its parse-time log lines (WARNING level, on
    the console) held back: a notebook shows them in the error style."""
    log = logging.getLogger("hta")
    level, before = log.level, os.environ.get(_NO_ROUNDING)
    log.setLevel(logging.ERROR)
    os.environ[_NO_ROUNDING] = "1"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)
        if before is None:
            os.environ.pop(_NO_ROUNDING, None)
        else:
            os.environ[_NO_ROUNDING] = before


def _hta_idle(path: str) -> tuple[pd.DataFrame, str]:
    import hta
    from hta.trace_analysis import TraceAnalysis

    with _exact_quiet_hta():
        analysis = TraceAnalysis(trace_files={0: os.path.abspath(path)}, trace_dir=os.path.dirname(os.path.abspath(path)),
                                 include_last_profiler_step=True)
        idle, _ = analysis.get_idle_time_breakdown(visualize=False)
    i = idle.groupby("idle_category", as_index=False)["idle_time"].sum().rename(columns={"idle_time": "idle_us"})
    i["ratio"] = i["idle_us"] / i["idle_us"].sum() if i["idle_us"].sum() else 0.0
    return i[_IDLE_COLUMNS], f"HolisticTraceAnalysis {getattr(hta, '__version__', '')}".strip()


def kernel_breakdown(path: str | os.PathLike[str], top: int = 15) -> KernelBreakdown:
    """Top ``top`` kernels (and one row for the rest), idle attribution and per-step busy /
    idle of the trace at ``path``."""
    from deepinfer.profiling.timeline import parse_trace, step_table

    path = os.fspath(path)
    events = parse_trace(path)
    steps = step_table(events) if len(events) else pd.DataFrame()
    cols = [c for c in ("step", "step_ms", "device_busy_ms", "device_idle_ms") if c in steps]
    steps = steps[cols].reset_index(drop=True) if cols else steps
    device = events[(events["kind"] == "device") & events["lane"].astype(str).str.startswith("device s")]
    kernels = top_kernels(device, top)
    if not len(device):
        return KernelBreakdown(path, kernels, pd.DataFrame(columns=_IDLE_COLUMNS), steps, "no GPU kernels in the trace")
    idle, source = _hta_idle(path)
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
