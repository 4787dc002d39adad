"""Run a workbench notebook unchanged with other parameters (papermill's convention, done
here with nbclient so nothing else needs installing): the code cell tagged ``parameters``
keeps its defaults and a cell tagged ``injected-parameters`` right after it assigns the
given values, then every cell runs top to bottom in a fresh kernel.

    result = run_notebook("notebooks/02_batch_tuning.ipynb", {"MODEL": "/ckpt/mini", "DTYPE": "bfloat16"},
                          out_path="out/02.ipynb")
    result.ok, result.wall_s, result.error

The executed notebook keeps its outputs (plotly figures as JSON, no widget bundle: the
workbench draws through :class:`~deepinfer.workbench.figure_pane.FigurePane`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat

__all__ = ["NotebookRun", "inject_parameters", "parameter_names", "run_notebook"]

PARAMETERS_TAG = "parameters"
INJECTED_TAG = "injected-parameters"


def _parameters_cell(nb: nbformat.NotebookNode) -> int:
    hits = [i for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and PARAMETERS_TAG in c.get("metadata", {}).get("tags", [])]
    if len(hits) != 1:
        raise ValueError(f"the notebook has {len(hits)} code cells tagged {PARAMETERS_TAG!r}; it needs exactly one")
    return hits[0]


def parameter_names(nb: nbformat.NotebookNode) -> list[str]:
    """Names the tagged parameters cell assigns at top level (``NAME = ...``)."""
    import ast

    tree = ast.parse(nb.cells[_parameters_cell(nb)].source)
    return [t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)]


def inject_parameters(nb: nbformat.NotebookNode, params: dict[str, Any]) -> nbformat.NotebookNode:
    """A copy of ``nb`` with an ``injected-parameters`` cell after its parameters cell.
    Values must be Python literals (``repr`` round-trips); unknown names are an error."""
    import ast

    known = parameter_names(nb)
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(f"unknown notebook parameter(s) {unknown}; the parameters cell defines {known}")
    lines = ["# Parameters (injected)"]
    for name, value in params.items():
        text = repr(value)
        ast.literal_eval(text)  # a value that does not read back as a literal would run as code
        lines.append(f"{name} = {text}")
    out = nbformat.from_dict(nb)
    cell = nbformat.v4.new_code_cell("\n".join(lines))
    cell.metadata["tags"] = [INJECTED_TAG]
    out.cells.insert(_parameters_cell(out) + 1, cell)
    return out


@dataclass
class NotebookRun:
    """What one :func:`run_notebook` did."""

    path: str
    out_path: str | None
    params: dict[str, Any]
    ok: bool
    wall_s: float
    error: str | None
    cells: int


def run_notebook(path: str | os.PathLike[str], params: dict[str, Any] | None = None,
                 out_path: str | os.PathLike[str] | None = None, timeout_s: int = 1800,
                 kernel_name: str = "python3") -> NotebookRun:
    """Execute ``path`` with ``params`` injected, in its own folder (as JupyterLab does);
    write the executed notebook to ``out_path`` when given (also when a cell fails)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    src = Path(path)
    nb = nbformat.read(src, as_version=4)
    if params:  # a notebook without a parameters cell runs as it is
        nb = inject_parameters(nb, params)
    client = NotebookClient(nb, timeout=timeout_s, kernel_name=kernel_name,
                            resources={"metadata": {"path": str(src.resolve().parent)}})
    t0, error = time.perf_counter(), None
    try:
        client.execute()
    except CellExecutionError as e:
        error = str(e)[-4000:]
    wall = time.perf_counter() - t0
    if out_path is not None:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out_path)
    return NotebookRun(str(src), None if out_path is None else str(out_path), dict(params or {}), error is None,
                       wall, error, sum(c.cell_type == "code" for c in nb.cells))
