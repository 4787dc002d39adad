"""Host <-> device copies that never make the host wait for the device stream.

Async scheduling launches step N+1 before step N's results are on the host, so nothing
on the launch path may synchronise with the device:

* host -> device: ``torch.tensor(values, device="cuda")`` copies from pageable memory
  with a blocking copy, i.e. a stream synchronisation: the host would wait for every
  step already queued. :func:`to_device` stages the values in pinned memory and copies
  with ``non_blocking=True``; torch's caching host allocator keeps the pinned block
  alive until the copy has run, so the staging tensor may be dropped at once.
* device -> host: :class:`ResultCopier` copies a step's sampled tokens / logprobs on its
  own CUDA stream into pinned buffers, after the compute stream's work so far, and
  records an event. The host later waits on that event only (:meth:`HostResult.wait`);
  the compute stream meanwhile runs the next step, which was launched first.

On CPU (and any backend without CUDA streams) both are plain synchronous copies: there
the device is the host thread itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["to_device", "HostResult", "ResultCopier"]


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without a host sync on CUDA."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


class HostResult:
    """Host copies of some device tensors; valid once :meth:`wait` returns."""

    def __init__(self, tensors: list[torch.Tensor], event: torch.cuda.Event | None = None) -> None:
        self._tensors, self._event = tensors, event

    def ready(self) -> bool:
        """True when the copies have landed (never blocks)."""
        return self._event is None or self._event.query()

    def wait(self) -> list[torch.Tensor]:
        """Block until the copies have landed (only on them, not on later device work)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._tensors


class ResultCopier:
    """Device -> host copies of step results on a side stream (CUDA), or plain copies."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def start(self, tensors: Sequence[torch.Tensor]) -> HostResult:
        """Start copying ``tensors`` (produced on the current stream) to the host."""
        if self.stream is None:
            return HostResult([t if t.device.type == "cpu" else t.cpu() for t in tensors])
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        host = []
        with torch.cuda.stream(self.stream):
            for t in tensors:
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                t.record_stream(self.stream)  # the allocator must not reuse t before this copy ran
                host.append(h)
            event = torch.cuda.Event()
            event.record(self.stream)
        return HostResult(host, event)
