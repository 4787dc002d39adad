"""Per-step device metadata of a prefill / mixed step on the fast path.

Built once per step from the batch's ``SeqMeta`` list (host lists, one Python loop over
requests) and shared by every layer: the request of each row, block tables as int32
tensors, each row's window-KV slot, query tiles for the kernels, and (on first use)
the compressor plans and RoPE tables every layer of a kind reuses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..kv_cache import GROUP_SWA, SeqMeta
from ..rope import Rotary
from .prefill_compressor import CompressorPlan, build_plan


@dataclass
class PrefillMeta:
    """What the layers of one prefill / mixed step share (tensors on the cache's device)."""

    seqs: list[SeqMeta]
    positions: torch.Tensor  # [T] int64
    row_req: torch.Tensor  # [T] int32: index into seqs / the table rows
    tables32: dict[str, torch.Tensor]  # group -> [R, width] int32 (padding 0, never read)
    swa_blk: torch.Tensor  # [T] int64: physical window block of each row ...
    swa_sub: torch.Tensor  # [T] int64: ... and its row in it
    block_size: int
    ops: Any
    _tiles: dict = field(default_factory=dict)
    _plans: dict = field(default_factory=dict)
    _rope: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def n_entries_max(self, ratio: int) -> int:
        """The most compressed entries any request has at the end of this step."""
        return max((s.start + s.length) // ratio for s in self.seqs)

    def tiles(self, block_t: int) -> torch.Tensor:
        """Query tiles [n, 2] int32 (first row, rows) cut at multiples of ``block_t``."""
        if block_t not in self._tiles:
            from deepinfer_kernels.prefill_attention import query_tiles

            self._tiles[block_t] = query_tiles([s.start for s in self.seqs], [s.length for s in self.seqs],
                                               [s.offset for s in self.seqs], block_t, self.device)
        return self._tiles[block_t]

    def plan(self, comp: torch.nn.Module, store: Any) -> CompressorPlan:
        """The step's plan for compressors like ``comp`` writing into ``store``'s group."""
        key = (comp.ratio, comp.overlap, store.ring.shape[1], store.group, store.entries.shape[1])
        if key not in self._plans:
            self._plans[key] = build_plan(self.seqs, comp.ratio, comp.overlap, store.ring.shape[1], store.group,
                                          store.entries.shape[1], self.block_size, self.device)
        return self._plans[key]

    def cos_sin(self, rotary: Rotary, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``rotary.cos_sin(positions, dtype)``, once per step."""
        key = (id(rotary), dtype)
        if key not in self._rope:
            self._rope[key] = rotary.cos_sin(self.positions, dtype)
        return self._rope[key]


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
    pos = np.concatenate([np.arange(s.start, s.start + s.length) for s in seqs])
    swa_blk = np.concatenate([np.asarray(s.block_table[GROUP_SWA], dtype=np.int64)[
        np.arange(s.start, s.start + s.length) // block_size] for s in seqs])
    return PrefillMeta(seqs, positions, torch.from_numpy(row_req.astype(np.int32)).to(device), tables32,
                       torch.from_numpy(swa_blk).to(device), torch.from_numpy(pos % block_size).to(device),
                       block_size, ops)
