"""Timeline viewer: capture a profiler trace of a few engine steps and show it as lanes
(host scheduling, input prep, model, sampling, device) with per-step host time and the
device idle gaps between steps. Changing the batch controls recaptures; changing the
merge threshold only redraws.

    viewer = TimelineViewer(llm)
    viewer                      # displays controls, the timeline and the step table
    viewer.capture(num_steps=4) # the same from code; returns the TraceCapture
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import ipywidgets as W
import pandas as pd

from deepinfer.profiling.charts import timeline_figure
from deepinfer.profiling.sweep import set_batch_limits
from deepinfer.profiling.trace import TraceCapture, capture_trace
from deepinfer.profiling.workload import DEFAULT_WORKLOAD, load_workload, scale_workload, synth_prompts
from deepinfer.workbench.base import Panel, slider
from deepinfer.workbench.figure_pane import FigurePane
from deepinfer.workbench.run_queue import RunQueue

if TYPE_CHECKING:
    from deepinfer.llm import LLM

__all__ = ["TimelineViewer"]

_EMPTY = pd.DataFrame(columns=["name", "lane", "kind", "step", "start_us", "dur_us", "end_us", "tid"])


class TimelineViewer(Panel):
    """Controls -> ``capture_trace`` on ``llm`` -> timeline FigureWidget + step table."""

    def __init__(self, llm: LLM, workload: str = DEFAULT_WORKLOAD, num_requests: int = 4, num_steps: int = 3,
                 output_len: int = 6, out_dir: str = "artifacts/traces", capture_now: bool = True) -> None:
        super().__init__(RunQueue("capture"))
        self.llm, self.out_dir = llm, out_dir
        self.workload = load_workload(workload)
        self.last: TraceCapture | None = None
        slots = llm.kv_manager.max_num_seqs
        self.num_requests = slider(W.IntSlider, "requests (batch)", min(num_requests, slots), 1, slots)
        self.max_num_batched_tokens = slider(W.IntSlider, "max_num_batched_tokens", llm.config.max_num_batched_tokens,
                                             16, max(2048, llm.config.max_num_batched_tokens), 16)
        self.num_steps = slider(W.IntSlider, "traced steps", num_steps, 1, 8)
        self.output_len = slider(W.IntSlider, "output tokens", output_len, 1, 32)
        self.merge_us = slider(W.FloatSlider, "merge device ops < us", 20.0, 0.0, 500.0, 10.0)
        self.capture_button = W.Button(description="Capture", button_style="primary")
        self.status = W.HTML(value="<i>press Capture or move a slider</i>")
        self.table = W.HTML()
        self.figure = FigurePane(timeline_figure(_EMPTY))
        self.capture_button.on_click(lambda _: self.queue.submit(self.capture))
        self.observe_controls([self.num_requests, self.max_num_batched_tokens, self.num_steps, self.output_len])
        self.merge_us.observe(lambda _: self.redraw(), names="value")
        controls = [self.num_requests, self.max_num_batched_tokens, self.num_steps, self.output_len, self.merge_us]
        self.widget = W.VBox([W.HBox([W.VBox(controls), W.VBox([self.capture_button, self.status])]),
                              self.queue.widget, self.figure.widget, self.table])
        if capture_now:
            self.capture()

    def capture(self, **values: Any) -> TraceCapture:
        """Trace ``traced steps`` engine steps of a batch of workload requests (one untraced
        and one warm-up step first) and redraw; ``values`` set controls first. From code
        (not the queue's worker) it first waits for captures the controls started."""
        if threading.current_thread() is not self.queue.thread:
            self.wait()
        self.set_controls(values)
        set_batch_limits(self.llm, max_num_batched_tokens=self.max_num_batched_tokens.value)
        reqs = scale_workload(self.workload, self.num_requests.value, output_len=self.output_len.value + 2
                              + self.num_steps.value, max_len=self.llm.config.max_model_len)
        from deepinfer.sampling_params import SamplingParams

        params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in reqs]
        self.status.value = "<i>capturing...</i>"
        total = 1 + max(r.output_len for r in reqs)  # about one prefill step, then one step per token
        steps = [0]

        def progress() -> None:  # an engine step hook: the bar, the estimate and Cancel
            steps[0] += 1
            self.queue.check(steps[0], total)

        self.llm.metrics.step_hooks.append(progress)
        try:
            self.last = capture_trace(self.llm, prompt_token_ids=synth_prompts(reqs, vocab_size=self.llm.model_config.vocab_size),
                                      sampling_params=params, num_steps=self.num_steps.value, out_dir=self.out_dir,
                                      name="timeline-viewer")
        finally:
            self.llm.metrics.step_hooks.remove(progress)
        self.redraw()
        return self.last

    refresh = capture

    @property
    def events(self) -> pd.DataFrame:
        """The last capture's timeline (empty before the first capture)."""
        return self.last.events if self.last is not None else _EMPTY

    def redraw(self) -> None:
        """Redraw the figure and the step table from the last capture."""
        if self.last is None:
            return
        self.figure.show(timeline_figure(self.events, merge_us=self.merge_us.value))
        steps, gaps = self.last.steps, self.last.gaps
        self.table.value = (steps.round(3).to_html(index=False) + "<br>"
                            + gaps.round(3).to_html(index=False))
        if steps.empty:
            self.status.value = "<b>no step was traced</b>: the batch finished first; raise output tokens"
            return
        mean_gap = gaps["gap_ms"].mean() if len(gaps) else float("nan")
        self.status.value = (f"{len(steps)} steps traced, host {steps['host_ms'].mean():.2f} ms/step, "
                             f"device idle between steps {mean_gap:.2f} ms; trace: <code>{self.last.path}</code>")
