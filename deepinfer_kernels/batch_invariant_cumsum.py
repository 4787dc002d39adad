"""Batch-invariant prefix sums along the last dim (the "row_cumsum" op): the sampler's top-p mass.

torch's CUDA ``cumsum`` over the last dim scans a single row with CUB (a different
summation order, not run-to-run deterministic for floats) and several rows with a
Sklansky tree whose width it derives from the number of rows as well as the row
length, so the same row of probabilities gets different prefix sums in batches of
different sizes, and a token at the top-p boundary can flip. Here one program scans
one row in BLOCK-wide pieces, left to right: ``tl.cumsum`` inside a piece (its tree
fixed by BLOCK) plus the running total of the pieces before it.

``row_cumsum_ref`` is the torch reference (float32; same values within tolerance).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, next_pow2

__all__ = ["row_cumsum", "row_cumsum_ref"]


@triton.jit
def _row_cumsum_kernel(x_ptr, out_ptr, V, stride_x, stride_o, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    carry = tl.zeros([1], dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        ok = (v0 + cols) < V
        v = tl.load(x_ptr + r * stride_x + v0 + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * stride_o + v0 + cols, tl.cumsum(v, axis=0) + carry, mask=ok)
        carry += tl.sum(v, axis=0)


def row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x.cumsum(-1)`` for x [R, V], each row scanned in an order fixed by V."""
    check_device(x)
    if x.dim() != 2:
        raise ValueError(f"row_cumsum needs [R, V], got {tuple(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.numel():
        block = min(2048, next_pow2(x.shape[1]))
        _row_cumsum_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), out.stride(0), BLOCK=block,
                                          num_warps=4)
    return out


def row_cumsum_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`row_cumsum`."""
    return x.float().cumsum(dim=-1)
