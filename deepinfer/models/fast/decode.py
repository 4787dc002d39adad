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

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from ..rope import Rotary
from ..v4.kv_cache import GROUP_CSA, GROUP_HCA, GROUP_SWA
from .fused_weights import attention_inputs
from .invariant import compress_decode, is_invariant


def kernel_ops(kind: str) -> SimpleNamespace:
    """The batched ops: ``"triton"`` (deepinfer_kernels) or ``"ref"`` (their torch
    references: per-request loops with host reads, for CPU tests only)."""
    from deepinfer_kernels import argmax_lse as am
    from deepinfer_kernels import compressor_decode as cd
    from deepinfer_kernels import decode_attention as da
    from deepinfer_kernels import engram as eg
    from deepinfer_kernels import hc_collapse as hcc
    from deepinfer_kernels import fused_moe as fm
    from deepinfer_kernels import fused_moe_w8a8 as w8
    from deepinfer_kernels import indexer_topk as it
    from deepinfer_kernels import mhc
    from deepinfer_kernels import norm_rope as nr
    from deepinfer_kernels import rms_norm as rn
    from deepinfer_kernels import router as rt
    from deepinfer_kernels import linear_f32 as lf
    from deepinfer_kernels import skinny_gemm as sg

    if kind not in ("triton", "ref"):
        raise ValueError(f"unknown fast-path op kind {kind!r}")
    sfx = "" if kind == "triton" else "_ref"
    mods = {"decode_attention": da, "indexer_topk": it, "router": rt, "fused_moe": fm, "hc_pre": mhc,
            "hc_post_pre": mhc, "hc_head": mhc, "compressor_decode": cd, "norm_rope": nr, "rms_norm": rn,
            "fused_moe_w8a8": w8, "skinny_linear": sg, "skinny_grouped_linear": sg, "argmax_logsumexp": am,
            "hc_shifted": mhc, "indexer_scores": it, "engram_hash": eg,
            "engram_gate": eg, "linear_f32": lf,
            "hc_collapse_norm": hcc}
    return SimpleNamespace(kind=kind, **{name: getattr(mod, name + sfx) for name, mod in mods.items()})


@dataclass
class DecodeMeta:
    """Device inputs of a pure-decode step (views of the runner's :class:`StepInputs`).

    ids, positions, slots (compressor ring slots): [R] int32 per row; tables: group ->
    [R, width] int32 physical block ids (padding = 0, never read for a visible row);
    starts [R + 1]: each request's rows (consecutive positions; None = one row each);
    ``graphed``: the step replays a CUDA graph (R is then its padded bucket); ``n_rows``:
    the real rows."""

    positions: torch.Tensor
    slots: torch.Tensor
    tables32: dict[str, torch.Tensor]
    width: int
    ops: Any
    ids: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    graphed: bool = False
    n_rows: int = 0


def _inv_freq(rotary: Rotary, device: torch.device) -> torch.Tensor:
    """``rotary.inv_freq`` kept on the device (Rotary moves it from the host per call,
    which a graph capture forbids)."""
    inv = getattr(rotary, "_inv_freq_dev", None)
    if inv is None or inv.device != device:
        inv = rotary._inv_freq_dev = rotary.inv_freq.to(device)
    return inv


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


#: Decode steps with at most this many rows run the attention's dense ``wo_a`` on the
#: grouped skinny GEMM (deepinfer_kernels/skinny_gemm.py) instead of cuBLAS's batched GEMM, when its
#: weight is at most SKINNY_GROUPED_MAX_BYTES: at batch 1 on an H200 it beat cuBLAS on
#: `mini`'s 4 MB weights and lost on `flash4`'s 64 MB ones, which cuBLAS already streams near
#: the copy ceiling (fastpath_bench_h200_dfcd675.json vs fastpath_bench_h200_044b4fc.json;
#: numbers in docs/measurements.md).
SKINNY_GROUPED_MAX_ROWS = 16
SKINNY_GROUPED_MAX_BYTES = 16 << 20


def grouped_out(wo_a: torch.nn.Module, x: torch.Tensor, ops: Any) -> torch.Tensor:
    """``wo_a(x)`` for x [T, groups, in]: a small dense weight of x's dtype and a small step
    take one grouped skinny GEMM launch, anything else the module (cuBLAS bmm, FP8 GEMM; in
    batch-invariant mode its fixed-tile GEMMs)."""
    w = wo_a._parameters.get("weight")
    if (w is not None and not is_invariant(ops) and wo_a.quantized is None and x.shape[0] <= SKINNY_GROUPED_MAX_ROWS and w.dtype == x.dtype
            and w.numel() * w.element_size() <= SKINNY_GROUPED_MAX_BYTES and (w.shape[0] // wo_a.groups) % 16 == 0):
        return ops.skinny_grouped_linear(x, w)
    return wo_a(x)


__all__ = ["DecodeMeta", "GROUP_CSA", "GROUP_HCA", "attention_decode", "kernel_ops"]
