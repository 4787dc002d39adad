"""Plumbing shared by the workbench panels: sliders, setting controls from code without
re-triggering the panel, and notebook display."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ipywidgets as W

__all__ = ["Panel", "slider"]


def slider(cls: type, description: str, value: Any, lo: Any, hi: Any, step: Any = 1) -> W.Widget:
    """An Int/FloatSlider that reports only when released (``continuous_update=False``)."""
    return cls(value=value, min=lo, max=hi, step=step, description=description, continuous_update=False,
               style={"description_width": "170px"}, layout=W.Layout(width="470px"))


class Panel:
    """A panel owns ``widget`` and reruns :meth:`refresh` when an observed control changes."""

    widget: W.Widget

    def __init__(self) -> None:
        self._quiet = False  # True while code (not the user) moves controls

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

    def _on_change(self, change: dict[str, Any]) -> None:
        if not self._quiet:
            self.refresh()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
