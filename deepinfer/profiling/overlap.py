"""Sync vs async scheduling from a profiler timeline: device idle between consecutive
steps, host time per step, and a compact timeline to record beside the numbers.

    cap = capture_trace(llm, prompt_token_ids=ids, sampling_params=sp, num_steps=8)
    overlap_summary(cap.events)        # one dict of per-step means
    compact_timeline(cap.events, 3)    # a few steps as plain rows (JSON-able)

Both read :func:`deepinfer.profiling.timeline.parse_trace` output, so CPU traces (the
device lane = the CPU ops of the model phases) and CUDA traces (kernels and copies per
stream, each counted in the step that launched it) give the same figures. Definitions:

* gap: device idle from the end of step N's last device event to the start of step N+1's
  first (0 when they overlap); ``gap_pct_of_step`` = mean gap / mean device step period
  (the time between consecutive steps' first device events) x 100;
* host ms per step: on a GPU the host's whole step minus the time it blocked on results
  (``deepinfer.wait``); on CPU, where the model and sampling phases are device work run
  by the host thread, those are subtracted too (``step_table``'s ``host_ms``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from deepinfer.profiling.timeline import _union_us, idle_gaps, step_table

__all__ = ["overlap_summary", "compact_timeline"]


def _is_gpu(events: pd.DataFrame) -> bool:
    return bool(events["lane"].astype(str).str.startswith("device s").any())


def overlap_summary(events: pd.DataFrame, skip_steps: int = 0, skip_last: int = 0) -> dict[str, Any]:
    """Means over the traced steps (without the first ``skip_steps`` and the last ``skip_last``:
    on a GPU the last step's kernels may finish after the profiler stopped) of step time,
    device busy, the idle gap between consecutive steps (ms and % of the device step period),
    host time and host wait per step. Empty dict when fewer than two device steps remain."""
    steps = step_table(events)
    dev = events[(events["kind"] == "device") & (events["step"] >= 0)]
    keep = sorted(steps["step"])[skip_steps:len(steps) - skip_last] if not steps.empty else []
    if dev[dev["step"].isin(keep)]["step"].nunique() < 2:
        return {}
    steps = steps[steps["step"].isin(keep)]
    dev = dev[dev["step"].isin(keep)]
    span = dev.groupby("step").agg(first=("start_us", "min"), last=("end_us", "max")).sort_index()
    gaps = idle_gaps(events)
    gaps = gaps[gaps["step"].isin(span.index[1:])]
    period = np.diff(span["first"].to_numpy()) / 1e3
    gpu = _is_gpu(events)
    host = steps["step_ms"] - steps["wait_ms"] if gpu else steps["host_ms"]
    mean_gap = float(gaps["gap_ms"].mean()) if len(gaps) else 0.0
    mean_period = float(period.mean()) if period.size else float("nan")
    window = (span["last"].max() - span["first"].min()) / 1e3
    busy = _union_us(dev["start_us"].to_numpy(float), dev["end_us"].to_numpy(float)) / 1e3
    return {
        "device": "gpu" if gpu else "cpu", "steps": int(len(steps)),
        "mean_step_ms": float(steps["step_ms"].mean()),
        "mean_device_period_ms": mean_period,
        "mean_device_busy_ms": float(steps["device_busy_ms"].mean()),
        # label-free cross-check: 1 - this counts every idle microsecond, inside steps too
        "device_busy_frac": float(busy / window) if window > 0 else float("nan"),
        "mean_gap_ms": mean_gap,
        "p50_gap_ms": float(gaps["gap_ms"].median()) if len(gaps) else 0.0,
        "max_gap_ms": float(gaps["gap_ms"].max()) if len(gaps) else 0.0,
        "gap_pct_of_step": mean_gap / mean_period * 100 if mean_period > 0 else float("nan"),
        "host_ms_per_step": float(host.mean()),
        "wait_ms_per_step": float(steps["wait_ms"].mean()),
    }


def _merge(starts: np.ndarray, ends: np.ndarray, gap_us: float) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(zip(starts, ends)):
        if out and s <= out[-1][1] + gap_us:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def compact_timeline(events: pd.DataFrame, num_steps: int = 3, first_step: int | None = None,
                     merge_us: float = 5.0) -> list[dict[str, Any]]:
    """``num_steps`` consecutive steps as rows in ``parse_trace``'s schema, device events of
    a lane merged when closer than ``merge_us`` (a whole decode step of kernels becomes a
    few bars), times relative to the first kept step: small enough to store in a result
    JSON and redraw with :func:`deepinfer.profiling.charts.timeline_figure`."""
    traced = sorted(s for s in events["step"].unique() if s >= 0)
    if not traced:
        return []
    start = traced[min(1, len(traced) - 1)] if first_step is None else first_step
    keep = [s for s in traced if start <= s < start + num_steps]
    ev = events[events["step"].isin(keep)]
    rows = [r for r in ev[ev["kind"] != "device"].to_dict("records")]
    for (lane, step), g in ev[ev["kind"] == "device"].groupby(["lane", "step"]):
        for s, e in _merge(g["start_us"].to_numpy(float), g["end_us"].to_numpy(float), merge_us):
            rows.append({"name": "device work", "lane": lane, "kind": "device", "step": int(step), "start_us": s,
                         "dur_us": e - s, "end_us": e, "tid": str(g["tid"].iloc[0])})
    origin = min((r["start_us"] for r in rows), default=0.0)
    for r in rows:
        r["start_us"] -= origin
        r["end_us"] -= origin
        r["step"] = int(r["step"])
        r["tid"] = str(r["tid"])
    return sorted(rows, key=lambda r: (r["start_us"], r["lane"]))
