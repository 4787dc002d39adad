"""Async scheduling, device side: the last sampled token of every request, on the device.

Step N+1 is planned before step N's tokens reach the host, so its decode inputs are
``PLACEHOLDER_TOKEN_ID`` (-1) in the plan. The runner's ``build_batch`` calls
:meth:`DeviceTokenBuffer.fill`, which replaces each placeholder with ``last[state_slot]``
by a device gather; ``ModelRunner.sample`` calls :meth:`record` right after sampling,
which scatters the new tokens into ``last``. Both are stream-ordered device ops, so the
next step's inputs never wait for the host.

Debug sentinels (``debug=True``, on in the tests): a slot is poisoned with -1 once read,
and ``torch._assert_async`` checks that no -1 input id survives the gather, so a wrong or
double gather fails loudly instead of feeding a stale token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from deepinfer.engine.outputs import ScheduledRequest, SchedulerOutput
from deepinfer.engine.request import PLACEHOLDER_TOKEN_ID
from deepinfer.engine.transfer import to_device

if TYPE_CHECKING:
    from deepinfer.models.paged_batch import ForwardBatch

__all__ = ["DeviceTokenBuffer"]


class DeviceTokenBuffer:
    """``last[max_num_seqs]`` int64 on the device, indexed by state slot."""

    def __init__(self, max_num_seqs: int, device: torch.device, debug: bool = False) -> None:
        self.device, self.debug = torch.device(device), debug
        self.last = torch.full((max_num_seqs,), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=self.device)
        #: the plans whose inputs were filled / whose samples were recorded last (bypass checks)
        self.filled: SchedulerOutput | None = None
        self.recorded: SchedulerOutput | None = None
        self.num_gathered = 0

    @staticmethod
    def placeholders(so: SchedulerOutput) -> tuple[list[int], list[int]]:
        """(flat input rows, state slots) of ``so``'s placeholder input ids."""
        rows: list[int] = []
        slots: list[int] = []
        offset = 0
        for r in so.scheduled:
            for j, tok in enumerate(r.token_ids):
                if tok == PLACEHOLDER_TOKEN_ID:
                    rows.append(offset + j)
                    slots.append(r.state_slot)
            offset += r.num_tokens
        return rows, slots

    def fill(self, so: SchedulerOutput, batch: ForwardBatch,
             staged: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Gather placeholder input ids of ``so`` from ``last`` into ``batch.input_ids``.
        ``staged``: :meth:`placeholders` already on the device (the runner copies them with
        the step's ids and positions: one host -> device copy fewer per step)."""
        self.filled = so
        if staged is None:
            rows, slots = self.placeholders(so)
            staged = tuple(to_device([rows, slots], torch.long, self.device)) if rows else None  # type: ignore[assignment]
        if staged is not None and staged[0].numel():
            rows_t, slots_t = staged
            batch.input_ids[rows_t] = self.last[slots_t]
            self.num_gathered += int(rows_t.numel())
            if self.debug:  # a slot is read once; a second read (wrong gather) sees -1
                self.last[slots_t] = PLACEHOLDER_TOKEN_ID
        if self.debug:
            torch._assert_async((batch.input_ids >= 0).all(), "async scheduling: unfilled placeholder input id")

    def record(self, so: SchedulerOutput, sampled: Sequence[ScheduledRequest], token_ids: torch.Tensor,
               slots: torch.Tensor | None = None) -> None:
        """Store the token each of ``sampled`` (the step's sampling requests) just got;
        ``slots``: their state slots already on the device (copied with the sampling tensors)."""
        self.recorded = so
        if not sampled:
            return
        if len(sampled) != token_ids.shape[0]:
            raise ValueError(f"{token_ids.shape[0]} sampled tokens for {len(sampled)} sampling requests")
        idx = slots if slots is not None else to_device([r.state_slot for r in sampled], torch.long, self.device)
        self.last[idx] = token_ids.to(self.device)
