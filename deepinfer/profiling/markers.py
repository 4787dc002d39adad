"""Engine phase markers: one ``with phase(NAME):`` opens a torch profiler range AND an
NVTX range, so the same phases show up in torch traces (Perfetto) and in Nsight Systems.

NVTX ranges never reach torch traces and ``record_function`` ranges never reach Nsight,
hence both. The ``nvtx`` package works without a GPU (``torch.cuda.nvtx`` does not on a
CPU build); it is imported guarded so the engine runs without it.

Cost when nobody is profiling: the torch range is skipped unless the torch profiler is
on (a flag read), and an NVTX push/pop without an attached tool is a few hundred ns.
Nothing here touches the device or synchronises it.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch
from torch.autograd import profiler as _autograd_profiler

try:  # the nvtx package is optional at run time
    import nvtx as _nvtx
except ImportError:  # pragma: no cover - exercised only where nvtx is missing
    _nvtx = None

__all__ = ["phase", "PHASES", "SCHEDULE", "PREPARE_INPUTS", "MODEL", "LOGITS", "SAMPLE", "WAIT", "UPDATE",
           "NVTX_DOMAIN"]

NVTX_DOMAIN = "deepinfer"
SCHEDULE = "deepinfer.schedule"
PREPARE_INPUTS = "deepinfer.prepare_inputs"
MODEL = "deepinfer.model"
LOGITS = "deepinfer.logits"
SAMPLE = "deepinfer.sample"
#: the host blocked on a step's results (ModelRunner.collect): time the host is NOT working
WAIT = "deepinfer.wait"
UPDATE = "deepinfer.update"
#: Every phase name the engine emits, in step order. Steps themselves are delimited by
#: the torch profiler's ``ProfilerStep#N`` ranges (see deepinfer/profiling/trace.py).
PHASES: tuple[str, ...] = (SCHEDULE, PREPARE_INPUTS, MODEL, LOGITS, SAMPLE, WAIT, UPDATE)
_COLORS = {SCHEDULE: "blue", PREPARE_INPUTS: "cyan", MODEL: "green", LOGITS: "green",
           SAMPLE: "orange", WAIT: 0x808080, UPDATE: "purple"}  # ints: named colours beyond nvtx's own need matplotlib


def _torch_profiler_on() -> bool:
    """True while a torch profiler is recording (the flag autograd's profiler keeps)."""
    flag = getattr(_autograd_profiler, "_is_profiler_enabled", True)
    return bool(flag)


class phase:
    """Context manager marking one engine phase in torch traces and NVTX.

    ``with phase(MODEL): streams = model(batch, cache)``
    """

    __slots__ = ("name", "_range")

    def __init__(self, name: str) -> None:
        self.name = name
        self._range: Any = None

    def __enter__(self) -> phase:
        if _torch_profiler_on():
            self._range = torch.profiler.record_function(self.name)
            self._range.__enter__()
        if _nvtx is not None:
            _nvtx.push_range(self.name, color=_COLORS.get(self.name, "blue"), domain=NVTX_DOMAIN)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if _nvtx is not None:
            _nvtx.pop_range(domain=NVTX_DOMAIN)
        if self._range is not None:
            self._range.__exit__(exc_type, exc, tb)
            self._range = None
