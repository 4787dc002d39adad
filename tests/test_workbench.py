"""Workbench panels: controls rerun the engine and redraw their figures in place; runs from
controls go through a coalescing queue with progress and cancel; no FigureWidget (and so no
plotly.js bundle) in any panel's widget state."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import ipywidgets as W
import plotly.graph_objects as go
import pytest

from deepinfer.workbench import TINY_ENGINE_KWARGS, BatchTuningPanel, TimelineViewer
from deepinfer.workbench.figure_pane import PLOTLY_MIME, FigurePane
from deepinfer.workbench.run_queue import RunQueue


@pytest.fixture(scope="module")
def tiny_llm():
    from deepinfer.workbench import tiny_llm as make

    return make(max_num_seqs=4, max_num_batched_tokens=256)


def _widgets(w: W.Widget) -> list[W.Widget]:
    out, todo = [], [w]
    while todo:
        x = todo.pop()
        out.append(x)
        todo.extend(getattr(x, "children", ()))
    return out


def _drawn(pane: FigurePane) -> dict:
    """What the browser receives for ``pane``: the one plotly output of its Output widget."""
    (output,) = pane.widget.outputs
    return output["data"][PLOTLY_MIME]


def test_tiny_llm_settings(tiny_llm) -> None:
    assert TINY_ENGINE_KWARGS["dtype"] == "float32"
    assert tiny_llm.config.max_model_len == 1024 and tiny_llm.kv_manager.max_num_seqs == 4


def test_figure_pane_sends_the_current_figure_as_plotly_json() -> None:
    pane = FigurePane(go.Figure(go.Bar(x=[1, 2], y=[3, 4]), layout={"height": 300}))
    assert _drawn(pane)["data"][0]["y"] == [3, 4] and _drawn(pane)["layout"]["height"] == 300
    with pane.batch_update():
        pane.data[0].y = [5, 6]
    assert _drawn(pane)["data"][0]["y"] == [5, 6]
    fig = pane.figure
    pane.show(go.Figure([go.Scatter(y=[1]), go.Scatter(y=[2])]))
    assert pane.figure is fig and [d["y"] for d in _drawn(pane)["data"]] == [[1], [2]]


def test_panels_hold_no_figure_widget_and_their_state_is_small(tiny_llm, tmp_path) -> None:
    """A FigureWidget's state carries plotly.js (~5 MB per widget in every saved notebook),
    and one changed before display draws a 0 px plot in JupyterLab (03's viewer)."""
    panel = BatchTuningPanel(tiny_llm, num_requests=2, output_len=2)
    panel.run()
    viewer = TimelineViewer(tiny_llm, num_requests=2, num_steps=1, output_len=2, out_dir=str(tmp_path))
    for p in (panel, viewer):
        tree = _widgets(p.widget)
        assert not any(isinstance(w, go.FigureWidget) for w in tree)
        state = json.dumps(W.Widget.get_manager_state(widgets=tree))
        assert len(state) < 400_000, len(state)
    # captured before any display: the viewer's output already holds the drawn timeline
    lanes = {y for d in _drawn(viewer.figure)["data"] for y in d.get("y", [])}
    assert {"model", "sampling"} <= lanes, lanes


def test_batch_panel_slider_change_reruns_and_updates_figures_in_place(tiny_llm) -> None:
    panel = BatchTuningPanel(tiny_llm, num_requests=3, output_len=3)
    curve, steps = panel.curve, panel.steps
    assert isinstance(curve, FigurePane) and len(curve.data[0].x) == 0
    row = panel.run()
    assert row["num_finished"] == 3 and row["output_tok_s"] > 0 and row["max_num_seqs"] == 4
    panel.max_num_seqs.value = 1  # what a user's slider move does: a run on the panel's queue
    panel.wait(60)
    assert not panel.queue.errors and panel.queue.completed == 1 and panel.queue.progress.value == 1.0
    assert len(panel.history) == 2 and panel.history[-1]["max_num_seqs"] == 1
    assert panel.curve is curve and len(curve.data[0].x) == 2 == len(_drawn(curve)["data"][0]["x"])
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


def test_rapid_slider_changes_coalesce_and_cancel_stops_the_run(tiny_llm) -> None:
    panel = BatchTuningPanel(tiny_llm, num_requests=4, output_len=40)
    started = threading.Event()
    gate = threading.Event()

    def slow() -> None:  # holds the worker so the next events have to wait
        started.set()
        gate.wait(30)

    panel.queue.submit(slow)
    assert started.wait(10)
    for n in (1, 2, 3, 4):  # four quick slider moves while the worker is busy
        panel.max_num_seqs.value = n
    assert panel.queue.superseded == 3 and "queued" in panel.queue.info.value
    gate.set()
    panel.wait(60)
    assert [r["max_num_seqs"] for r in panel.history] == [4]  # only the newest settings ran
    # Cancel: stops the run at its next step and leaves the engine serving
    seen = threading.Event()
    tiny_llm.metrics.step_hooks.append(seen.set)
    try:
        panel.num_requests.value = 16
        assert seen.wait(30)
        panel.queue.cancel()
        panel.wait(60)
    finally:
        tiny_llm.metrics.step_hooks.remove(seen.set)
    assert panel.queue.cancelled == 1 and "cancelled" in panel.queue.info.value and len(panel.history) == 1
    assert not tiny_llm.scheduler.has_unfinished()
    assert panel.run(num_requests=1, output_len=2)["num_finished"] == 1


def test_run_queue_reports_progress_estimate_and_errors() -> None:
    q = RunQueue("probe")

    def work() -> None:
        for i in range(1, 5):
            time.sleep(0.01)
            q.check(i, 4)
            assert q.progress.value == pytest.approx(i / 4)

    q.submit(work)
    q.wait(10)
    assert q.completed == 1 and "done" in q.info.value
    q.check(1, 2)
    assert "s left" in q.info.value and "50%" in q.info.value
    q.submit(lambda: 1 / 0)
    q.wait(10)
    assert isinstance(q.errors[-1], ZeroDivisionError) and "ZeroDivisionError" in q.info.value
    def cancelled_by_hand() -> None:
        q._cancel.set()  # what the Cancel button does while this run executes
        q.check(1, 2)

    q.submit(cancelled_by_hand)
    q.wait(10)
    assert q.cancelled == 1 and len(q.errors) == 1
    q.check(1, 2)  # from code (not the worker) nothing is cancelled


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
    viewer.num_steps.value = 3  # recapture (on the viewer's queue)
    viewer.wait(60)
    assert not viewer.queue.errors
    assert viewer.last is not first and len(viewer.last.steps) == 3
    assert "<table" in viewer.table.value and "gap_ms" in viewer.table.value


def test_notices_go_to_stdout_and_errors_to_stderr(capsys) -> None:
    """In a notebook stderr renders as an error: a harmless notice must not land there."""
    import logging

    from deepinfer.workbench.notebook_logging import NotebookLogHandler, install_notebook_logging

    assert install_notebook_logging("deepinfer.test-outside-kernel") is None  # pytest is not a kernel
    handler = install_notebook_logging("deepinfer.test-notebook", force=True)
    assert isinstance(handler, NotebookLogHandler)
    assert install_notebook_logging("deepinfer.test-notebook", force=True) is handler  # once
    log = logging.getLogger("deepinfer.test-notebook")
    try:
        log.warning("no tokenizer.json in %s; using the bundled one", "/ckpt")
        log.error("a real failure")
        out = capsys.readouterr()
        assert out.out == "deepinfer.test-notebook [WARNING] no tokenizer.json in /ckpt; using the bundled one\n"
        assert out.err == "deepinfer.test-notebook [ERROR] a real failure\n"
    finally:
        log.removeHandler(handler)


NOTEBOOKS = sorted(p for p in (Path(__file__).resolve().parents[1] / "notebooks").glob("0[1-8]_*.ipynb")
                   if not p.name.startswith("04_"))  # 04 belongs to the speculative decoding issue


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_have_one_tagged_parameters_cell(path: Path) -> None:
    """papermill's convention: MODEL / DEVICE / DTYPE / WORKLOAD set in one tagged cell, used later."""
    import nbformat

    from deepinfer.workbench.execute import parameter_names

    nb = nbformat.read(path, as_version=4)
    names = parameter_names(nb)
    assert {"MODEL", "DEVICE", "DTYPE", "WORKLOAD"} <= set(names), names
    later = "\n".join(c.source for c in nb.cells if c.cell_type == "code" and "parameters" not in c.metadata.get("tags", []))
    for name in ("MODEL", "DEVICE", "DTYPE"):
        assert re.search(rf"\b{name}\b", later), f"{path.name}: {name} is never used"
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), "committed without outputs"


def test_run_notebook_injects_parameters_after_the_tagged_cell(tmp_path: Path) -> None:
    import nbformat

    from deepinfer.workbench.execute import inject_parameters, run_notebook

    params = nbformat.v4.new_code_cell('MODEL = None\nDTYPE = "float32"')
    params.metadata["tags"] = ["parameters"]
    nb = nbformat.v4.new_notebook(cells=[params, nbformat.v4.new_code_cell(
        'import os\nassert DTYPE == "bfloat16" and MODEL == "/ckpt", (DTYPE, MODEL)\nprint("ran in", os.path.basename(os.getcwd()))')])
    path = tmp_path / "nbdir" / "probe.ipynb"
    path.parent.mkdir()
    nbformat.write(nb, path)
    with pytest.raises(ValueError, match=r"unknown notebook parameter\(s\) \['WORKLOAD'\]"):
        inject_parameters(nb, {"WORKLOAD": "x"})
    bad = run_notebook(path, {"DTYPE": "float16"}, out_path=tmp_path / "bad.ipynb")
    assert not bad.ok and "AssertionError" in bad.error and (tmp_path / "bad.ipynb").exists()
    good = run_notebook(path, {"MODEL": "/ckpt", "DTYPE": "bfloat16"}, out_path=tmp_path / "out.ipynb")
    assert good.ok and good.cells == 3, good.error
    executed = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    assert executed.cells[1].metadata["tags"] == ["injected-parameters"]
    assert executed.cells[2].outputs[0]["text"] == "ran in nbdir\n"
