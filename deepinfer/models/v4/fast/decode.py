"""Batched decode attention of DeepSeek-V4: a few query tokens per request (one, or a
token and its drafts), every request of the step at once, no Python loop over requests
and no host sync (CUDA-graph safe).

Mirrors ``Attention.forward`` / ``Compressor.forward`` / ``Indexer.select`` for the case
``seq.length <= MAX_ROWS and not seq.is_new`` (every kernel works per row; a request's rows
go through its compressors in order):

* the window KV row of each request is normed, rotated and scattered into the swa pool
  at its position (``norm_rope``);
* each compressor (``compressor_decode``, one launch) writes the token's (kv, score)
  projections into the request's ring slot; a window closes for the requests with
  ``(pos + 1) % ratio == 0``: its pooled entry is written into the entry the window owns
  (in the request's current, private block), likewise the overlap tail at a block end;
* CSA layers select entries with the indexer top-k (fixed ``index_topk`` slots, -1 =
  none), HCA layers read all visible entries; attention is ``decode_attention`` with
  ``max_keys`` derived from the (fixed) table width.

Every write is idempotent (the same inputs write the same values), so a step may run
twice (warm-up before a graph capture) without changing the cache.
"""

from __future__ import annotations

from typing import Any

import torch

from ...fast.decode import DecodeMeta, _inv_freq, grouped_out
from ...fast.fused_weights import project
from ...fast.invariant import compress_decode, is_invariant
from ..kv_cache import GROUP_CSA, GROUP_SWA


def attention_inputs(attn: torch.nn.Module, x: torch.Tensor, ops, positions: torch.Tensor, inv_freq: torch.Tensor,
                     swa_pool: torch.Tensor, swa_table: torch.Tensor
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """The projections every batched attention (decode and prefill) starts with: one GEMM
    for x's projections [wq_a, wkv, (compressor wkv, wgate), (indexer compressor wkv, wgate,
    weights_proj)], q_norm, one GEMM for [wq_b, (indexer wq_b)], the query's unweighted norm
    + RoPE, and kv's norm + RoPE written into the layer's window pool at ``positions``.
    Returns (x-side outputs, q-side outputs, q [T, heads, head_dim])."""
    cfg, comp, ix = attn.cfg, attn.compressor, attn.indexer
    x_side = [attn.wq_a, attn.wkv]
    if comp is not None:
        x_side += [comp.wkv, comp.wgate]
    if ix is not None:
        x_side += [ix.compressor.wkv, ix.compressor.wgate, ix.weights_proj]
    proj = project(attn, "x", x_side, x)
    q_res = ops.rms_norm(proj[0], attn.q_norm.weight, attn.q_norm.eps)
    q_side = project(attn, "q", [attn.wq_b] + ([ix.wq_b] if ix is not None else []), q_res)
    q = ops.norm_rope(q_side[0].view(x.shape[0], attn.n_heads, attn.head_dim), positions, inv_freq, "unweighted",
                      eps=cfg.rms_norm_eps)
    ops.norm_rope(proj[1], positions, inv_freq, "weighted", attn.kv_norm.weight, attn.kv_norm.eps,
                  pool=swa_pool, table=swa_table)
    return proj, q_side, q


def _compress(ops: Any, comp: torch.nn.Module, kv: torch.Tensor, score: torch.Tensor, meta: DecodeMeta,
              store: Any, inv_freq: torch.Tensor, block_size: int) -> None:
    """``Compressor.forward`` for one new token per request, all requests at once."""
    if is_invariant(ops):  # entries pooled by the kernel prefill steps use too
        return compress_decode(ops, comp, kv, score, meta, store, inv_freq, block_size)
    ops.compressor_decode(kv, score, comp.ape, meta.positions, meta.slots, store.ring, store.entries,
                          meta.tables32[store.group], store.tail, comp.norm.weight, comp.norm.eps, inv_freq,
                          comp.ratio, comp.overlap, block_size, row_starts=meta.starts)


def attention_decode(attn: torch.nn.Module, x: torch.Tensor, ctx: Any) -> torch.Tensor:
    """``Attention.forward`` for a pure-decode batch: x [R, hidden] (normed) -> [R, hidden].

    Launches: one GEMM for every projection of x (wq_a, wkv, the compressors' wkv/wgate,
    the indexer's weights_proj), q_norm, one GEMM for wq_b (+ the indexer's wq_b), the
    q and kv norm + RoPE (kv scattered into the window pool), one launch per compressor,
    indexer scores (query RoPE inside) + top-k, decode attention (+ its split merge; the
    output's inverse RoPE inside), wo_a, wo_b.
    """
    meta: DecodeMeta = ctx.batch.decode
    ops, cfg, cache, pos = meta.ops, attn.cfg, ctx.cache, meta.positions
    bs, n = cache.block_size, x.shape[0]
    inv = _inv_freq(ctx.rotary_compress if attn.ratio else ctx.rotary_main, x.device)
    comp, ix = attn.compressor, attn.indexer
    swa = cache.swa[attn.cache_id]
    proj, q_side, q = attention_inputs(attn, x, ops, pos, inv, swa, meta.tables32[GROUP_SWA])
    kv_store, index_store = attn._stores(cache)
    comp_pool = comp_table = topk = None
    max_keys = attn.window
    if comp is not None:
        inv_c = _inv_freq(ctx.rotary_compress, x.device)
        _compress(ops, comp, proj[2], proj[3], meta, kv_store, inv_c, bs)
        comp_pool, comp_table = kv_store.entries, meta.tables32[kv_store.group]
        n_cols = meta.width * bs // attn.ratio
        if ix is not None:
            _compress(ops, ix.compressor, proj[4], proj[5], meta, index_store, inv_c, bs)
            iq = q_side[1].view(n, ix.n_heads, ix.dim)  # RoPE'd inside the scores kernel
            topk = ops.indexer_topk(iq, proj[6], pos, index_store.entries, meta.tables32[GROUP_CSA], attn.ratio,
                                    ix.topk, n_cols, weight_scale=ix.n_heads ** -0.5, rope_inv_freq=inv)
            max_keys += ix.topk
        else:
            max_keys += n_cols
    # the output's rope slice rotated back in the attention epilogue
    o = ops.decode_attention(q, pos, swa, meta.tables32[GROUP_SWA], attn.window, attn.attn_sink,
                             comp_pool, comp_table, attn.ratio if comp_pool is not None else 0, topk,
                             max_keys=max_keys, rope_inv_freq=inv)
    return attn.wo_b(grouped_out(attn.wo_a, o.view(n, cfg.o_groups, -1), ops))


__all__ = ["attention_decode", "attention_inputs"]
