"""Expert placement workbench panel (notebooks/05_expert_placement.ipynb).

    panel = ExpertPlacementPanel(llm)   # llm = LLM(..., data_parallel_size=N, expert_parallel_size=N)
    panel.run_workload()                # record expert load (the heatmap grows)
    panel.rebalance()                   # EPLB now; before/after imbalance plotted
    panel.project(ep_size=4, redundant=8)   # what-if: static vs EPLB imbalance on the recorded load

Figures: tokens per rank per step for one layer (heatmap, rebalances marked), imbalance
(max/mean rank load) of every workload run plus each rebalance's before/after, and a
what-if bar chart driven by the EP-size and redundant-experts sliders. The placement
table shows which logical expert each slot of each rank holds (``*`` = replicated).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import ipywidgets as W
import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from deepinfer.parallel.eplb_policy import rebalance_experts
from deepinfer.parallel.placement import ExpertPlacement, imbalance, padded_num_slots, rank_loads
from deepinfer.sampling_params import SamplingParams
from deepinfer.workbench.base import Panel, slider
from deepinfer.workbench.figure_pane import FigurePane

__all__ = ["ExpertPlacementPanel", "placement_frame"]


def placement_frame(placement: ExpertPlacement, layer: int = 0) -> pd.DataFrame:
    """Ranks x local slots: the logical expert in each slot (``*`` marks replicated ones)."""
    counts = placement.replica_counts()[layer]
    rows = {f"rank {r}": [f"{e}{'*' if counts[e] > 1 else ''}" for e in placement.rank_experts(layer, r)]
            for r in range(placement.num_ranks)}
    return pd.DataFrame.from_dict(rows, orient="index", columns=[f"slot {s}" for s in range(placement.slots_per_rank)])


class ExpertPlacementPanel(Panel):
    """Heatmap, placement table, imbalance plots and EPLB controls over a multi-rank `LLM`."""

    def __init__(self, llm: Any, make_llm: Callable[[int, int], Any] | None = None, num_requests: int = 8,
                 prompt_len: int = 24, output_len: int = 8, seed: int = 0, max_ep_size: int = 8) -> None:
        super().__init__()
        self.llm, self.make_llm = llm, make_llm
        self.num_requests, self.prompt_len, self.output_len = num_requests, prompt_len, output_len
        self._rng = random.Random(seed)
        self.runs: list[dict[str, Any]] = []
        self.reports: list[Any] = []
        self._rank_steps: list[np.ndarray] = []  # per recorded step: [layers, ranks]
        self._logical_steps: list[np.ndarray] = []  # per recorded step: [layers, experts]
        self._marks: list[int] = []  # step index of each rebalance
        pl = llm.placement
        self.layer = W.Dropdown(options=list(range(pl.num_layers)), value=0, description="layer")
        self.ep_size = slider(W.IntSlider, "EP size (what-if)", pl.num_ranks, 1, max(max_ep_size, pl.num_ranks))
        self.redundant = slider(W.IntSlider, "redundant experts", pl.num_redundant, 0, 2 * pl.num_logical)
        auto = W.Layout(width="auto")  # the default button width cuts the longer labels off
        self.run_button = W.Button(description="Run workload", button_style="primary", layout=auto)
        self.rebalance_button = W.Button(description="Rebalance now", button_style="warning", layout=auto)
        self.apply_button = W.Button(description="Apply EP size / redundancy", layout=auto)
        self.status = W.HTML(value="<i>run a workload to record expert load</i>")
        self.table = W.HTML()
        # figures drawn through FigurePane (workbench/figure_pane.py says why not FigureWidget);
        # explicit margins with automargin: axis titles and long bar labels are not clipped
        margin = {"l": 70, "r": 30, "t": 60, "b": 60}
        self.heatmap = FigurePane(go.Figure(go.Heatmap(z=[[0]], colorscale="Viridis", colorbar={"title": "tokens"}),
                                            layout={"title": "tokens routed to each rank per step", "height": 320,
                                                    "xaxis_title": "step", "yaxis_title": "rank", "margin": margin}))
        self.imbalance_fig = FigurePane(go.Figure(layout={
            "title": "imbalance (max / mean rank load)", "height": 340, "barmode": "group", "margin": margin,
            "yaxis": {"title": "max / mean", "automargin": True}, "xaxis": {"automargin": True},
            "legend": {"orientation": "h", "y": -0.25}}), width="50%")
        self.imbalance_fig.figure.add_scatter(name="measured per run", mode="lines+markers")
        self.imbalance_fig.figure.add_bar(name="rebalance: before")
        self.imbalance_fig.figure.add_bar(name="rebalance: after")
        self.whatif_fig = FigurePane(go.Figure(go.Bar(x=["static (default)", "EPLB"], y=[0, 0]), layout={
            "title": "what-if on the recorded load", "height": 340, "margin": margin,
            "yaxis": {"title": "max / mean", "automargin": True}, "xaxis": {"automargin": True}}), width="50%")
        self.run_button.on_click(lambda _: self.run_workload())
        self.rebalance_button.on_click(lambda _: self.rebalance())
        self.apply_button.on_click(lambda _: self.apply())
        self.layer.observe(lambda _: self._redraw(), names="value")
        self.observe_controls([self.ep_size, self.redundant])
        controls = W.VBox([self.layer, self.ep_size, self.redundant,
                           W.HBox([self.run_button, self.rebalance_button, self.apply_button]), self.status])
        self.widget = W.VBox([W.HBox([controls, self.table]), self.heatmap.widget,
                              W.HBox([self.imbalance_fig.widget, self.whatif_fig.widget])])
        self._redraw()

    # ---- actions -----------------------------------------------------------------------
    def run_workload(self, num_requests: int | None = None) -> dict[str, Any]:
        """Generate a batch of random prompts and record the expert load of its steps."""
        vocab = self.llm.model_config.vocab_size
        n = num_requests or self.num_requests
        prompts = [[self._rng.randrange(vocab) for _ in range(self.prompt_len)] for _ in range(n)]
        params = SamplingParams(temperature=0, max_tokens=self.output_len, ignore_eos=True)
        before = self.llm.expert_load()["total_steps"]
        outs = self.llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        load = self.llm.expert_load()
        steps = min(load["total_steps"] - before, load["rank"].shape[0])
        rank, logical = load["rank"][-steps:], load["logical"][-steps:]
        self._rank_steps.extend(rank)
        self._logical_steps.extend(logical)
        row = {"run": len(self.runs), "steps": steps, "tokens": sum(len(o.token_ids) for o in outs),
               "imbalance": float(imbalance(rank).mean()) if steps else 1.0, "ranks": rank.shape[-1]}
        self.runs.append(row)
        self.status.value = f"run {row['run']}: {steps} steps, imbalance {row['imbalance']:.3f}"
        self._redraw()
        return row

    def rebalance(self) -> Any:
        """EPLB now. With the redundant slider at the engine's slot count this is
        ``llm.rebalance()``; otherwise the policy runs here for the new slot count and
        the result is set as a placement (weights move in place either way)."""
        pl = self.llm.placement
        slots = padded_num_slots(pl.num_logical, self.redundant.value, pl.num_ranks)
        if slots == pl.num_slots:
            report = self.llm.rebalance()
        else:
            if not self._logical_steps:
                raise RuntimeError("no recorded load yet: run a workload first")
            phy2log = rebalance_experts(np.stack(self._logical_steps), pl.num_ranks, slots)
            report = self.llm.set_placement(ExpertPlacement(torch.as_tensor(phy2log), pl.num_ranks, pl.num_logical))
        self.reports.append(report)
        self._marks.append(len(self._rank_steps))
        self.status.value = (f"rebalanced: {report.imbalance_before:.3f} -> {report.imbalance_after:.3f} predicted, "
                             f"{report.experts_moved} expert copies moved in {report.seconds:.2f} s")
        self._redraw()
        return report

    def set_placement(self, placement: ExpertPlacement) -> Any:
        """Adopt a hand-made placement (see `ExpertPlacement.from_rank_lists`)."""
        report = self.llm.set_placement(placement)
        self.reports.append(report)
        self._marks.append(len(self._rank_steps))
        self._redraw()
        return report

    def apply(self) -> None:
        """Apply the sliders: a new EP size rebuilds the engine through ``make_llm``
        (ranks restart; the recorded history is kept for what-ifs); a new redundant slot
        count alone rebalances live."""
        if self.ep_size.value != self.llm.placement.num_ranks:
            if self.make_llm is None:
                self.status.value = "<b>pass make_llm(ep_size, redundant) to change the EP size</b>"
                return
            self.llm.shutdown()
            self.llm = self.make_llm(self.ep_size.value, self.redundant.value)
            self._rank_steps, self._marks = [], []
            self.status.value = f"engine restarted with {self.ep_size.value} ranks"
            self._redraw()
        else:
            self.rebalance()

    def project(self, ep_size: int | None = None, redundant: int | None = None) -> dict[str, float]:
        """Imbalance the recorded logical load would have under the default placement and
        under EPLB, for ``ep_size`` ranks and ``redundant`` extra slots (no engine change)."""
        self.set_controls({k: v for k, v in (("ep_size", ep_size), ("redundant", redundant)) if v is not None})
        n, r = self.ep_size.value, self.redundant.value
        if not self._logical_steps:
            return {"static": 1.0, "eplb": 1.0}
        load = np.stack(self._logical_steps)
        num_layers, num_logical = load.shape[1], load.shape[2]
        static = ExpertPlacement.default(num_layers, num_logical, n, r)
        slots = padded_num_slots(num_logical, r, n)
        eplb = ExpertPlacement(torch.as_tensor(rebalance_experts(load, n, slots)), n, num_logical)
        out = {"static": float(imbalance(rank_loads(load, static)).mean()),
               "eplb": float(imbalance(rank_loads(load, eplb)).mean())}
        with self.whatif_fig.batch_update():
            self.whatif_fig.data[0].y = [out["static"], out["eplb"]]
            self.whatif_fig.layout.title = f"what-if: {n} ranks, {r} redundant slots"
        return out

    refresh = project

    # ---- views -------------------------------------------------------------------------
    @property
    def df(self) -> pd.DataFrame:
        """One row per workload run (steps, tokens, measured imbalance)."""
        return pd.DataFrame(self.runs)

    def _redraw(self) -> None:
        layer = self.layer.value
        pl = self.llm.placement
        self.table.value = (f"<b>placement, layer {layer}</b> ({pl.num_logical} experts, {pl.num_slots} slots)"
                            + placement_frame(pl, layer).to_html())
        with self.heatmap.batch_update():
            if self._rank_steps:
                z = np.stack(self._rank_steps)[:, layer, :].T
                self.heatmap.data[0].z = z
                self.heatmap.data[0].x = list(range(z.shape[1]))
                self.heatmap.data[0].y = [f"rank {r}" for r in range(z.shape[0])]
            self.heatmap.layout.shapes = [{"type": "line", "x0": m - 0.5, "x1": m - 0.5, "y0": 0, "y1": 1,
                                           "yref": "paper", "line": {"color": "red", "dash": "dash"}}
                                          for m in self._marks]
        with self.imbalance_fig.batch_update():
            self.imbalance_fig.data[0].x = [f"run {r['run']}" for r in self.runs]
            self.imbalance_fig.data[0].y = [r["imbalance"] for r in self.runs]
            labels = [f"rebalance {i}" for i in range(len(self.reports))]
            self.imbalance_fig.data[1].x, self.imbalance_fig.data[2].x = labels, labels
            self.imbalance_fig.data[1].y = [r.imbalance_before for r in self.reports]
            self.imbalance_fig.data[2].y = [r.imbalance_after for r in self.reports]
        self.project()
