"""A plotly figure inside an ipywidgets panel, without a plotly FigureWidget.

Why not ``go.FigureWidget``: with plotly 6 it is an anywidget whose state carries the whole
plotly.js bundle (about 5 MB), so every saved or executed notebook holds one copy per
widget; and a FigureWidget changed before the browser displays it replays its pending
edits onto a plot that does not exist yet (``Cannot use 'in' operator to search for
'line' in undefined`` in JupyterLab, a 0 px plot). A :class:`FigurePane` instead keeps a
plain ``go.Figure`` on the Python side and shows it through an ``ipywidgets.Output``
holding one ``application/vnd.plotly.v1+json`` output: JupyterLab's plotly renderer
draws it whenever the view appears, and a saved notebook holds only the figure's JSON.

    pane = FigurePane(go.Figure(go.Bar(y=[1, 2])))
    W.VBox([slider, pane.widget])
    with pane.batch_update():         # edit in place; redrawn once at the end
        pane.data[0].y = [3, 4]
    pane.show(other_figure)           # or take another figure's traces and layout
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import ipywidgets as W
import plotly.graph_objects as go
import plotly.io as pio

from deepinfer.profiling.charts import refresh_figure

__all__ = ["FigureChoice", "FigurePane", "PLOTLY_MIME", "figure_output"]

PLOTLY_MIME = "application/vnd.plotly.v1+json"


def figure_output(fig: go.Figure) -> dict[str, Any]:
    """``fig`` as one notebook ``display_data`` output (what plotly's mimetype renderer sends)."""
    body = json.loads(pio.to_json(fig, validate=False))
    body.setdefault("config", {})["displaylogo"] = False
    return {"output_type": "display_data", "data": {PLOTLY_MIME: body, "text/plain": repr(fig.layout.title.text)},
            "metadata": {}}


class FigurePane:
    """A ``go.Figure`` (``figure``) shown in an ``ipywidgets.Output`` (``widget``)."""

    def __init__(self, figure: go.Figure | None = None, width: str | None = None) -> None:
        """``width``: a CSS width for the pane (e.g. ``"50%"`` side by side in an HBox);
        the figure's own ``layout.height`` sets the height."""
        self.figure = go.Figure(figure) if figure is not None else go.Figure()
        layout: dict[str, str] = {"width": width} if width else {}
        self.widget = W.Output(layout=W.Layout(**layout))
        self.render()

    @property
    def data(self) -> tuple:
        """The figure's traces (edit them inside :meth:`batch_update`)."""
        return self.figure.data

    @property
    def layout(self) -> go.Layout:
        """The figure's layout (edit it inside :meth:`batch_update`)."""
        return self.figure.layout

    @contextmanager
    def batch_update(self) -> Iterator[go.Figure]:
        """Edit ``figure`` in the block; the pane redraws once when it ends."""
        try:
            yield self.figure
        finally:
            self.render()

    def show(self, new: go.Figure) -> None:
        """Take ``new``'s traces and layout (the same object stays in ``figure``) and redraw."""
        refresh_figure(self.figure, new)
        self.render()

    def render(self) -> None:
        """Send the current figure to the browser (replacing the previous drawing)."""
        self.widget.outputs = (figure_output(self.figure),)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


class FigureChoice:
    """A control picking which figure a :class:`FigurePane` shows: ``build(option)`` makes
    the figure for the chosen option (toggle buttons, or a dropdown with ``dropdown=True``).

        choice = FigureChoice(["ttft_s", "tpot_s"], lambda col: go.Figure(go.Bar(y=df[col])))
        choice                        # displays the control above the figure
    """

    def __init__(self, options: list[str], build: Callable[[str], go.Figure], description: str = "",
                 value: str | None = None, dropdown: bool = False) -> None:
        if not options:
            raise ValueError("FigureChoice needs at least one option")
        cls = W.Dropdown if dropdown else W.ToggleButtons
        self.build = build
        self.control = cls(options=list(options), value=value if value is not None else options[0],
                           description=description, style={"description_width": "initial"})
        self.pane = FigurePane(build(self.control.value))
        self.control.observe(lambda change: self.pane.show(self.build(change["new"])), names="value")
        self.widget = W.VBox([self.control, self.pane.widget])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
