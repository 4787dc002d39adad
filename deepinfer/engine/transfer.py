"""Host <-> device copies that never make the host wait for the device stream.

Async scheduling launches step N+1 before step N's results are on the host, so nothing
on the launch path may synchronise with the device:

* host -> device: ``torch.tensor(values, device="cuda")`` copies from pageable memory
  with a blocking copy, i.e. a stream synchronisation: the host would wait for every
  step already queued. :func:`to_device` stages the values in pinned memory (torch's
  caching host allocator keeps the block alive until the copy ran) and copies with
  ``non_blocking=True``; :func:`copy_to_device` fills a persistent device buffer from a
  numpy array through a reused pinned block (:class:`PinnedRing`, an event per block so
  it is never rewritten before its copy ran: the fast path's step inputs, where a
  ``Tensor.pin_memory()`` per step was a large share of the host's step time; numbers in
  docs/measurements.md).
* device -> host: :class:`ResultCopier` copies a step's sampled tokens / logprobs on its
  own CUDA stream into one reused pinned block, after the compute stream's work so far,
  and records an event. The host later waits on that event only (:meth:`HostResult.wait`,
  which clones the few small results out of the block); the compute stream meanwhile
  runs the next step, which was launched first.

On CPU (and any backend without CUDA streams) both are plain synchronous copies: there
the device is the host thread itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["to_device", "copy_to_device", "HostResult", "ResultCopier", "PinnedRing"]


class PinnedRing:
    """Reused pinned staging blocks for copies of whole arrays (the fast path's step
    inputs, the step results): a ``Tensor.pin_memory()`` / ``torch.empty(pin_memory=True)``
    per step costs host time on every step (profiling/results/host_phases_mini.json; the
    numbers in docs/measurements.md). A block is
    reused ``slots`` takes later, after the event of the copy that last used it (normally
    long done; waited on otherwise, so a block is never overwritten under a pending copy)."""

    #: blocks allocated by every ring so far (without :meth:`reserve` at warm-up, each ring
    #: allocated pinned memory in each of the first 32 steps served)
    allocations = 0

    def __init__(self, slots: int = 32, pin: bool = True) -> None:
        self._blocks: list[torch.Tensor | None] = [None] * slots
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._next, self._pin = 0, pin

    def reserve(self, nbytes: int) -> None:
        """Give every slot a block of at least ``nbytes`` now (engine warm-up), so that steps
        up to that size never allocate pinned memory while serving."""
        for i, block in enumerate(self._blocks):
            if block is None or block.numel() < nbytes:
                if self._events[i] is not None:
                    self._events[i].synchronize()
                self._blocks[i] = self._allocate(nbytes)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        PinnedRing.allocations += 1
        return torch.empty(max(4096, 1 << (max(nbytes, 1) - 1).bit_length()), dtype=torch.uint8, pin_memory=self._pin)

    def stage(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """(slot, a pinned uint8 block of at least ``nbytes``) whose previous copy has run."""
        i = self._next
        self._next = (i + 1) % len(self._blocks)
        event = self._events[i]
        if event is not None:
            event.synchronize()
        block = self._blocks[i]
        if block is None or block.numel() < nbytes:
            block = self._blocks[i] = self._allocate(nbytes)
        return i, block

    def copied(self, slot: int, event: torch.cuda.Event) -> None:
        """The copy out of / into ``slot`` was enqueued before ``event``."""
        self._events[slot] = event


_H2D = PinnedRing()

#: what `reserve_staging` gives each slot: step inputs (ids, positions, slots, block tables of a
#: few hundred rows) and step results (tokens, log-probs); larger copies still grow a slot
STAGING_INPUT_BYTES = 256 * 1024
STAGING_RESULT_BYTES = 64 * 1024


def reserve_staging(copier: "ResultCopier") -> None:
    """Allocate the pinned staging blocks of step inputs and of ``copier``'s results up front
    (CUDA only: elsewhere nothing is pinned)."""
    if copier.stream is None:
        return
    _H2D.reserve(STAGING_INPUT_BYTES)
    copier.reserve(STAGING_RESULT_BYTES)


def aligned_starts(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Start offsets (int64 elements) of parts of ``sizes`` packed into one flat tensor, each
    at an even offset, and the flat length. Each view is then 16-byte aligned whatever the
    sizes: Triton compiles a kernel once per pointer alignment, so a view at an odd offset
    (e.g. a step's positions after an odd number of ids) would compile another variant of
    every kernel reading it while serving."""
    starts, at = [], 0
    for n in sizes:
        starts.append(at)
        at += n + n % 2
    return starts, at


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without a host sync on CUDA.
    Small lists go through torch's caching pinned allocator: staging them in a
    :class:`PinnedRing` block was slower per call (numpy conversion, views and an event per
    copy; profiling/results/host_phases_mini.json, docs/measurements.md)."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


def copy_to_device(dst: torch.Tensor, arr: np.ndarray) -> None:
    """``dst.copy_(arr)`` for a contiguous device tensor ``dst`` of ``arr``'s dtype and size,
    staged in a :class:`PinnedRing` block (no host sync; a plain copy off CUDA)."""
    src = torch.from_numpy(np.ascontiguousarray(arr))
    if dst.device.type != "cuda":
        dst.copy_(src.view(dst.shape))
        return
    slot, block = _H2D.stage(src.numel() * src.element_size())
    host = block[:src.numel() * src.element_size()].view(src.dtype).view(dst.shape)
    host.copy_(src.view(dst.shape))
    dst.copy_(host, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    _H2D.copied(slot, event)


class HostResult:
    """Host copies of some device tensors; valid once :meth:`wait` returns."""

    def __init__(self, tensors: list[torch.Tensor], event: torch.cuda.Event | None = None) -> None:
        self._tensors, self._event = tensors, event

    def ready(self) -> bool:
        """True when the copies have landed (never blocks)."""
        return self._event is None or self._event.query()

    def wait(self) -> list[torch.Tensor]:
        """Block until the copies have landed (only on them, not on later device work).
        Staged results are cloned out of the reused pinned blocks (a few small tensors)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
            self._tensors = [t.clone() for t in self._tensors]
        return self._tensors


class ResultCopier:
    """Device -> host copies of step results on a side stream (CUDA), or plain copies."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._ring = PinnedRing()

    def reserve(self, nbytes: int) -> None:
        """Every staging block of this copier at least ``nbytes`` (see `PinnedRing.reserve`)."""
        self._ring.reserve(nbytes)

    def start(self, tensors: Sequence[torch.Tensor], in_order: bool = False) -> HostResult:
        """Start copying ``tensors`` (produced on the current stream) to the host: one
        pinned block per call, each tensor at an aligned offset inside it. ``in_order``:
        copy on the current stream itself, so work enqueued after this call (a graph replay
        that rewrites its outputs) runs after the copy: the tensors need no clone first."""
        if self.stream is None:
            return HostResult([t if t.device.type == "cpu" else t.cpu() for t in tensors])
        stream = torch.cuda.current_stream(self.device) if in_order else self.stream
        if not in_order:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // 16) * 16
        slot, block = self._ring.stage(total)
        host = []
        with torch.cuda.stream(stream):
            for t, off in zip(tensors, offsets):
                h = block[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                h.copy_(t, non_blocking=True)
                if not in_order:
                    t.record_stream(stream)  # the allocator must not reuse t before this copy ran
                host.append(h)
            event = torch.cuda.Event()
            event.record(stream)
        self._ring.copied(slot, event)
        return HostResult(host, event)
