"""DSpark's work inside the verify graphs' greedy lane: the context K/V of every verify row,
the next draft blocks' inputs, and the step's record for a plan made ahead.

A greedy-lane verify step knows on the device, per request, its accepted run and the argmax
of every row. Drafting behind it from the host cost a host layout of every request's pool rows for
every possible accepted count, its copy, and about thirty small launches outside any graph
to pick from it, gather the features and feed two more graphs. Here the same work is captured in the verify graph
itself (`VerifyGraphs.tail`), computed from the step's own device inputs (the bookkeeping
in one launch, ``deepinfer_kernels.dspark_tail``):

* the features of every verify row (mean over the hc streams of the target layers' inputs)
  written into each stage's window pool at the row's position (``DSparkDrafter._feature_body``,
  the feature graphs' body); the pool row comes from the row's SWA block table, as the
  target's attention reads it;
* per request: its last token (the argmax at the end of its accepted run), that token's
  predecessor position ``p`` and the pool rows of positions (p + 1 - W, p], written as the
  draft graphs' input rows (`DraftGraphs.staged`), so the draft step replays with no copy;
* the bonus token and the shift (accepted - drafts) into the token buffer, as the MTP
  tail records them; ``dest`` keeps each block's state slot (the spare row for padded
  groups) for the drafts' own record once the draft graph ran.

Padded groups (rows past the step's requests repeat row 0, their own group each) and the
draft rows past the verify step's groups read valid pool rows (their group's, or the last
one's) and record into the buffer's spare row.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.models.fast.draft_dspark import N_COLS
from deepinfer.models.v4.kv_cache import GROUP_SWA
from deepinfer_kernels.dspark_tail import N_COLS as TAIL_COLS

__all__ = ["DSparkVerifyTail"]


class DSparkVerifyTail:
    """``tail(meta, streams, packed, greedy, n_groups, row_shift, capture)`` -> ``dest``
    [draft rows] int64: each staged draft row's state slot (spare for padding)."""

    def __init__(self, drafter: Any, last: torch.Tensor, shift: torch.Tensor) -> None:
        if drafter.graphs is None or drafter.feature_graphs is None:
            raise ValueError("DSparkVerifyTail: the drafter has no captured draft / feature graphs")
        if last.shape[0] != shift.shape[0] or last.shape[1] < 1 + drafter._n_graph:
            raise ValueError(f"DSparkVerifyTail: token storage [{tuple(last.shape)}] / shift [{tuple(shift.shape)}] "
                             f"must have the same rows and 1 + {drafter._n_graph} columns")
        if N_COLS != TAIL_COLS:
            raise ValueError(f"DSparkVerifyTail: the draft rows have {N_COLS} input columns, dspark_tail_stage "
                             f"writes {TAIL_COLS}")
        self.drafter, self.last, self.shift = drafter, last, shift
        self.staged = drafter.graphs.staged  # [draft rows, cols]: every bucket's inputs are its first rows
        self.dest = torch.full((self.staged.shape[0],), last.shape[0] - 1, dtype=torch.long, device=last.device)

    def __call__(self, meta: Any, streams: torch.Tensor, packed: torch.Tensor, greedy: torch.Tensor,
                 n_groups: torch.Tensor, row_shift: torch.Tensor, capture: dict | None = None) -> torch.Tensor:
        d = self.drafter
        # the rows' true positions (the fed lane shifted them): pool rows, records, staged blocks
        ints = d._graph_ops.dspark_tail_stage(
            meta.starts, meta.slots, meta.positions, meta.tables32[GROUP_SWA], greedy, packed, n_groups, self.last,
            self.shift, self.staged, self.dest, d.cfg.sliding_window, d._rows_per_block())
        # every verify row's context K/V (rows past an accepted run are rewritten before any block reads them)
        d._feature_body(d._target_features(capture), ints)
        return self.dest
