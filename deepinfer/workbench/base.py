"""Plumbing shared by the workbench panels: sliders, setting controls from code without
re-triggering the panel, runs from widget events on a :class:`RunQueue`, and notebook display."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ipywidgets as W

from deepinfer.workbench.run_queue import RunQueue

__all__ = ["DESCRIPTION_WIDTH", "Panel", "slider"]

#: Wide enough for the longest control name ("max_num_batched_tokens", "merge device ops < us")
#: in JupyterLab's 13 px UI font: narrower cut names off with an ellipsis.
DESCRIPTION_WIDTH = "210px"


def slider(cls: type, description: str, value: Any, lo: Any, hi: Any, step: Any = 1) -> W.Widget:
    """An Int/FloatSlider that reports only when released (``continuous_update=False``)."""
    return cls(value=value, min=lo, max=hi, step=step, description=description, continuous_update=False,
               tooltip=description,
               style={"description_width": DESCRIPTION_WIDTH}, layout=W.Layout(width="540px"))


class Panel:
    """A panel owns ``widget`` and reruns :meth:`refresh` when an observed control changes."""

    widget: W.Widget

    def __init__(self, queue: RunQueue | None = None) -> None:
        """``queue``: where runs started by a control change go (see :class:`RunQueue`);
        ``None`` runs them inside the widget callback."""
        self._quiet = False  # True while code (not the user) moves controls
        self.queue = queue

    def refresh(self) -> Any:
        """Rerun whatever the panel shows; subclasses implement it."""
        raise NotImplementedError

    def set_controls(self, values: Mapping[str, Any]) -> None:
        """Set controls by attribute name without triggering :meth:`refresh` for each."""
        self._quiet = True
        try:
            for key, val in values.items():
                getattr(self, key).value = val
        finally:
            self._quiet = False

    def observe_controls(self, controls: list[W.Widget]) -> None:
        """Rerun the panel whenever one of ``controls`` changes value."""
        for w in controls:
            w.observe(self._on_change, names="value")

    def wait(self, timeout: float | None = None) -> None:
        """Block until runs started from the controls have finished (no-op without a queue)."""
        if self.queue is not None:
            self.queue.wait(timeout)

    def _on_change(self, change: dict[str, Any]) -> None:
        if self._quiet:
            return
        if self.queue is not None:
            self.queue.submit(self.refresh)
        else:
            self.refresh()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
