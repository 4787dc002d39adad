"""Weights the fast path fuses once: several Linears that read the same input become one
GEMM over their concatenated weights (fewer launches, better GEMM shapes at small batch).

The concatenated tensor is built once and every Linear's weight becomes a view of it, so
memory is not doubled and the reference path keeps reading the same values. Linears that
carry quantized checkpoint bytes (``Linear.quantized``) are left alone: their own forward
dispatches the quantized GEMM.
"""

from __future__ import annotations

import torch
from .. import invariant_ops
from ..linear import Linear


def concat_linears(owner: torch.nn.Module, key: str, linears: list[Linear]) -> torch.Tensor | None:
    """[sum of out_features, in_features] weight of ``linears`` (cached on ``owner`` under
    ``key``), or None when any of them is quantized or they disagree on input width/dtype."""
    cache = owner.__dict__.setdefault("_fast_concat", {})
    hit = cache.get(key)
    if hit is not None and hit.data_ptr() == linears[0].weight.data_ptr():
        return hit
    if any(lin.quantized is not None for lin in linears):
        return None
    first = linears[0].weight
    if any(lin.weight.shape[1] != first.shape[1] or lin.weight.dtype != first.dtype for lin in linears):
        return None
    weight = torch.cat([lin.weight.data for lin in linears])
    offset = 0
    for lin in linears:
        lin.weight.data = weight[offset:offset + lin.out_features]
        offset += lin.out_features
    cache[key] = weight
    return weight


def project(owner: torch.nn.Module, key: str, linears: list[Linear], x: torch.Tensor) -> list[torch.Tensor]:
    """``[lin(x) for lin in linears]``, as one GEMM when the weights concatenate (the
    results are then column slices of one output: row-strided views)."""
    weight = concat_linears(owner, key, linears)
    if weight is None:
        return [lin(x) for lin in linears]
    # invariant_ops.linear: F.linear, or in batch-invariant mode the fixed-tile GEMM
    return list(invariant_ops.linear(x, weight).split([lin.out_features for lin in linears], dim=-1))


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
