"""Batched attention of a prefill / mixed step: ``Attention.forward`` for every request at
once (no Python loop over requests or rows).

Order of work, as the reference does per request: project q / kv for all rows, write
every row's window KV into the paged pool, run the compressor(s) over the whole step
(:mod:`prefill_compressor`), select CSA entries with the prefill indexer, then one
``prefill_attention`` kernel call reads each row's window + compressed keys from the pools.
"""

from __future__ import annotations

import torch

from ..kv_cache import GROUP_CSA, GROUP_SWA, KVCache
from ..norm import unweighted_rms_norm
from ..rope import Rotary, apply_rope
from .prefill_compressor import compress_prefill
from .prefill_meta import PrefillMeta

#: Rows x heads of one attention program (window / HCA layers tile rows to reach it).
ATTN_ROWS = 32
#: Query rows of one indexer program.
INDEX_TILE = 64


def attention_prefill(attn: torch.nn.Module, x: torch.Tensor, meta: PrefillMeta, cache: KVCache,
                      rotary_main: Rotary, rotary_compress: Rotary) -> torch.Tensor:
    """One layer's attention: x [T, hidden] (normed sublayer input) -> [T, hidden]."""
    cfg, ops, pos, bs = attn.cfg, meta.ops, meta.positions, meta.block_size
    cos, sin = meta.cos_sin(rotary_compress if attn.ratio else rotary_main, x.dtype)
    q_res = attn.q_norm(attn.wq_a(x))
    q = unweighted_rms_norm(attn.wq_b(q_res).view(-1, attn.n_heads, attn.head_dim), cfg.rms_norm_eps)
    q = apply_rope(q, cos, sin)
    kv = apply_rope(attn.kv_norm(attn.wkv(x)), cos, sin)
    swa = cache.swa[attn.cache_id]
    swa[meta.swa_blk, meta.swa_sub] = kv.to(swa.dtype)
    kv_store, index_store = attn._stores(cache)
    comp = {}
    block_h = max(16, min(ATTN_ROWS, 1 << (attn.n_heads - 1).bit_length()))
    block_t = max(1, ATTN_ROWS // block_h)
    if attn.compressor is not None:
        compress_prefill(attn.compressor, x, pos, meta.plan(attn.compressor, kv_store), kv_store, rotary_compress, bs)
        comp = dict(comp_pool=kv_store.entries, comp_table=meta.tables32[kv_store.group], ratio=attn.ratio)
        if attn.indexer is not None:
            ix = attn.indexer
            compress_prefill(ix.compressor, x, pos, meta.plan(ix.compressor, index_store), index_store,
                             rotary_compress, bs)
            iq = apply_rope(ix.wq_b(q_res).view(-1, ix.n_heads, ix.dim), cos, sin)
            iw = ix.weights_proj(x).float() * ix.n_heads ** -0.5
            comp["topk_idx"] = ops.prefill_indexer_topk(
                iq, iw, pos, meta.row_req, index_store.entries, meta.tables32[GROUP_CSA], attn.ratio, ix.topk,
                meta.n_entries_max(attn.ratio), meta.tiles(INDEX_TILE))
            block_t = 1
    o = ops.prefill_attention(q, pos, meta.row_req, swa, meta.tables32[GROUP_SWA], attn.window, attn.attn_sink,
                              **comp, tiles=meta.tiles(block_t) if block_t > 1 else None, block_t=block_t,
                              block_h=block_h)
    o = apply_rope(o, cos, -sin)
    return attn.wo_b(attn.wo_a(o.reshape(o.shape[0], cfg.o_groups, -1)))
