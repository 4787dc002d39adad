"""Per-step device metadata of a prefill / mixed step on the fast path.

Built once per step from the batch's ``SeqMeta`` list (host lists, one Python loop over
requests) and shared by every layer: the request of each row, block tables as int32
tensors (per request and per row), query tiles for the kernels, and (on first use)
the compressor plans every layer of a kind reuses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..paged_batch import SeqMeta
from .prefill_compressor import CompressorPlan, build_plan
from .prefill_compressor_fused import FusedCompressorPlan, build_fused_plan


@dataclass
class PrefillMeta:
    """What the layers of one prefill / mixed step share (tensors on the cache's device)."""

    seqs: list[SeqMeta]
    positions: torch.Tensor  # [T] int64
    row_req: torch.Tensor  # [T] int32: index into seqs / the table rows
    tables32: dict[str, torch.Tensor]  # group -> [R, width] int32 (padding 0, never read)
    block_size: int
    ops: Any
    _row_tables: dict = field(default_factory=dict)
    _tiles: dict = field(default_factory=dict)
    _plans: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def n_entries_max(self, ratio: int) -> int:
        """The most compressed entries any request has at the end of this step."""
        return max((s.start + s.length) // ratio for s in self.seqs)

    def row_tables(self, group: str) -> torch.Tensor:
        """[T, width] int32: each row's request's table (per-row writes into a pool)."""
        if group not in self._row_tables:
            self._row_tables[group] = self.tables32[group][self.row_req.long()]
        return self._row_tables[group]

    def tiles(self, block_t: int, host: bool = False) -> torch.Tensor:
        """Query tiles [n, 2] int32 (first row, rows) cut at multiples of ``block_t``, on
        the device (or the host copy)."""
        if block_t not in self._tiles:
            from deepinfer_kernels.prefill_attention import query_tiles

            cpu = query_tiles([s.start for s in self.seqs], [s.length for s in self.seqs],
                              [s.offset for s in self.seqs], block_t, "cpu")
            self._tiles[block_t] = (cpu, cpu.to(self.device))
        return self._tiles[block_t][0 if host else 1]

    def plan(self, comp: torch.nn.Module, store: Any) -> CompressorPlan:
        """The step's plan for compressors like ``comp`` writing into ``store``'s group."""
        key = (comp.ratio, comp.overlap, store.ring.shape[1], store.group, store.entries.shape[1])
        if key not in self._plans:
            self._plans[key] = build_plan(self.seqs, comp.ratio, comp.overlap, store.ring.shape[1], store.group,
                                          store.entries.shape[1], self.block_size, self.device)
        return self._plans[key]

    def fused_plan(self, comp: torch.nn.Module, store: Any) -> FusedCompressorPlan:
        """The step's source-code plan (prefill_compressor_fused.py) for compressors like ``comp``."""
        ring = store.ring
        key = ("fused", comp.ratio, comp.overlap, ring.shape[0], ring.shape[1], store.group, store.entries.shape[1],
               store.tail is not None)
        if key not in self._plans:
            self._plans[key] = build_fused_plan(self.seqs, comp.ratio, comp.overlap, ring.shape[0], ring.shape[1],
                                                store.group, store.entries.shape[1], self.block_size,
                                                store.tail is not None, self.device)
        return self._plans[key]


def build_prefill_meta(seqs: list[SeqMeta], positions: torch.Tensor, groups: list[str], block_size: int,
                       ops: Any) -> PrefillMeta:
    """The metadata of one step (positions already on the device)."""
    device = positions.device
    lengths = np.array([s.length for s in seqs], dtype=np.int64)
    row_req = np.repeat(np.arange(len(seqs)), lengths)
    tables32 = {}
    for g in groups:
        width = max(1, max(len(s.block_table[g]) for s in seqs))
        tab = np.zeros((len(seqs), width), dtype=np.int32)
        for i, s in enumerate(seqs):
            tab[i, :len(s.block_table[g])] = np.asarray(s.block_table[g], dtype=np.int32)
        tables32[g] = torch.from_numpy(tab).to(device)
    return PrefillMeta(seqs, positions, torch.from_numpy(row_req.astype(np.int32)).to(device), tables32,
                       block_size, ops)
