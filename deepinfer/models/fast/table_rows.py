"""Host copies of the running requests' block tables, one int32 row per (group, state slot).

A decode step's device inputs hold every request's block table padded to the step's width
class. Padding each table as a Python list every step cost O(batch x width) interpreter
work, which at 16k-token contexts and a few hundred requests rivalled the step's device
time. The KV cache manager replaces a request's table list whenever it changes and never
mutates one in place (``HybridKVCacheManager.allocate_slots``), so a row is rewritten only
when the list object behind it is another one: between allocations (one per ``block_size``
tokens of a request) a step's tables are one numpy gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["TableRows"]


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class TableRows:
    """Rows of ``groups``' block tables by state slot; :meth:`gather` builds a step's tables.

    Rows past a table's length are 0 (the padding the kernels never read: positions past a
    request's length are masked). Capacity grows by powers of two in both slots and width.
    """

    def __init__(self, groups: Sequence[str]) -> None:
        self.groups = list(groups)
        self._rows = np.zeros((len(self.groups), 0, 0), dtype=np.int32)
        # per group: slot -> the table list its row was written from (held, so `is` is exact)
        self._src: list[dict[int, list[int]]] = [{} for _ in self.groups]
        self.rewrites = 0  # rows written since construction (a test reads it)

    def _reserve(self, slots: int, width: int) -> None:
        g, have_slots, have_width = self._rows.shape
        if slots <= have_slots and width <= have_width:
            return
        grown = np.zeros((g, max(have_slots, _pow2_at_least(slots)), max(have_width, _pow2_at_least(width))),
                         dtype=np.int32)
        grown[:, :have_slots, :have_width] = self._rows
        self._rows = grown

    def _write(self, gi: int, slot: int, table: list[int]) -> None:
        if len(table) > self._rows.shape[2]:  # a table longer than any step's width so far
            self._reserve(slot + 1, len(table))
        row = self._rows[gi, slot]
        row[:len(table)] = table
        row[len(table):] = 0
        self._src[gi][slot] = table
        self.rewrites += 1

    def gather(self, reqs: Sequence[Any], width: int, out: np.ndarray | None = None) -> np.ndarray:
        """[groups, len(reqs), width] int32: each request's tables (``block_table[group]``,
        by its ``state_slot``), 0-padded; a table longer than ``width`` is cut to it.
        ``out``: written there (a view of the step's flat host inputs) instead of a new array."""
        slots = [r.state_slot for r in reqs]
        self._reserve(max(slots, default=-1) + 1, width)
        for gi, g in enumerate(self.groups):
            src = self._src[gi]
            for r, slot in zip(reqs, slots):
                table = r.block_table[g]
                if src.get(slot) is not table:
                    self._write(gi, slot, table)
        picked = self._rows[:, slots, :width]  # fancy indexing: a fresh array (np.take's out= buffers: slower)
        if out is None:
            return picked
        out[...] = picked
        return out
