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
