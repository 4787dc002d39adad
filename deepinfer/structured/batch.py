"""One step's token bitmask: filled on the host, applied in place on the device logits.

The contract with the model runner is one call, ``grammar.apply(logits, req_ids)``,
made after the forward pass is issued and before sampling (greedy rows included):
row ``j`` of ``logits`` belongs to ``req_ids[j]``. On a GPU the forward runs
asynchronously, so the host-side fill overlaps it; the bitmask then travels with a
``non_blocking`` copy from pinned memory and xgrammar's kernel masks the logits,
with no host synchronisation added.

Why two host buffers: a non_blocking copy reads its pinned source later, so the
buffer filled for step N must not be overwritten while step N's copy may still be
in flight. Today every step ends in a host sync (``tolist()`` of the sampled
tokens) anyway; the ring keeps this safe once async scheduling removes that sync.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepinfer.structured.llg_backend import LLGMatcher

if TYPE_CHECKING:
    from deepinfer.structured.matcher import RequestGrammar

__all__ = ["MaskStats", "BitmaskBuffers", "StructuredOutputBatch"]


@dataclass
class MaskStats:
    """Host time spent on masks (apply time is launch time on a GPU)."""

    steps: int = 0
    rows: int = 0
    fill_s: float = 0.0
    apply_s: float = 0.0

    def per_step_ms(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {"fill_ms": 1e3 * self.fill_s / n, "apply_ms": 1e3 * self.apply_s / n,
                "total_ms": 1e3 * (self.fill_s + self.apply_s) / n, "rows_per_step": self.rows / n}


class BitmaskBuffers:
    """Reusable int32 bitmask buffers ``[rows, ceil(vocab / 32)]`` (host ring + device copy)."""

    def __init__(self, vocab_size: int, device: torch.device, rows: int = 64) -> None:
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.width = (vocab_size + 31) // 32
        self._slot = 0
        self._alloc(rows)

    def _alloc(self, rows: int) -> None:
        pin = self.device.type == "cuda"
        self.host = [torch.full((rows, self.width), -1, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.dev = None if self.device.type == "cpu" else torch.empty((rows, self.width), dtype=torch.int32,
                                                                        device=self.device)
        self.rows = rows

    def next_host(self, rows: int) -> torch.Tensor:
        """The host buffer for this step, at least ``rows`` rows (grown by doubling)."""
        if rows > self.rows:
            self._alloc(max(rows, 2 * self.rows))
        self._slot ^= 1
        return self.host[self._slot][:rows]


class StructuredOutputBatch:
    """The constrained rows of one step and how to mask them."""

    def __init__(self, grammars: dict[str, RequestGrammar], buffers: BitmaskBuffers, stats: MaskStats) -> None:
        self.grammars, self.buffers, self.stats = grammars, buffers, stats

    def fill(self, req_ids: list[str]) -> tuple[torch.Tensor, list[int]]:
        """Host bitmask for ``req_ids`` (unconstrained rows all-ones) and the constrained rows."""
        rows = [j for j, rid in enumerate(req_ids) if rid in self.grammars and self.grammars[rid].active]
        host = self.buffers.next_host(len(req_ids))
        constrained = set(rows)
        for j in range(len(req_ids)):  # constrained rows are fully overwritten by the fill below
            if j not in constrained:
                # -1 = all 32 bits set = every token allowed. Row by row on purpose: one
                # row is below torch's parallel grain, and a whole-buffer fill_ enters an
                # OpenMP region that costs milliseconds on a busy host.
                host[j].fill_(-1)
        # xgrammar's matchers are filled in one batched call; llguidance's one by one
        # (the same bitmask layout: see llg_backend.py)
        xgr_rows, xgr_matchers = [], []
        for j in rows:
            matcher = self.grammars[req_ids[j]].matcher
            if isinstance(matcher, LLGMatcher):
                matcher.fill_next_token_bitmask(host, j)
            else:
                xgr_rows.append(j)
                xgr_matchers.append(matcher)
        if len(xgr_rows) == 1:
            xgr_matchers[0].fill_next_token_bitmask(host, xgr_rows[0])  # type: ignore[union-attr]
        elif xgr_rows:
            _batch_matcher().batch_fill_next_token_bitmask(xgr_matchers, host, xgr_rows)
        return host, rows

    def apply(self, logits: torch.Tensor, req_ids: list[str]) -> None:
        """Set every token the grammar forbids to -inf in the rows of constrained requests."""
        if logits.shape != (len(req_ids), self.buffers.vocab_size):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(req_ids)} rows x the grammar "
                             f"vocabulary {self.buffers.vocab_size} (TokenizerInfo must use the logits width)")
        t0 = time.perf_counter()
        host, rows = self.fill(req_ids)
        t1 = time.perf_counter()
        self.apply_mask(logits, host, rows)
        self.stats.steps += 1
        self.stats.rows += len(rows)
        self.stats.fill_s += t1 - t0
        self.stats.apply_s += time.perf_counter() - t1

    def apply_verify(self, logits: torch.Tensor, layout: list[tuple[str, list[int]]]) -> None:
        """Speculative verify rows: request ``i`` of ``layout = [(req_id, drafts)]``
        owns ``len(drafts) + 1`` consecutive rows of ``logits``; row ``j`` of a constrained
        request gets the mask of its grammar after the output plus ``drafts[:j]``, so the
        acceptance test and the bonus / residual samples all see the grammar's
        distribution. Matchers end in the state they started in (only real tokens,
        consumed by ``StructuredOutputManager.advance`` after the step, move them)."""
        n_rows = sum(len(d) + 1 for _, d in layout)
        if logits.shape != (n_rows, self.buffers.vocab_size):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {n_rows} verify rows x the grammar "
                             f"vocabulary {self.buffers.vocab_size}")
        t0 = time.perf_counter()
        host = self.buffers.next_host(n_rows)
        rows, first = [], 0
        for req_id, drafts in layout:
            g = self.grammars.get(req_id)
            span = range(first, first + len(drafts) + 1)
            if g is None:
                for j in span:
                    host[j].fill_(-1)  # row by row: see fill()
            else:
                g.fill_draft_rows(host, first, drafts)
                rows.extend(span)
            first += len(drafts) + 1
        t1 = time.perf_counter()
        self.apply_mask(logits, host, rows)
        self.stats.steps += 1
        self.stats.rows += len(rows)
        self.stats.fill_s += t1 - t0
        self.stats.apply_s += time.perf_counter() - t1

    def apply_mask(self, logits: torch.Tensor, host: torch.Tensor, rows: list[int]) -> None:
        """Apply a filled host bitmask to ``logits`` in place (no host sync on a GPU)."""
        import xgrammar as xgr

        if not rows:
            return
        if logits.device.type == "cpu":
            xgr.apply_token_bitmask_inplace(logits, host, indices=rows)
        else:  # whole-batch apply: no index list to ship; unconstrained rows are all-ones
            dev = self.buffers.dev[:host.shape[0]]  # type: ignore[index]
            dev.copy_(host, non_blocking=True)
            xgr.apply_token_bitmask_inplace(logits, dev)


_BATCH_MATCHER = None


def _batch_matcher():  # type: ignore[no-untyped-def]
    """One process-wide xgrammar BatchGrammarMatcher (its own thread pool fills rows in parallel)."""
    global _BATCH_MATCHER
    if _BATCH_MATCHER is None:
        import xgrammar as xgr

        _BATCH_MATCHER = xgr.BatchGrammarMatcher()
    return _BATCH_MATCHER
