"""KV rollback support: size the compressors' per-request rings for speculative verify.

A compressor ring keeps the (kv, score) projections of recent positions at row
``position % ring_len``. A verify step writes positions s..e-1 (drafts included); when
drafts are rejected the next step starts at s' <= e and reads history [lo', s') with
s' - lo' <= 2*ratio - 1 (CSA) or ratio - 1 (HCA). Those rows must not have been
overwritten by rejected positions [s', e), e - s' <= k: the ring must hold the last
e - lo' <= base + k positions, so it gets ``k + 1`` extra rows (base = 2*ratio / ratio).
The compressor uses the ring tensor's length as its modulus (`Compressor.ring_len` of
the store), so widening the tensors here is the whole fix. Compressed entries, CSA block
tails and window rows written for rejected positions are rewritten when those positions
are recomputed, and readers only see entries < (valid length) // ratio.
"""

from __future__ import annotations

import torch


def widen_compressor_rings(cache, max_draft: int) -> None:
    """Reallocate every compressor ring of the cache (``cache.compressor_rings()``: a V4
    `KVCache`'s main and indexer rings, a V4.1 `KVCacheV41`'s ratio > 1 KV sources, the same
    rule with base = ratio) with ``max_draft + 1`` extra rows."""
    if max_draft <= 0:
        return
    for rings in cache.compressor_rings():
        for i, t in list(rings.items()):
            shape = list(t.shape)
            shape[1] += max_draft + 1
            rings[i] = torch.zeros(shape, dtype=t.dtype, device=t.device)
