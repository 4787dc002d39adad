"""Batched attention of a prefill / mixed step: ``Attention.forward`` for every request at
once (no Python loop over requests or rows).

Order of work, as the reference does per request: project q / kv for all rows, write
every row's window KV into the paged pool, run the compressor(s) over the whole step
(models/fast/prefill_compressor_fused.py: two launches each), select CSA entries with the prefill indexer, then one
``prefill_attention`` kernel call reads each row's window + compressed keys from the pools.
"""

from __future__ import annotations

import torch

from ...fast.decode import _inv_freq
from ...fast.prefill_compressor_fused import compress_prefill_fused
from ...fast.prefill_meta import PrefillMeta
from ...rope import Rotary
from ..kv_cache import GROUP_CSA, GROUP_SWA, KVCache
from .decode import attention_inputs

#: Heads of one attention program at most, and rows x heads that window / HCA layers tile
#: rows up to. At V4-Flash widths (64 heads x 512) one 64-head program per row with 64-key
#: blocks nearly halved an 8k prefill's HCA and CSA layer times on an H200 against 32-head
#: programs with 32-key blocks (profiling/prefill_attention_tuning.py,
#: profiling/results/prefill_attention_tuning_h200.json; numbers in docs/measurements.md).
ATTN_HEADS = 64
ATTN_ROWS = 32
#: Query rows of one indexer program.
INDEX_TILE = 64


def attention_prefill(attn: torch.nn.Module, x: torch.Tensor, meta: PrefillMeta, cache: KVCache,
                      rotary_main: Rotary, rotary_compress: Rotary) -> torch.Tensor:
    """One layer's attention: x [T, hidden] (normed sublayer input) -> [T, hidden].

    Launches as the decode path's (shared fused weights): one GEMM for every projection
    of x, q_norm, one GEMM for wq_b (+ the indexer's), q / kv norm + RoPE (kv written
    into the window pool), the compressors, indexer scores + top-k, the attention
    kernel, the output's inverse RoPE, wo_a, wo_b."""
    cfg, ops, pos = attn.cfg, meta.ops, meta.positions
    n = x.shape[0]
    inv = _inv_freq(rotary_compress if attn.ratio else rotary_main, x.device)
    comp, ix = attn.compressor, attn.indexer
    swa = cache.swa[attn.cache_id]  # the same projections (and fused-weight keys) as attention_decode
    proj, q_side, q = attention_inputs(attn, x, ops, pos, inv, swa, meta.row_tables(GROUP_SWA))
    kv_store, index_store = attn._stores(cache)
    extra = {}
    block_h = max(16, min(ATTN_HEADS, 1 << (attn.n_heads - 1).bit_length()))
    block_t = max(1, ATTN_ROWS // block_h)
    block_n = 64 if block_h >= 64 else 32
    if comp is not None:
        compress_prefill_fused(comp, proj[2], proj[3], pos, meta.fused_plan(comp, kv_store), kv_store, inv, ops)
        extra = dict(comp_pool=kv_store.entries, comp_table=meta.tables32[kv_store.group], ratio=attn.ratio)
        if ix is not None:
            compress_prefill_fused(ix.compressor, proj[4], proj[5], pos, meta.fused_plan(ix.compressor, index_store),
                                   index_store, inv, ops)
            iq = ops.norm_rope(q_side[1].view(n, ix.n_heads, ix.dim), pos, inv, "none")
            iw = proj[6].float() * ix.n_heads ** -0.5
            extra["topk_idx"] = ops.prefill_indexer_topk(
                iq, iw, pos, meta.row_req, index_store.entries, meta.tables32[GROUP_CSA], attn.ratio, ix.topk,
                meta.n_entries_max(attn.ratio), meta.tiles(INDEX_TILE), host_tiles=meta.tiles(INDEX_TILE, host=True))
            block_t = 1
    o = ops.prefill_attention(q, pos, meta.row_req, swa, meta.tables32[GROUP_SWA], attn.window, attn.attn_sink,
                              **extra, tiles=meta.tiles(block_t) if block_t > 1 else None, block_t=block_t,
                              block_h=block_h, block_n=block_n)
    o = ops.norm_rope(o, pos, inv, "none", inverse=True, out_dtype=x.dtype)
    return attn.wo_b(attn.wo_a(o.view(n, cfg.o_groups, -1)))
