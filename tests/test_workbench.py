"""Workbench panels: controls rerun the engine and update FigureWidgets in place."""

from __future__ import annotations

import plotly.graph_objects as go
import pytest

from deepinfer.workbench import TINY_ENGINE_KWARGS, BatchTuningPanel, TimelineViewer


@pytest.fixture(scope="module")
def tiny_llm():
    from deepinfer.workbench import tiny_llm as make

    return make(max_num_seqs=4, max_num_batched_tokens=256)


def test_tiny_llm_settings(tiny_llm) -> None:
    assert TINY_ENGINE_KWARGS["dtype"] == "float32"
    assert tiny_llm.config.max_model_len == 1024 and tiny_llm.kv_manager.max_num_seqs == 4


def test_batch_panel_slider_change_reruns_and_updates_figures_in_place(tiny_llm) -> None:
    panel = BatchTuningPanel(tiny_llm, num_requests=3, output_len=3)
    curve, steps = panel.curve, panel.steps
    assert isinstance(curve, go.FigureWidget) and len(curve.data[0].x) == 0
    row = panel.run()
    assert row["num_finished"] == 3 and row["output_tok_s"] > 0 and row["max_num_seqs"] == 4
    panel.max_num_seqs.value = 1  # what a user's slider move does
    assert len(panel.history) == 2 and panel.history[-1]["max_num_seqs"] == 1
    assert panel.curve is curve and len(curve.data[0].x) == 2  # same widget, new point
    assert panel.steps is steps and len(steps.data[0].x) == len(tiny_llm.metrics.steps_df()) > 0
    assert tiny_llm.scheduler.config.max_num_seqs == 1
    panel.latency.value = "mean_ttft_ms"
    assert list(curve.data[0].y) == pytest.approx(panel.df["mean_ttft_ms"].tolist())
    df = panel.sweep((1, 2, 8))  # 8 > state slots: skipped
    assert df["max_num_seqs"].tolist() == [1, 2] and len(curve.data[0].x) == 2
    panel.run(num_requests=2, output_len=2)  # sets the sliders without extra runs
    assert len(panel.history) == 3 and panel.num_requests.value == 2 and panel.history[-1]["num_requests"] == 2
    panel.clear()
    assert len(curve.data[0].x) == 0


def test_timeline_viewer_recaptures_on_batch_change_and_redraws_on_merge(tiny_llm, tmp_path) -> None:
    viewer = TimelineViewer(tiny_llm, num_requests=2, num_steps=2, output_len=3, out_dir=str(tmp_path))
    first = viewer.last
    assert first is not None and len(first.steps) == 2 and "steps traced" in viewer.status.value
    fig = viewer.figure
    device = {t.name: t for t in fig.data}["device"]
    n_bars = len(device.x)
    viewer.merge_us.value = 5000.0  # redraw only
    assert viewer.last is first and viewer.figure is fig
    assert 0 < len({t.name: t for t in fig.data}["device"].x) < n_bars
    viewer.num_steps.value = 3  # recapture
    assert viewer.last is not first and len(viewer.last.steps) == 3
    assert "<table" in viewer.table.value and "gap_ms" in viewer.table.value
