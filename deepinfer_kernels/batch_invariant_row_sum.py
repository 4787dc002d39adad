"""Batch-invariant row sums (the "row_sum" op): ``x.float().sum(-1)`` or the sum of squares.

torch's CUDA reduction picks its thread layout from the number of rows as well as the
row length: with fewer than 16 rows a row is split over up to 512 lanes, with 16 or
more over 32, so RMSNorm's mean of squares (and every other ``sum(-1)``) of a decode
batch of 1 differs in the last bits from the same row in a batch of 64. Here every row
is reduced the same way: BLOCK_D-wide float32 partial sums walked along the row in a
fixed order, then one tree over the BLOCK_D lanes, with BLOCK_D, the row tile and the
warps fixed by the row length alone.

``row_sum_ref`` is the torch reference (same values within float32 tolerance; the
order of the additions differs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, interpreting, next_pow2

__all__ = ["row_sum", "row_sum_ref"]

ROWS_PER_PROGRAM = 4  # fixed: rows of one program never interact
INTERPRETER_ROWS_PER_PROGRAM = 256  # the interpreter's cost is per program, not per row


@triton.jit(do_not_specialize=["R"])
def _row_sum_kernel(x_ptr, out_ptr, R, D, stride_r, SQUARE: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < R
    cols = tl.arange(0, BLOCK_D)
    base = x_ptr + rows[:, None].to(tl.int64) * stride_r
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):  # masked lanes add exact zeros
        v = tl.load(base + d0 + cols[None, :], mask=r_ok[:, None] & ((d0 + cols) < D)[None, :], other=0.0)
        v = v.to(tl.float32)
        if SQUARE:
            v = v * v
        acc += v
    tl.store(out_ptr + rows, tl.sum(acc, axis=1), mask=r_ok)


def row_sum(x: torch.Tensor, square: bool = False) -> torch.Tensor:
    """float32 ``sum(x ** 2 if square else x, dim=-1)`` for x [..., D] (any float dtype),
    computed in float32 with a per-row order that depends on D only."""
    check_device(x)
    lead, d = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows and d:
        block_d = min(1024, next_pow2(d))
        interp = interpreting()
        block_r = INTERPRETER_ROWS_PER_PROGRAM if interp else ROWS_PER_PROGRAM
        warps = 1 if interp else max(1, min(8, block_d // 128))
        _row_sum_kernel[(triton.cdiv(rows, block_r),)](
            x2, out, rows, d, x2.stride(0), SQUARE=square, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps)
    elif rows:
        out.zero_()
    return out.reshape(lead)


def row_sum_ref(x: torch.Tensor, square: bool = False) -> torch.Tensor:
    """Torch reference of :func:`row_sum`."""
    xf = x.float()
    return (xf * xf if square else xf).sum(dim=-1)
