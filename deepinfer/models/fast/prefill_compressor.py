"""Batched compressor for prefill / mixed steps: ``Compressor.forward`` for every request
of the step at once (multi-token chunks), as a few gathers and scatters over index plans
built once per step on the host, instead of a Python loop over requests.

Per request (start s, length L, e = s + L, ring of ``ring_len`` rows) the reference reads
the ring rows of positions [lo, s) (lo = the open window's start, minus one window for
overlapping CSA compressors), appends the chunk's projections, pools every window that
closes in [s, e), writes the ring rows of the last ``ring_len`` positions and, at each
block end, the overlap tail. Here all requests' rows live in one source tensor
``[ring rows of every request ; the step's rows]`` and a :class:`CompressorPlan` holds,
for each of those reads and writes, its source rows and destination (slot, ring row,
entry block, tail block). Newly admitted requests first get their ring reset exactly as
the reference does (``Compressor._reset_ring``: zeros, or the tail of the last
prefix-cached block).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..paged_batch import SeqMeta
from ..rope import Rotary, apply_rope


@dataclass
class CompressorPlan:
    """Host-built indices of one step for compressors of one (ratio, overlap, ring_len,
    entry group); every tensor on the device, int64."""

    new_seqs: list[SeqMeta]  # rings to reset before reading
    hist_slot: torch.Tensor  # [Nh] ring rows read: slot ...
    hist_row: torch.Tensor  # [Nh] ... and row
    win_pos: torch.Tensor  # [Nw] first position of each closing window (its RoPE position)
    own: torch.Tensor  # [Nw, r] source rows of each window's own tokens
    prev_win: torch.Tensor  # [Np] windows with a previous window (overlap) ...
    prev: torch.Tensor  # [Np, r] ... and that window's source rows
    entry_blk: torch.Tensor  # [Nw] paged entry pool: block ...
    entry_sub: torch.Tensor  # [Nw] ... and row
    keep_slot: torch.Tensor  # [Nk] ring rows written: slot, row, source row
    keep_row: torch.Tensor
    keep_src: torch.Tensor
    tail_blk: torch.Tensor  # [Nt] overlap tails written at block ends ...
    tail_src: torch.Tensor  # [Nt, r] ... from these source rows


def build_plan(seqs: list[SeqMeta], ratio: int, overlap: bool, ring_len: int, group: str, per_block: int,
               block_size: int, device: torch.device) -> CompressorPlan:
    """The plan of one step (see the module doc); Python loops over requests only."""
    r = ratio
    n_hist = sum(s.start - max(0, (s.start // r) * r - (r if overlap else 0)) for s in seqs)
    lists: dict[str, list[np.ndarray]] = {k: [] for k in (
        "hist_slot", "hist_row", "win_pos", "own", "prev_win", "prev", "entry_blk", "entry_sub",
        "keep_slot", "keep_row", "keep_src", "tail_blk", "tail_src")}
    hist_base, n_win = 0, 0
    for seq in seqs:
        s, e = seq.start, seq.start + seq.length
        lo = max(0, (s // r) * r - (r if overlap else 0))
        table = np.asarray(seq.block_table[group], dtype=np.int64)

        def src(q: np.ndarray) -> np.ndarray:  # source row of position q of this request
            return np.where(q < s, hist_base + q - lo, n_hist + seq.offset + q - s)

        hist = np.arange(lo, s)
        lists["hist_slot"].append(np.full(len(hist), seq.slot))
        lists["hist_row"].append(hist % ring_len)
        w = np.arange(s // r, e // r)
        if len(w):
            j = np.arange(r)
            lists["win_pos"].append(w * r)
            lists["own"].append(src(w[:, None] * r + j[None, :]))
            if overlap:
                has_prev = w >= 1
                lists["prev_win"].append(n_win + np.nonzero(has_prev)[0])
                lists["prev"].append(src((w[has_prev] - 1)[:, None] * r + j[None, :]))
            lists["entry_blk"].append(table[w // per_block])
            lists["entry_sub"].append(w % per_block)
            n_win += len(w)
        keep = np.arange(max(lo, e - ring_len), e)
        lists["keep_slot"].append(np.full(len(keep), seq.slot))
        lists["keep_row"].append(keep % ring_len)
        lists["keep_src"].append(src(keep))
        if overlap:
            ends = np.arange((s // block_size + 1) * block_size, e + 1, block_size)
            if len(ends):
                lists["tail_blk"].append(table[ends // block_size - 1])
                lists["tail_src"].append(src(ends[:, None] - r + np.arange(r)[None, :]))
        hist_base += s - lo
    assert hist_base == n_hist

    def cat(name: str, cols: int = 0) -> torch.Tensor:
        parts = lists[name]
        arr = np.concatenate(parts) if parts else np.zeros((0, cols) if cols else 0, dtype=np.int64)
        return torch.from_numpy(arr.astype(np.int64)).to(device)

    return CompressorPlan(
        [s for s in seqs if s.is_new], cat("hist_slot"), cat("hist_row"), cat("win_pos"), cat("own", r),
        cat("prev_win"), cat("prev", r), cat("entry_blk"), cat("entry_sub"), cat("keep_slot"), cat("keep_row"),
        cat("keep_src"), cat("tail_blk"), cat("tail_src", r))


def compress_prefill(comp: torch.nn.Module, kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor,
                     plan: CompressorPlan, store, rotary: Rotary, block_size: int, pool=None) -> None:
    """``Compressor.forward`` for every request of the step, from the step's projections
    kv = ``comp.wkv(x)`` and gate = ``comp.wgate(x)`` [T, coff * dim]; ``store`` a
    ``CompressorStore``. Writes entries, rings and tails. ``pool(kv_src, sc_src)``, when
    given, writes the closing windows' entries instead of the torch pooling below
    (batch-invariant mode: models/v4/fast/invariant_prefill.py)."""
    r, d = comp.ratio, comp.dim
    sc = gate + comp.ape[positions % r]  # float32 scores, as the checkpoint's ape is
    ring = store.ring  # [slots, ring_len, 2, coff * d] float32
    for seq in plan.new_seqs:
        comp._reset_ring(ring[seq.slot], seq, store, block_size)
    hist = ring[plan.hist_slot, plan.hist_row]  # [Nh, 2, coff * d]
    kv_src = torch.cat([hist[:, 0].to(kv.dtype), kv])
    sc_src = torch.cat([hist[:, 1], sc.float()])
    n_win = plan.win_pos.shape[0]
    if pool is not None:
        pool(kv_src, sc_src)
    elif n_win:
        if comp.overlap:  # window w mixes Ca of window w-1 (first half) with its own Cb
            kv_win = kv_src.new_zeros(n_win, 2 * r, d)
            sc_win = sc_src.new_full((n_win, 2 * r, d), float("-inf"))
            kv_win[:, r:], sc_win[:, r:] = kv_src[plan.own][..., d:], sc_src[plan.own][..., d:]
            kv_win[plan.prev_win, :r] = kv_src[plan.prev][..., :d]
            sc_win[plan.prev_win, :r] = sc_src[plan.prev][..., :d]
        else:
            kv_win, sc_win = kv_src[plan.own], sc_src[plan.own]
        weights = sc_win.softmax(dim=1, dtype=torch.float32).to(kv_win.dtype)
        pooled = comp.norm((kv_win * weights).sum(dim=1))
        cos, sin = rotary.cos_sin(plan.win_pos, pooled.dtype)
        store.entries[plan.entry_blk, plan.entry_sub] = apply_rope(pooled, cos, sin).to(store.entries.dtype)
    ring[plan.keep_slot, plan.keep_row] = torch.stack([kv_src[plan.keep_src].float(), sc_src[plan.keep_src]], dim=1)
    if store.tail is not None and plan.tail_blk.shape[0]:
        store.tail[plan.tail_blk] = torch.stack([kv_src[plan.tail_src][..., :d].float(),
                                                 sc_src[plan.tail_src][..., :d]], dim=2)
