"""Batch-tuning panel: sliders for the scheduler limits and the workload, rerunning the
engine on every change and updating the latency/throughput and step plots in place.

    panel = BatchTuningPanel(llm)      # in a notebook cell; the last expression displays it
    panel
    panel.run(max_num_seqs=4)          # the same from code; returns the new point's row
    panel.sweep((1, 2, 4, 8))          # one point per max_num_seqs, replacing the curve

A slider move runs on the panel's :class:`~deepinfer.workbench.run_queue.RunQueue` (off
the kernel's message loop, newest settings only, progress / estimate / cancel);
``panel.wait()`` blocks until it is done. Every run can be saved to a run store.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ipywidgets as W
import pandas as pd
from tqdm.auto import tqdm

from deepinfer.profiling.charts import latency_throughput_chart, steps_figure
from deepinfer.profiling.sweep import SweepSpec, measure_workload, set_batch_limits
from deepinfer.profiling.workload import DEFAULT_WORKLOAD, load_workload, scale_workload
from deepinfer.workbench.base import Panel, slider
from deepinfer.workbench.figure_pane import FigurePane
from deepinfer.workbench.run_queue import RunQueue
from deepinfer.workbench.run_store import RunStore

if TYPE_CHECKING:
    from deepinfer.llm import LLM

__all__ = ["BatchTuningPanel"]

LATENCIES = ("mean_tpot_ms", "p90_tpot_ms", "mean_ttft_ms", "p90_ttft_ms", "mean_itl_ms", "p99_itl_ms")


class BatchTuningPanel(Panel):
    """Controls -> closed-loop workload run on ``llm`` -> one more latency/throughput point."""

    def __init__(self, llm: LLM, workload: str = DEFAULT_WORKLOAD, num_requests: int = 8, output_len: int = 8,
                 prompt_scale: float = 1.0, run_on_change: bool = True, store: RunStore | None = None) -> None:
        """``store``: every run is saved there (metadata, workload, the engine's request /
        step / ITL tables; ``history`` rows get its ``run_id``)."""
        super().__init__(RunQueue("workload run"))
        self.llm, self.store, self.workload_name = llm, store, workload
        self.workload = load_workload(workload)
        self.history: list[dict[str, Any]] = []
        cfg, slots = llm.config, llm.kv_manager.max_num_seqs
        self.max_num_seqs = slider(W.IntSlider, "max_num_seqs", min(cfg.max_num_seqs, slots), 1, slots, 1)
        self.max_num_batched_tokens = slider(W.IntSlider, "max_num_batched_tokens", cfg.max_num_batched_tokens,
                                             16, max(cfg.max_num_batched_tokens, 2048), 16)
        self.num_requests = slider(W.IntSlider, "requests", num_requests, 1, 64, 1)
        self.output_len = slider(W.IntSlider, "output tokens", output_len, 1, 64, 1)
        self.prompt_scale = slider(W.FloatSlider, "prompt length x", prompt_scale, 0.25, 4.0, 0.25)
        self.latency = W.Dropdown(options=LATENCIES, value="mean_tpot_ms", description="latency")
        self.run_button = W.Button(description="Run", button_style="primary")
        self.clear_button = W.Button(description="Clear curve")
        self.status = W.HTML(value="<i>move a slider or press Run</i>")
        self.curve = FigurePane(latency_throughput_chart(pd.DataFrame()), width="50%")
        self.steps = FigurePane(steps_figure(pd.DataFrame()), width="50%")
        self.run_button.on_click(lambda _: self.queue.submit(self.run))
        self.clear_button.on_click(lambda _: self.clear())
        self.latency.observe(lambda _: self._redraw_curve(), names="value")
        if run_on_change:
            self.observe_controls(self.controls)
        self.widget = W.VBox([W.HBox([W.VBox(self.controls + [self.latency]),
                                      W.VBox([self.run_button, self.clear_button, self.status])]),
                              self.queue.widget, W.HBox([self.curve.widget, self.steps.widget])])

    @property
    def controls(self) -> list[W.Widget]:
        """The sliders whose change reruns the engine."""
        return [self.max_num_seqs, self.max_num_batched_tokens, self.num_requests, self.output_len,
                self.prompt_scale]

    @property
    def df(self) -> pd.DataFrame:
        """Every point run so far (one row per run, same columns as the sweep's workload rows)."""
        return pd.DataFrame(self.history)

    def run(self, **values: Any) -> dict[str, Any]:
        """Run the workload with the current control values (``values`` set controls first,
        without triggering extra runs) and add the point to the curve. From code (not the
        queue's worker) it first waits for runs the controls started."""
        if threading.current_thread() is not self.queue.thread:
            self.wait()
        self.set_controls(values)
        set_batch_limits(self.llm, self.max_num_seqs.value, self.max_num_batched_tokens.value)
        reqs = scale_workload(self.workload, self.num_requests.value, prompt_scale=self.prompt_scale.value,
                              output_len=self.output_len.value, max_len=self.llm.config.max_model_len)
        self.status.value = "<i>running...</i>"
        total = sum(r.output_len for r in reqs)
        emitted = [0]

        def progress() -> None:  # an engine step hook: the bar, the estimate and Cancel
            last = self.llm.metrics.last_step()
            emitted[0] += last["output_tokens"] if last else 0
            self.queue.check(emitted[0], total)

        self.llm.metrics.step_hooks.append(progress)
        try:
            row = measure_workload(self.llm, reqs, self.max_num_seqs.value,
                                   SweepSpec(num_workload_requests=len(reqs)), seed=len(self.history))
        except Exception as e:
            self.status.value = f"<b>run failed:</b> {type(e).__name__}: {e}"
            raise
        finally:
            self.llm.metrics.step_hooks.remove(progress)
        row["prompt_scale"] = self.prompt_scale.value
        if self.store is not None:
            settings = {k: row[k] for k in ("max_num_seqs", "max_num_batched_tokens", "num_requests")}
            saved = self.store.save_llm(self.llm, "panel", " ".join(f"{k}={v}" for k, v in settings.items()),
                                        workload={"file": self.workload_name, "num_requests": len(reqs),
                                                  "output_len": self.output_len.value,
                                                  "prompt_scale": self.prompt_scale.value}, point=row)
            row["run_id"] = saved.id
        self.history.append(row)
        self.steps.show(steps_figure(self.llm.metrics.steps_df()))
        self._redraw_curve()
        self.status.value = (f"{row['num_finished']}/{row['num_requests']} finished, "
                             f"{row['output_tok_s']:.1f} out tok/s, TTFT {row['mean_ttft_ms']:.1f} ms, "
                             f"TPOT {row['mean_tpot_ms']:.1f} ms")
        return row

    refresh = run

    def sweep(self, max_num_seqs: Sequence[int] = (1, 2, 4, 8)) -> pd.DataFrame:
        """Clear the curve and run one point per ``max_num_seqs`` value (other controls fixed)."""
        self.clear()
        slots = self.llm.kv_manager.max_num_seqs
        for n in tqdm([n for n in max_num_seqs if n <= slots], desc="sweep max_num_seqs"):
            self.run(max_num_seqs=n)
        return self.df

    def clear(self) -> None:
        """Forget the points and empty the curve."""
        self.history.clear()
        self._redraw_curve()

    def _redraw_curve(self) -> None:
        self.curve.show(latency_throughput_chart(self.df, latency=self.latency.value))
