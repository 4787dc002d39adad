"""Time spent in the expert-parallel all-to-alls, for the EP benchmark (issue 11).

Opt-in (``DEEPINFER_EP_TIMING=1`` when the rank's ``EPComm`` is built): each
``all_to_all`` is bracketed by CUDA events on a GPU (nothing waits: the pairs are resolved
when the totals are read, after one synchronize) or by the wall clock on CPU, where gloo's
all-to-all is synchronous. The totals include waiting for the slowest peer to arrive, which
is what an imbalanced step costs.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class AllToAllTimer:
    """Accumulated seconds, calls and bytes (sent + received) of one rank's all-to-alls."""

    def __init__(self) -> None:
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.seconds, self.calls, self.bytes = 0.0, 0, 0

    def start(self, x: torch.Tensor) -> Any:
        if x.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, token: Any, nbytes: int) -> None:
        if isinstance(token, float):
            self.seconds += time.perf_counter() - token
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((token, end))
        self.calls += 1
        self.bytes += nbytes

    def read(self, reset: bool = False) -> dict[str, float]:
        """Totals so far (``seconds``, ``calls``, ``bytes``); ``reset`` starts over."""
        if self._pending:
            self._pending[-1][1].synchronize()
            self.seconds += sum(a.elapsed_time(b) for a, b in self._pending) / 1e3
            self._pending.clear()
        out = {"seconds": self.seconds, "calls": self.calls, "bytes": self.bytes}
        if reset:
            self.seconds, self.calls, self.bytes = 0.0, 0, 0
        return out
