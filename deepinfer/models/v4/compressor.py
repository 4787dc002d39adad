"""KV compressors of the CSA / HCA branches and the lightning indexer (reference path).

A compressor turns every `ratio` consecutive tokens (a window, aligned at multiples of
ratio) into one entry: a softmax over `wgate(x) + ape[slot]` weights `wkv(x)` across
the window, then RMSNorm and RoPE at the window's first position. CSA (ratio 4)
overlaps windows: each token projects two halves, Ca (feeds the NEXT window) and Cb
(feeds its own), so entry w mixes Ca of window w-1 with Cb of window w. HCA (ratio 128)
uses disjoint windows.

Streaming: a window can span steps (chunked prefill, decode), so the projections of the
tokens of the open window (and, for CSA, the previous window's Ca) live in the
request's state-slot ring, indexed by position mod ring size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer import batch_invariant

from .. import invariant_ops
from ..linear import Linear
from ..norm import RMSNorm
from ..paged_batch import SeqMeta, gather_rows, scatter_rows
from ..rope import Rotary, apply_rope


@dataclass
class CompressorStore:
    """Where one compressor keeps its entries for a layer: the paged entry pool, the
    request-slot ring and, for overlapping compressors, the per-block tail."""

    entries: torch.Tensor  # [blocks, block_size // ratio, dim]
    ring: torch.Tensor  # [slots, ring_len, 2, coff * dim] float32 (kv, score)
    tail: torch.Tensor | None  # [blocks, ratio, 2, dim] float32: Ca rows at each block end
    group: str


class Compressor(nn.Module):
    """One compressor (`attn.compressor` or `attn.indexer.compressor`)."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        coff = 2 if overlap else 1
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.wkv = Linear(hidden, coff * dim, dtype)
        self.wgate = Linear(hidden, coff * dim, dtype)
        self.norm = RMSNorm(dim, eps)
        self.ape = nn.Parameter(torch.zeros(ratio, coff * dim, dtype=torch.float32))

    @property
    def ring_len(self) -> int:
        return 2 * self.ratio if self.overlap else self.ratio

    def forward(self, x: torch.Tensor, seq: SeqMeta, store: CompressorStore, rotary: Rotary,
                block_size: int) -> int:
        """Project this step's tokens of one request, emit the entries of every window that
        closes in [start, end) into the paged pool, and update the ring. Returns the number
        of entries now available (end // ratio)."""
        r, s, e = self.ratio, seq.start, seq.start + seq.length
        pos = torch.arange(s, e, device=x.device)
        kv = self.wkv(x)
        sc = self.wgate(x) + self.ape[pos % r]  # float32 scores, as the checkpoint's ape is
        lo = max(0, (s // r) * r - (r if self.overlap else 0))
        ring = store.ring[seq.slot]
        if seq.is_new:
            self._reset_ring(ring, seq, store, block_size)
        ring_len = ring.shape[0]  # >= self.ring_len: speculative decoding widens it (deepinfer/spec/kv.py)
        hist = torch.arange(lo, s, device=x.device) % ring_len
        kv_seq = torch.cat([ring[hist, 0].to(kv.dtype), kv])
        sc_seq = torch.cat([ring[hist, 1], sc.float()])
        w_a, w_b = s // r, e // r - 1
        if w_b >= w_a:
            entries = self._pool(kv_seq, sc_seq, lo, w_a, w_b, rotary)
            scatter_rows(store.entries, seq.block_table[store.group], w_a, entries)
        keep = torch.arange(max(lo, e - ring_len), e, device=x.device)
        ring[keep % ring_len, 0] = kv_seq[keep - lo].float()
        ring[keep % ring_len, 1] = sc_seq[keep - lo]
        if store.tail is not None:
            self._save_tails(kv_seq, sc_seq, lo, s, e, seq, store, block_size)
        return e // r

    def _pool(self, kv_seq: torch.Tensor, sc_seq: torch.Tensor, lo: int, w_a: int, w_b: int,
              rotary: Rotary) -> torch.Tensor:
        r, d = self.ratio, self.dim
        w = torch.arange(w_a, w_b + 1, device=kv_seq.device)
        j = torch.arange(r, device=kv_seq.device)
        own = (w[:, None] * r + j[None, :]) - lo  # rows of each window's own tokens
        if self.overlap:
            n = w.shape[0]
            kv_win = kv_seq.new_zeros(n, 2 * r, d)
            sc_win = sc_seq.new_full((n, 2 * r, d), float("-inf"))
            kv_win[:, r:], sc_win[:, r:] = kv_seq[own][..., d:], sc_seq[own][..., d:]
            has_prev = w >= 1
            prev = (own - r).clamp(min=0)
            kv_win[has_prev, :r] = kv_seq[prev[has_prev]][..., :d]
            sc_win[has_prev, :r] = sc_seq[prev[has_prev]][..., :d]
        else:
            kv_win, sc_win = kv_seq[own], sc_seq[own]
        weights = sc_win.softmax(dim=1, dtype=torch.float32).to(kv_win.dtype)
        pooled = self.norm((kv_win * weights).sum(dim=1))
        cos, sin = rotary.cos_sin(w * r, pooled.dtype)
        return apply_rope(pooled, cos, sin)

    def _reset_ring(self, ring: torch.Tensor, seq: SeqMeta, store: CompressorStore, block_size: int) -> None:
        """A (re)admitted request starts at a block boundary: nothing of an open window
        exists yet; an overlapping compressor restores the previous window's Ca rows from
        the tail saved with the last prefix-cached block."""
        ring.zero_()
        if not (self.overlap and seq.start > 0):
            return
        r, d = self.ratio, self.dim
        block = seq.block_table[store.group][seq.start // block_size - 1]
        rows = torch.arange(seq.start - r, seq.start, device=ring.device) % ring.shape[0]
        ring[rows, 0, :d] = store.tail[block, :, 0]
        ring[rows, 1, :d] = store.tail[block, :, 1]
        ring[rows, 1, d:] = float("-inf")  # Cb of a complete window is never read again

    def _save_tails(self, kv_seq: torch.Tensor, sc_seq: torch.Tensor, lo: int, s: int, e: int, seq: SeqMeta,
                    store: CompressorStore, block_size: int) -> None:
        d, r = self.dim, self.ratio
        table = seq.block_table[store.group]
        for boundary in range((s // block_size + 1) * block_size, e + 1, block_size):
            rows = torch.arange(boundary - r, boundary, device=kv_seq.device) - lo
            block = table[boundary // block_size - 1]
            store.tail[block, :, 0] = kv_seq[rows, :d].float()
            store.tail[block, :, 1] = sc_seq[rows, :d]


def read_entries(store: CompressorStore, seq: SeqMeta, count: int) -> torch.Tensor:
    """Entries [0, count) of one request."""
    return gather_rows(store.entries, seq.block_table[store.group], 0, count)


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: scores every visible compressed entry with
    sum_h w_h * relu(q_h . k) and keeps the top `index_topk` per query."""

    def __init__(self, hidden: int, q_lora: int, n_heads: int, dim: int, ratio: int, topk: int, eps: float,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.n_heads, self.dim, self.ratio, self.topk = n_heads, dim, ratio, topk
        self.wq_b = Linear(q_lora, n_heads * dim, dtype)
        self.weights_proj = Linear(hidden, n_heads, dtype)
        self.compressor = Compressor(hidden, dim, ratio, True, eps, dtype)

    def select(self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
               rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k entry ids per query and their validity: ([L, k] int64, [L, k] bool)."""
        n_entries = keys.shape[0]
        q = self.wq_b(q_residual).view(-1, self.n_heads, self.dim)
        cos, sin = rotary.cos_sin(positions, q.dtype)
        q = apply_rope(q, cos, sin)
        weights = self.weights_proj(x).float() * self.n_heads ** -0.5
        if batch_invariant.enabled():  # queries and keys both blocked; heads summed in order
            flat = invariant_ops.matmul_nt(q.float().reshape(-1, self.dim), keys.float())
            scores = torch.relu(flat.view(q.shape[0], self.n_heads, n_entries)) * self.dim ** -0.5
            index_scores = scores[:, 0] * weights[:, 0, None]
            for h in range(1, self.n_heads):
                index_scores = index_scores + scores[:, h] * weights[:, h, None]
        else:
            scores = torch.relu(torch.einsum("lhd,nd->lhn", q.float(), keys.float())) * self.dim ** -0.5
            index_scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [L, n]
        limit = (positions + 1) // self.ratio  # entries a query may see
        future = torch.arange(n_entries, device=x.device)[None, :] >= limit[:, None]
        index_scores = index_scores.masked_fill(future, float("-inf"))
        k = min(self.topk, n_entries)
        # Exact ties are common (an entry whose every head's q.k is negative scores 0), so
        # pin the order: highest score first, lowest entry id among equals. torch.topk
        # leaves ties unspecified, which would make chunked and full prefill disagree.
        top = torch.sort(index_scores, dim=-1, descending=True, stable=True).indices[:, :k]
        return top, top < limit[:, None]
