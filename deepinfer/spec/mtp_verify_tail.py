"""The MTP stage's catch-up inside the verify graphs' greedy lane: one replay per speculative step.

A greedy-lane verify step knows on the device, per request, its accepted run and the
argmax of every row. The MTP drafter's catch-up (`MTPDrafter.draft_after_verify`) runs the
stage over every verify row fed that argmax and reads the first draft at the run's end;
here the same pass, the pick and the step's record for a plan made ahead (the bonus
token, the first draft and the shift, `DeviceTokenBuffer.record_verify`) are captured in
the verify graph itself (`VerifyGraphs.tail`), so a k = 1 step launches one graph and
its copy, and nothing else. Later drafts (k > 1) stay one-row passes of `MTPStageGraphs`.

Padded groups (rows past the step's requests: their own group each, repeating row 0)
record into the buffer's spare row, so they never overwrite request 0's slot; the
graph's input ``n_groups`` (copied with the step's inputs) says which groups are real.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .mtp_graphs import MTPStageGraphs

__all__ = ["MTPVerifyTail"]


class MTPVerifyTail:
    """``tail(meta, streams, packed, greedy, n_groups, row_shift, capture)`` (meta: fed, its
    positions shifted by ``row_shift``, ``ops.feed_placeholders``) -> per
    group (first draft packed [R, 2] (token, log-prob bits), its output streams [R, N, D],
    accepted drafts [R], accepted + the group's shift [R]: where its later passes start)."""

    def __init__(self, stage: MTPStageGraphs, last: torch.Tensor, shift: torch.Tensor) -> None:
        if last.shape[0] != shift.shape[0] or last.shape[1] < 2:
            raise ValueError(f"MTPVerifyTail: token storage [{tuple(last.shape)}] / shift [{tuple(shift.shape)}] "
                             f"must have the same rows (slots + a spare one) and at least 2 columns")
        self.stage, self.last, self.shift = stage, last, shift

    def __call__(self, meta: Any, streams: torch.Tensor, packed: torch.Tensor, greedy: torch.Tensor,
                 n_groups: torch.Tensor, row_shift: torch.Tensor, capture: dict | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        argmax = packed[:, 0]
        stage_streams, stage_packed = self.stage._body((dataclasses.replace(meta, ids=argmax.to(meta.ids.dtype)),
                                                        streams))
        draft, at, accepted, accepted_shift = self.stage.ops.mtp_tail_record(
            meta.starts, meta.slots, greedy, packed, stage_packed, n_groups, row_shift, self.last, self.shift)
        return draft, stage_streams.index_select(0, at), accepted, accepted_shift
