"""Batch-invariant attention of one request (torch reference of the "attention" op).

The default path (`Attention._attend_one`) lays the keys out as one row per step:
window keys [k_lo, end) then the compressed entries, so a token's softmax row has a
length and key offsets that depend on where its chunk starts and ends. Chunk
boundaries depend on the other requests (token budget, prefix hits), so the default
path is not batch invariant even though it runs per request.

Here every query sees its keys in one canonical order, a function of its own position
only, and every reduction has a fixed shape and a fixed order:

* window: W slots, slot j = position ``p - W + 1 + j`` (slots before position 0 masked);
* compressed entries (CSA chosen by the indexer, HCA all visible): entry ids in blocks
  of KEY_BLOCK from id 0, zero-padded; entries a query cannot see are masked, and a
  block it cannot see at all adds an exact zero;
* queries in tiles of QUERY_TILE rows (zero-padded), so each GEMM (window logits,
  block logits, PV products) runs at one shape;
* softmax: max (exact in any order), then the denominator = exp(sink - max) + window
  sum + block sums in block order, and the output = window PV + block PVs in block
  order, divided at the end. Everything in float32; the result is cast to q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer import batch_invariant as bi

from .invariant_ops import pad_rows

__all__ = ["attend", "attend_reference"]


def attend(q: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor, k_lo: int, window: int,
           entries: torch.Tensor | None, entry_mask: torch.Tensor | None, sink: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Attention output of one request's queries, bitwise independent of its chunking.

    Args:
        q: [L, H, D] queries (after norm and RoPE).
        pos: [L] int64 query positions.
        keys: [Lk, D] window keys of positions [k_lo, k_lo + Lk) (K = V), covering every
            query's window (k_lo <= max(0, p - window + 1) and the last key is p's own).
        k_lo: position of ``keys[0]``.
        window: sliding-window length W.
        entries: [n, D] compressed entries (ids 0..n-1) or None.
        entry_mask: [L, n] bool, which entries each query attends to (None with entries None).
        sink: [H] per-head sink logits (no value).
        scale: logit scale (head_dim ** -0.5).

    Returns:
        [L, H, D] in q's dtype.
    """
    kernel = bi.get_kernel("attention", q.device.type)
    if kernel is not None:
        return kernel(q, pos, keys, k_lo, window, entries, entry_mask, sink, scale)
    return attend_reference(q, pos, keys, k_lo, window, entries, entry_mask, sink, scale)


def attend_reference(q: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor, k_lo: int, window: int,
                     entries: torch.Tensor | None, entry_mask: torch.Tensor | None, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """The torch implementation of :func:`attend` (same arguments), whatever kernel is registered."""
    n_q, heads, dim = q.shape
    qt, kb = bi.QUERY_TILE, bi.KEY_BLOCK
    qf = pad_rows(q.reshape(n_q, heads * dim).float(), qt).view(-1, heads, dim)
    padded = qf.shape[0]
    # Padding queries sit at the last real position: valid indices, results dropped.
    pos_p = torch.cat([pos, pos[-1:].expand(padded - n_q)])
    slot_pos = pos_p[:, None] - window + 1 + torch.arange(window, device=q.device)  # [Lp, W]
    slot_ok = slot_pos >= 0
    slot_idx = (slot_pos - k_lo).clamp(min=0)
    keys_f = keys.float()
    ent = mask = None
    if entries is not None and entries.shape[0] > 0:
        assert entry_mask is not None
        ent = pad_rows(entries.float(), kb)  # [n_pad, D]
        mask = torch.zeros(padded, ent.shape[0], dtype=torch.bool, device=q.device)
        mask[:n_q, :entries.shape[0]] = entry_mask
    sink_f = sink.float()
    tiles = [_tile(qf[t:t + qt], keys_f[slot_idx[t:t + qt]], slot_ok[t:t + qt], ent,
                   None if mask is None else mask[t:t + qt], sink_f, scale) for t in range(0, padded, qt)]
    out = tiles[0] if len(tiles) == 1 else torch.cat(tiles)
    return out[:n_q].to(q.dtype)


def _tile(q: torch.Tensor, kw: torch.Tensor, kw_ok: torch.Tensor, ent: torch.Tensor | None,
          ent_ok: torch.Tensor | None, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """One query tile: q [QT, H, D], window keys kw [QT, W, D] + validity [QT, W], entries
    [n_pad, D] + validity [QT, n_pad] (or None), sink [H] -> float32 [QT, H, D]."""
    qt, heads, dim = q.shape
    kb = bi.KEY_BLOCK
    neg_inf = float("-inf")
    lw = torch.bmm(q, kw.transpose(1, 2)) * scale  # [QT, H, W]
    lw = lw.masked_fill(~kw_ok[:, None, :], neg_inf)
    top = torch.maximum(lw.amax(dim=-1), sink[None, :])  # [QT, H]
    blocks: list[torch.Tensor] = []
    q2 = q.reshape(qt * heads, dim)
    if ent is not None and ent_ok is not None:
        for b in range(0, ent.shape[0], kb):
            lc = F.linear(q2, ent[b:b + kb]).view(qt, heads, kb) * scale
            lc = lc.masked_fill(~ent_ok[:, None, b:b + kb], neg_inf)
            blocks.append(lc)
            top = torch.maximum(top, lc.amax(dim=-1))
    top_e = top.unsqueeze(-1)
    pw = torch.exp(lw - top_e)
    denom = torch.exp(sink[None, :] - top) + pw.sum(dim=-1)
    acc = torch.bmm(pw, kw)  # [QT, H, D]
    for i, lc in enumerate(blocks):
        pc = torch.exp(lc - top_e)
        denom = denom + pc.sum(dim=-1)
        acc = acc + F.linear(pc.reshape(qt * heads, kb), ent[i * kb:(i + 1) * kb].t()).view(qt, heads, dim)
    return acc / denom.unsqueeze(-1)
