"""The compressors of a prefill / mixed step as two kernel launches each
(``deepinfer_kernels/compressor_prefill.py``), from a host-built plan of source-row codes.

Same reads and writes as ``compress_prefill`` (prefill_compressor.py, kept for
batch-invariant mode's fixed-tiling pool hook): per request (start s, length L, e = s + L)
the windows closing in [s, e), the overlap tails of block ends in (s, e], and the ring rows
of the last ``ring_len`` positions. A row before s comes from the ring (history an earlier
step wrote) or, for a newly admitted request resuming after a prefix-cache hit, from the
tail saved with its last cached block, which is what ``Compressor._reset_ring`` restores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.engine.transfer import aligned_starts

from ..paged_batch import SeqMeta

_FIELDS = ("win_src", "win_dest", "win_pos", "tail_src", "tail_dest", "ring_src", "ring_dest", "new_slots")


@dataclass
class FusedCompressorPlan:
    """Device int64 views (one host-to-device copy) of one step's plan for compressors of
    one (ratio, overlap, ring, entry group); codes as the kernel module's doc says."""

    win_src: torch.Tensor  # [Nw, NWIN] source codes of each closing window
    win_dest: torch.Tensor  # [Nw] flat entry row (block * per_block + sub)
    win_pos: torch.Tensor  # [Nw] the window's first position (RoPE)
    tail_src: torch.Tensor  # [Nt, ratio] source codes of each overlap tail
    tail_dest: torch.Tensor  # [Nt] tail block
    ring_src: torch.Tensor  # [Nk] source codes of the ring rows written
    ring_dest: torch.Tensor  # [Nk] flat ring row (slot * ring_len + position % ring_len)
    new_slots: torch.Tensor  # [Nn] ring slots of newly admitted requests (zeroed first)


def build_fused_plan(seqs: list[SeqMeta], ratio: int, overlap: bool, ring_slots: int, ring_len: int, group: str,
                     per_block: int, block_size: int, has_tail: bool, device: torch.device) -> FusedCompressorPlan:
    """The plan of one step; a Python loop over requests, numpy within one."""
    r, n_ring = ratio, ring_slots * ring_len
    nwin = 2 * r if overlap else r
    parts: dict[str, list[np.ndarray]] = {k: [] for k in _FIELDS}
    for seq in seqs:
        s, e = seq.start, seq.start + seq.length
        lo = max(0, (s // r) * r - (r if overlap else 0))
        table = np.asarray(seq.block_table[group], dtype=np.int64)
        restore = seq.is_new and s > 0
        if restore and (s % r or not (overlap and has_tail) and lo < s):
            raise ValueError(f"a newly admitted request starts at position {s}, not at a multiple of the "
                             f"compressor ratio {r}: prefix-cache hits resume at block boundaries")
        if restore and overlap:
            prev_block = table[s // block_size - 1]

        def code(q: np.ndarray) -> np.ndarray:  # source code of position q of this request
            if restore and overlap:  # history [s - r, s): the cached block's tail rows
                hist = -2 - n_ring - (prev_block * r + (q - (s - r)))
            else:
                hist = -2 - (seq.slot * ring_len + q % ring_len)
            return np.where(q >= s, seq.offset + q - s, hist)

        w = np.arange(s // r, e // r)
        if len(w):
            own = w[:, None] * r + np.arange(r)[None, :]
            src = code(own)
            if overlap:
                prev = code(np.maximum(own - r, 0))
                src = np.concatenate([np.where(w[:, None] >= 1, prev, -1), src], axis=1)
            parts["win_src"].append(src)
            parts["win_dest"].append(table[w // per_block] * per_block + w % per_block)
            parts["win_pos"].append(w * r)
        if overlap and has_tail:
            ends = np.arange((s // block_size + 1) * block_size, e + 1, block_size)
            if len(ends):
                parts["tail_src"].append(code(ends[:, None] - r + np.arange(r)[None, :]))
                parts["tail_dest"].append(table[ends // block_size - 1])
        keep = np.arange(max(lo, e - ring_len), e)
        if not restore:  # history rows already sit in the ring
            keep = keep[keep >= s]
        parts["ring_src"].append(code(keep))
        parts["ring_dest"].append(seq.slot * ring_len + keep % ring_len)
        if seq.is_new:
            parts["new_slots"].append(np.array([seq.slot]))
    arrays = []
    for name in _FIELDS:
        cols = nwin if name == "win_src" else r if name == "tail_src" else 0
        arr = np.concatenate(parts[name]) if parts[name] else np.zeros((0, cols) if cols else 0, dtype=np.int64)
        arrays.append(arr.astype(np.int64))
    starts, total = aligned_starts([a.size for a in arrays])  # each view 16-byte aligned
    buf = np.zeros(total, dtype=np.int64)
    for a, at in zip(arrays, starts):
        buf[at:at + a.size] = a.ravel()
    flat = torch.from_numpy(buf).to(device)
    views = [flat[at:at + a.size].view(a.shape) for a, at in zip(arrays, starts)]
    return FusedCompressorPlan(*views)


def compress_prefill_fused(comp: torch.nn.Module, kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor,
                           plan: FusedCompressorPlan, store, inv_freq: torch.Tensor, ops) -> None:
    """``Compressor.forward`` for every request of the step (kv = ``comp.wkv(x)``, gate =
    ``comp.wgate(x)`` [T, coff * dim]) into ``store`` (a ``CompressorStore``): the new
    requests' rings zeroed as ``Compressor._reset_ring`` does, then ``ops.compressor_prefill``."""
    if plan.new_slots.shape[0]:
        store.ring.index_fill_(0, plan.new_slots, 0.0)
    ops.compressor_prefill(kv, gate, comp.ape, positions, store.ring, store.entries, store.tail, comp.norm.weight,
                           comp.norm.eps, inv_freq, comp.ratio, comp.overlap, plan.win_src, plan.win_dest,
                           plan.win_pos, plan.tail_src, plan.tail_dest, plan.ring_src, plan.ring_dest)
