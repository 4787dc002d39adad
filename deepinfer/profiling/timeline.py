"""Parse a torch profiler chrome trace into a pandas timeline with engine lanes.

Lanes (top to bottom): ``step`` (the profiler's ``ProfilerStep#N`` ranges, one per engine
step), ``host scheduling`` (schedule + update), ``input prep``, ``model`` (forward +
logits), ``sampling``, and the device: one ``device sN`` lane per CUDA stream from the
trace's kernels / copies, or, on a CPU-only trace, one ``device`` lane holding the
top-level CPU ops that run inside the model phases (on CPU those ops *are* the device).

Derived figures: :func:`step_table` (per step: phase times, host time, device busy and
idle time) and :func:`idle_gaps` (device idle time between consecutive steps: the end of
one step's last device event to the start of the next step's first).

A GPU event belongs to the step in which the host LAUNCHED it (the trace's ``correlation``
id links a kernel / copy to its runtime or driver call), not the step during which it
ran: with async scheduling the device runs step N while the host is already in the next
profiler step, and only the launch tells whose work a kernel is.

HolisticTraceAnalysis (0.5.0) was tried on our traces: it parses them, but its idle-time
and temporal breakdowns fail on CPU-only traces (no GPU kernels) and it knows nothing of
our phases, so this module parses the chrome trace itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from deepinfer.profiling.markers import LOGITS, MODEL, PREPARE_INPUTS, SAMPLE, SCHEDULE, UPDATE, WAIT

__all__ = ["parse_trace", "step_table", "idle_gaps", "PHASE_LANES", "LANE_ORDER", "load_trace"]

PHASE_LANES: dict[str, str] = {SCHEDULE: "host scheduling", UPDATE: "host scheduling",
                               PREPARE_INPUTS: "input prep", MODEL: "model", LOGITS: "model",
                               SAMPLE: "sampling", WAIT: "host waits"}
LANE_ORDER: tuple[str, ...] = ("step", "host scheduling", "input prep", "model", "sampling", "host waits")
_DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver"})
_COLUMNS = ["name", "lane", "kind", "step", "start_us", "dur_us", "end_us", "tid"]


def load_trace(trace: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A chrome trace as a dict (from a path or an already loaded dict)."""
    if isinstance(trace, Mapping):
        return dict(trace)
    with open(trace) as f:
        return json.load(f)


def _top_level(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """CPU ops not nested in another op of the same thread (ops on a thread nest properly)."""
    out: list[dict[str, Any]] = []
    end_by_tid: dict[Any, float] = {}
    for e in sorted(ops, key=lambda e: (e["ts"], -e.get("dur", 0.0))):
        if e["ts"] >= end_by_tid.get(e["tid"], -np.inf):
            out.append(e)
            end_by_tid[e["tid"]] = e["ts"] + e.get("dur", 0.0)
    return out


def parse_trace(trace: str | Path | Mapping[str, Any]) -> pd.DataFrame:
    """Events of a chrome trace as a DataFrame, one row per range on a lane.

    Columns: name, lane, kind (``step``, a phase name without its prefix, or
    ``device``), step (engine step number of the profiler, -1 before the first), start_us /
    dur_us / end_us (relative to the first step's start), tid (thread or CUDA stream).
    """
    events = [e for e in load_trace(trace).get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    rows: list[tuple[Any, ...]] = []
    # CUDA traces repeat each ProfilerStep as a gpu_user_annotation; the host's range counts.
    steps = sorted((e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
                    and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    phases = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") in PHASE_LANES]
    device = [e for e in events if e.get("cat") in _DEVICE_CATS]
    for e in steps:
        rows.append((e["name"], "step", "step", e))
    for e in phases:
        rows.append((e["name"], PHASE_LANES[e["name"]], e["name"].split(".", 1)[-1], e))
    if device:
        launched = {e["args"]["correlation"]: e["ts"] for e in events
                    if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})}
        for e in device:
            at = launched.get(e.get("args", {}).get("correlation"), e["ts"])
            rows.append((e["name"], f"device s{e.get('tid')}", "device", e, at))
    else:  # CPU-only: the model phases' top-level ops are the device's work
        model = [(e["ts"], e["ts"] + e["dur"], e["tid"]) for e in phases if PHASE_LANES[e["name"]] == "model"]
        cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
        for e in _top_level(cpu_ops):
            if any(s <= e["ts"] < t and e["tid"] == tid for s, t, tid in model):
                rows.append((e["name"], "device", "device", e))
    if not rows:
        return pd.DataFrame(columns=_COLUMNS)
    origin = steps[0]["ts"] if steps else min(r[3]["ts"] for r in rows)
    step_starts = np.array([e["ts"] for e in steps], dtype=float)
    step_ids = [int(e["name"].split("#", 1)[1]) for e in steps]
    data = []
    for name, lane, kind, e, *launch in rows:  # device rows carry their launch time
        k = int(np.searchsorted(step_starts, launch[0] if launch else e["ts"], side="right")) - 1
        step = step_ids[k] if k >= 0 else -1
        start, dur = float(e["ts"]) - origin, float(e.get("dur", 0.0))
        data.append((name, lane, kind, step, start, dur, start + dur, e.get("tid")))
    df = pd.DataFrame(data, columns=_COLUMNS)
    return df.sort_values(["start_us", "lane"], kind="stable").reset_index(drop=True)


def _union_us(starts: np.ndarray, ends: np.ndarray) -> float:
    """Total length covered by intervals [starts, ends)."""
    if starts.size == 0:
        return 0.0
    order = np.argsort(starts)
    total, cur_s, cur_e = 0.0, starts[order[0]], ends[order[0]]
    for s, e in zip(starts[order[1:]], ends[order[1:]]):
        if s > cur_e:
            total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return float(total + cur_e - cur_s)


def step_table(events: pd.DataFrame) -> pd.DataFrame:
    """Per engine step (ms): step time, each phase, host time, device busy / idle time.

    ``host_ms`` = step time minus the model, sampling and wait phases: what the host spends
    on scheduling, input prep, update, detokenisation and bookkeeping (on a GPU the model
    and sampling phases are host launch time too: add them back for the host's whole
    share). ``wait_ms`` is the host blocked on results. ``device_busy_ms`` is the union of
    the step's device intervals; ``device_idle_ms`` the rest of the step.
    """
    rows = []
    dev = events[events["kind"] == "device"]
    for _, st in events[events["lane"] == "step"].iterrows():
        mine = events[(events["step"] == st["step"]) & (events["lane"] != "step")]
        by_kind = mine.groupby("kind")["dur_us"].sum() / 1e3
        d = dev[dev["step"] == st["step"]]
        busy = _union_us(d["start_us"].to_numpy(), d["end_us"].to_numpy()) / 1e3
        step_ms = st["dur_us"] / 1e3
        row = {"step": int(st["step"]), "start_ms": st["start_us"] / 1e3, "step_ms": step_ms}
        for kind in ("schedule", "prepare_inputs", "model", "logits", "sample", "wait", "update"):
            row[f"{kind}_ms"] = float(by_kind.get(kind, 0.0))
        row["host_ms"] = step_ms - row["model_ms"] - row["logits_ms"] - row["sample_ms"] - row["wait_ms"]
        row["device_busy_ms"] = busy
        row["device_idle_ms"] = max(step_ms - busy, 0.0)
        rows.append(row)
    return pd.DataFrame(rows)


def idle_gaps(events: pd.DataFrame) -> pd.DataFrame:
    """Device idle time between consecutive steps (ms): from the last device event of step
    ``prev_step`` to the first device event of ``step``."""
    dev = events[(events["kind"] == "device") & (events["step"] >= 0)]
    if dev.empty:
        return pd.DataFrame(columns=["prev_step", "step", "gap_start_ms", "gap_ms"])
    span = dev.groupby("step").agg(first=("start_us", "min"), last=("end_us", "max")).sort_index()
    rows = []
    for (p, prev), (s, cur) in zip(span.iloc[:-1].iterrows(), span.iloc[1:].iterrows()):
        rows.append({"prev_step": int(p), "step": int(s), "gap_start_ms": prev["last"] / 1e3,
                     "gap_ms": max(cur["first"] - prev["last"], 0.0) / 1e3})
    return pd.DataFrame(rows, columns=["prev_step", "step", "gap_start_ms", "gap_ms"])
