"""Profiling for the engine: phase markers, trace capture and parsing, the batch sweep.

Only the markers are imported eagerly (the engine's step loop uses them); everything
that needs pandas or plotly loads on first use:

    from deepinfer.profiling import phase, capture_trace, run_sweep
"""

from __future__ import annotations

import importlib
from typing import Any

from deepinfer.profiling.markers import PHASES, phase

__all__ = ["phase", "PHASES", "capture_trace", "parse_trace", "timeline_figure", "run_sweep",
           "prefill_chart", "decode_chart", "load_workload"]

_LAZY = {
    "capture_trace": "deepinfer.profiling.trace",
    "parse_trace": "deepinfer.profiling.timeline",
    "timeline_figure": "deepinfer.profiling.charts",
    "run_sweep": "deepinfer.profiling.sweep",
    "prefill_chart": "deepinfer.profiling.charts",
    "decode_chart": "deepinfer.profiling.charts",
    "load_workload": "deepinfer.profiling.workload",
}


def __getattr__(name: str) -> Any:
    """Import the heavier submodules (pandas, plotly) only when their names are used."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'deepinfer.profiling' has no attribute {name!r}")
