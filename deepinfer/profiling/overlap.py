"""Sync vs async scheduling: device busy intervals and host time per step from host clocks.

Why not the torch trace alone: on CPU the async engine runs the model in a worker thread,
and torch 2.13's profiler records ops only on the thread that started it (no child-thread
switch is exposed), so a CPU trace of async mode shows the host lanes but no device. Here
the runner's ``execute`` (the device's work on CPU; launch + wait on a GPU) is timed with
``perf_counter`` on whatever thread runs it, and the result is an events table in the
schema of :func:`deepinfer.profiling.timeline.parse_trace` (lanes ``step`` and ``device``),
so :func:`~deepinfer.profiling.timeline.idle_gaps` and the timeline charts work on it.

    rec = StepClock.attach(llm)
    llm.generate(...)
    rec.detach(); rec.summary(); rec.events()
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

    from deepinfer.llm import LLM

__all__ = ["StepClock"]


class StepClock:
    """Times every non-empty ``runner.execute`` (device intervals) and every engine step."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.device: list[tuple[float, float, str]] = []  # (start, end, thread name)
        self.steps: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._execute = llm.runner.execute
        self._step = llm.step
        self._wait0 = llm.async_loop.wait_s if llm.async_loop is not None else 0.0

    @classmethod
    def attach(cls, llm: LLM) -> StepClock:
        rec = cls(llm)

        def execute(so: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return rec._execute(so, *args, **kwargs)
            finally:
                if not so.is_empty:
                    with rec._lock:
                        rec.device.append((t0, time.perf_counter(), threading.current_thread().name))

        def step(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return rec._step(*args, **kwargs)
            finally:
                rec.steps.append((t0, time.perf_counter()))

        llm.runner.execute = execute  # type: ignore[method-assign]
        llm.step = step  # type: ignore[method-assign]
        return rec

    def detach(self) -> None:
        del self.llm.runner.execute  # instance attributes: the class methods show through again
        del self.llm.step

    def summary(self) -> dict[str, float]:
        """steps, wall_s, steps_per_s, device busy / idle, idle gaps between consecutive device
        intervals (mean, p50, max, as % of the mean device step), host ms per step (main-thread
        time not spent in execute (sync) or blocked on a step's result (async))."""
        dev = sorted(self.device)
        if not dev or not self.steps:
            return {}
        t0, t1 = self.steps[0][0], self.steps[-1][1]
        wall = t1 - t0
        busy = float(sum(e - s for s, e, _ in dev))
        gaps = np.array([max(dev[i + 1][0] - dev[i][1], 0.0) for i in range(len(dev) - 1)]) * 1e3
        step_ms = busy / len(dev) * 1e3
        if self.llm.async_loop is not None:
            blocked = self.llm.async_loop.wait_s - self._wait0
        else:
            blocked = busy  # the main thread is the device
        n = len(self.steps)
        return {
            "steps": n, "device_steps": len(dev), "wall_s": wall, "steps_per_s": len(dev) / wall,
            "device_busy_s": busy, "device_busy_frac": busy / wall, "mean_device_step_ms": step_ms,
            "mean_gap_ms": float(gaps.mean()) if gaps.size else 0.0,
            "p50_gap_ms": float(np.median(gaps)) if gaps.size else 0.0,
            "max_gap_ms": float(gaps.max()) if gaps.size else 0.0,
            "gap_pct_of_step": float(gaps.mean() / step_ms * 100) if gaps.size else 0.0,
            "host_ms_per_step": (wall - blocked) / n * 1e3,
        }

    def events(self) -> pd.DataFrame:
        """Events in ``parse_trace``'s schema: one ``step`` row per engine step, one
        ``device`` row per execute (its step = the engine step it started in)."""
        import pandas as pd

        from deepinfer.profiling.timeline import _COLUMNS

        if not self.steps:
            return pd.DataFrame(columns=_COLUMNS)
        origin = self.steps[0][0]
        starts = np.array([s for s, _ in self.steps])
        rows = []
        for k, (s, e) in enumerate(self.steps):
            rows.append((f"ProfilerStep#{k}", "step", "step", k, (s - origin) * 1e6, (e - s) * 1e6, (e - origin) * 1e6,
                         "main"))
        for s, e, tid in sorted(self.device):
            k = int(np.searchsorted(starts, s, side="right")) - 1
            rows.append(("execute", "device", "device", k, (s - origin) * 1e6, (e - s) * 1e6, (e - origin) * 1e6, tid))
        return pd.DataFrame(rows, columns=_COLUMNS).sort_values(["start_us", "lane"], kind="stable") \
            .reset_index(drop=True)
