"""Async scheduling, device side: the last sampled token of every request, on the device.

Step N+1 is planned before step N's tokens reach the host, so its decode inputs are
``PLACEHOLDER_TOKEN_ID`` (-1) in the plan. The runner's ``build_batch`` calls
:meth:`DeviceTokenBuffer.fill`, which replaces each placeholder with ``last[state_slot]``
by a device gather; ``ModelRunner.sample`` calls :meth:`record` right after sampling,
which scatters the new tokens into ``last``. Both are stream-ordered device ops, so the
next step's inputs never wait for the host.

Speculative steps planned ahead (`deepinfer/spec/plan_ahead.py`) feed every row of a
request from the device: ``last[slot]`` holds ``1 + k`` tokens (the bonus token, then the
k drafts, recorded by :meth:`record_verify`), and ``shift[slot]`` how far the plan's
positions (made for every draft accepted) are from the truth (accepted - drafts, <= 0).
:meth:`fill` gathers the j-th placeholder of a request from column j and adds the shift
to its rows' positions on the device (``ForwardBatch.position_shift``).

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
    """``last[max_num_seqs + 1, width]`` int64 on the device, indexed by state slot (``width``:
    1 + the drafts per step; 1 without speculation; the last row is spare), and ``shift``."""

    def __init__(self, max_num_seqs: int, device: torch.device, debug: bool = False, width: int = 1,
                 storage: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.device, self.debug = torch.device(device), debug
        #: (last, shift) with one spare row past the slots (``allocate``): what the verify
        #: graphs' tail records into (spec/mtp_verify_tail.py), allocated before their capture
        self.last, self.shift = storage if storage is not None else self.allocate(max_num_seqs, width, self.device)
        if self.last.shape[0] <= max_num_seqs or self.last.shape[1] != width:
            raise ValueError(f"DeviceTokenBuffer: storage of {tuple(self.last.shape)} for {max_num_seqs} slots "
                             f"(+ 1 spare) x width {width}")
        #: the plans whose inputs were filled / whose samples were recorded last (bypass checks)
        self.filled: SchedulerOutput | None = None
        self.recorded: SchedulerOutput | None = None
        self.num_gathered = 0

    @staticmethod
    def allocate(max_num_seqs: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(last [max_num_seqs + 1, width], shift [max_num_seqs + 1]): slots, then a spare row."""
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"DeviceTokenBuffer: width must be an int >= 1, got {width!r}")
        last = torch.full((max_num_seqs + 1, width), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=device)
        return last, torch.zeros(max_num_seqs + 1, dtype=torch.long, device=device)

    def placeholder_index(self, so: SchedulerOutput) -> tuple[list[int], list[int]]:
        """(flat input rows, flat indices into ``last``) of ``so``'s placeholder input ids."""
        width = self.last.shape[1]
        rows: list[int] = []
        index: list[int] = []
        offset = 0
        for r in so.scheduled:
            col = 0
            for j, tok in enumerate(r.token_ids):
                if tok == PLACEHOLDER_TOKEN_ID:
                    if col >= width:
                        raise ValueError(f"request {r.req_id!r} feeds {col + 1} placeholders; the device token "
                                         f"buffer holds {width} per request")
                    rows.append(offset + j)
                    index.append(r.state_slot * width + col)
                    col += 1
            offset += r.num_tokens
        return rows, index

    def fill(self, so: SchedulerOutput, batch: ForwardBatch,
             staged: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Gather placeholder input ids of ``so`` from ``last`` into ``batch.input_ids``;
        a request fed more than one placeholder (a speculative step planned ahead) also gets
        its slot's shift added to its rows' positions (``batch.position_shift``; only a
        speculative engine, ``width > 1``, feeds placeholders that way).
        ``staged``: :meth:`placeholder_index` already on the device (the runner copies them
        with the step's ids and positions: one host -> device copy fewer per step)."""
        self.filled = so
        if staged is None:
            rows, index = self.placeholder_index(so)
            staged = tuple(to_device([rows, index], torch.long, self.device)) if rows else None  # type: ignore[assignment]
        if staged is not None and staged[0].numel():
            rows_t, index_t = staged
            flat = self.last.view(-1)
            batch.input_ids[rows_t] = flat[index_t]
            self.num_gathered += int(rows_t.numel())
            if self.last.shape[1] > 1:  # speculative: placeholder rows come from a plan made ahead
                shift = torch.zeros_like(batch.positions)
                shift[rows_t] = self.shift[index_t // self.last.shape[1]]
                batch.positions += shift
                batch.position_shift = shift
            if self.debug:  # a slot is read once; a second read (wrong gather) sees -1
                flat[index_t] = PLACEHOLDER_TOKEN_ID
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
        self.last[idx, 0] = token_ids.to(self.device)

    def record_verify(self, so: SchedulerOutput, slots: torch.Tensor, bonus: torch.Tensor, drafts: torch.Tensor,
                      shift: torch.Tensor) -> None:
        """A verify step's results per request, on the device: ``bonus`` [R] its last emitted
        token, ``drafts`` [R, k] the next step's drafts, ``shift`` [R] accepted - drafts (the
        next plan's positions assume every draft accepted); ``slots`` [R] state slots."""
        self.recorded = so
        k = drafts.shape[1]
        if k + 1 > self.last.shape[1]:
            raise ValueError(f"{k} drafts per request; the device token buffer holds {self.last.shape[1] - 1}")
        self.last[slots, 0] = bonus
        self.last[slots, 1:k + 1] = drafts
        self.shift[slots] = shift
