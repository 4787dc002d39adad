"""Capture a torch profiler trace of N engine steps while ``LLM.generate`` runs.

    cap = capture_trace(llm, prompt_token_ids=ids, sampling_params=sp, num_steps=4)
    cap.path            # chrome-trace JSON; opens in Perfetto UI / chrome://tracing
    cap.events          # pandas timeline (deepinfer.profiling.timeline.parse_trace)
    cap.steps, cap.gaps # per-step host/device table, device idle gaps between steps

The profiler advances once per engine step through ``llm.metrics.step_hooks`` with the
schedule ``wait=skip_steps, warmup=warmup_steps, active=num_steps``, so the trace holds
exactly the steps asked for (fewer if the workload ends first). CUDA activity is recorded
when the engine runs on a CUDA device. Keep the profiler off while timing (the sweep
does): it slows every op it records.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import pandas as pd

    from deepinfer.llm import LLM
    from deepinfer.outputs import RequestOutput
    from deepinfer.sampling_params import SamplingParams

__all__ = ["TraceCapture", "capture_trace"]


@dataclass
class TraceCapture:
    """A captured trace and the tables derived from it."""

    path: str
    outputs: list[RequestOutput] = field(repr=False)
    wall_s: float = 0.0
    _events: pd.DataFrame | None = field(default=None, repr=False)

    @property
    def events(self) -> pd.DataFrame:
        """The timeline DataFrame (parsed on first use)."""
        if self._events is None:
            from deepinfer.profiling.timeline import parse_trace

            self._events = parse_trace(self.path)
        return self._events

    @property
    def steps(self) -> pd.DataFrame:
        """Per step: phase times, host time, device busy / idle time (ms)."""
        from deepinfer.profiling.timeline import step_table

        return step_table(self.events)

    @property
    def gaps(self) -> pd.DataFrame:
        """Device idle gaps between consecutive steps (ms)."""
        from deepinfer.profiling.timeline import idle_gaps

        return idle_gaps(self.events)

    def figure(self, widget: bool = False, **kwargs: Any) -> Any:
        """The plotly timeline of this trace (a FigureWidget when ``widget``)."""
        from deepinfer.profiling.charts import timeline_figure

        return timeline_figure(self.events, widget=widget, **kwargs)


def capture_trace(llm: LLM, prompts: str | Sequence[str] | None = None,
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                  prompt_token_ids: Sequence[Sequence[int]] | None = None, num_steps: int = 4,
                  skip_steps: int = 1, warmup_steps: int = 1, out_dir: str = "artifacts/traces",
                  name: str | None = None, record_shapes: bool = False, with_stack: bool = False) -> TraceCapture:
    """Run ``llm.generate`` under the torch profiler and record ``num_steps`` engine steps
    after ``skip_steps`` untraced and ``warmup_steps`` warm-up steps; write the chrome
    trace to ``out_dir/<name>.json``."""
    if num_steps < 1 or skip_steps < 0 or warmup_steps < 0:
        raise ValueError("capture_trace needs num_steps >= 1, skip_steps >= 0, warmup_steps >= 0")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if llm.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name or time.strftime('trace-%Y%m%d-%H%M%S')}.json")
    prof = torch.profiler.profile(
        activities=activities, record_shapes=record_shapes, with_stack=with_stack,
        schedule=torch.profiler.schedule(wait=skip_steps, warmup=warmup_steps, active=num_steps, repeat=1))
    hooks = llm.metrics.step_hooks
    t0 = time.perf_counter()
    prof.start()
    hooks.append(prof.step)
    try:
        outputs = llm.generate(prompts, sampling_params, prompt_token_ids=prompt_token_ids, use_tqdm=False)
    finally:
        hooks.remove(prof.step)
        prof.stop()
    wall = time.perf_counter() - t0
    prof.export_chrome_trace(path)
    return TraceCapture(path=path, outputs=outputs, wall_s=wall)
