"""The JupyterLab workbench: ipywidgets panels over plotly figures (FigurePane) that rerun the
engine when a control changes and update their figures in place.

    from deepinfer.workbench import tiny_llm, BatchTuningPanel, TimelineViewer
    llm = tiny_llm()              # the embedded random-weight model, float32, CPU friendly
    BatchTuningPanel(llm)         # sliders -> latency/throughput point + step plot
    TimelineViewer(llm)           # profiler trace of N steps as lanes + idle gaps

Needs the ``workbench`` extra (jupyterlab, ipywidgets, anywidget, plotly >= 6, pandas).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepinfer.workbench.batch_tuning import BatchTuningPanel
from deepinfer.workbench.figure_pane import FigureChoice, FigurePane
from deepinfer.workbench.notebook_logging import install_notebook_logging
from deepinfer.workbench.timeline_viewer import TimelineViewer

if TYPE_CHECKING:
    from deepinfer.llm import LLM

__all__ = ["BatchTuningPanel", "FigureChoice", "FigurePane", "TimelineViewer", "notebook_llm", "tiny_llm",
           "TINY_ENGINE_KWARGS"]

install_notebook_logging()  # in a kernel: deepinfer's notices print plainly, not as red stderr

#: Engine settings that keep the tiny model quick on a laptop CPU.
TINY_ENGINE_KWARGS: dict[str, Any] = {"dtype": "float32", "max_model_len": 1024, "max_num_seqs": 16,
                                      "max_num_batched_tokens": 512}


def tiny_llm(model: str | None = None, **overrides: Any) -> LLM:
    """An ``LLM`` with :data:`TINY_ENGINE_KWARGS` (overridable); ``model=None`` is the
    embedded trained tiny model (``deepinfer-tiny``)."""
    from deepinfer.llm import LLM

    return LLM(model, **{**TINY_ENGINE_KWARGS, **overrides})


def notebook_llm(model: str | None = None, device: str | None = None, dtype: str = "float32",
                 **overrides: Any) -> LLM:
    """The engine a notebook builds from its tagged parameters cell (``MODEL``, ``DEVICE``,
    ``DTYPE``; papermill ``-p`` sets them): :data:`TINY_ENGINE_KWARGS` limits, ``device`` as
    the accelerator (``None``: what is present, so CUDA and its compiled path on a GPU)."""
    from deepinfer.llm import LLM

    kwargs = {**TINY_ENGINE_KWARGS, "dtype": dtype, **overrides}
    if device is not None:
        kwargs["accelerator"] = device
    return LLM(model, **kwargs)
