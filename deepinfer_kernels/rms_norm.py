"""RMSNorm kernel (weighted, unweighted, and with a fused residual add).

Math (one row of width D, float32 inside, ``round`` = round to the input dtype):

* weighted (``deepinfer.models.norm.RMSNorm``):
  ``y = round(w * round(x * rsqrt(mean(x^2) + eps)))`` with the float32 weight;
* unweighted (``unweighted_rms_norm``, weight=None):
  ``y = round(x * round(rsqrt(mean(x^2) + eps)))``;
* residual: ``h = round(x + residual)`` first, then the norm of ``h``; returns ``(y, h)``.

Output dtype = input dtype. One program normalises ``ROWS`` rows held in registers.
"""

from __future__ import annotations

import types

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, next_pow2, round_to


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, n_rows, D, stride_x, stride_r, eps,
                     HAS_WEIGHT: tl.constexpr, HAS_RES: tl.constexpr, CODE: tl.constexpr,
                     INTERP: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < D)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = round_to(x + r, CODE, INTERP)
        tl.store(h_ptr + rows64[:, None] * D + cols[None, :], x.to(h_ptr.dtype.element_ty), mask=mask)
    ms = tl.sum(x * x, axis=1) / D
    inv = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
        y = round_to(x * inv[:, None], CODE, INTERP) * w[None, :]
    else:
        y = x * round_to(inv, CODE, INTERP)[:, None]
    y = round_to(y, CODE, INTERP)
    tl.store(out_ptr + rows64[:, None] * D + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] as a 2-D view/copy whose last dim is contiguous."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of `x` ([..., D], bf16/fp16/fp32).

    weight: float32 [D], or None for the unweighted norm. With `residual` (same shape
    and dtype as x) returns ``(norm(x + residual), x + residual)``, else ``norm(x)``.
    """
    check_device(x)
    d = x.shape[-1]
    x2 = _rows(x)
    n = x2.shape[0]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty_like(out) if residual is not None else out
    r2 = _rows(residual) if residual is not None else x2
    if weight is not None:
        assert weight.shape == (d,), f"weight {tuple(weight.shape)} != ({d},)"
        weight = weight.float().contiguous()
    block_d = next_pow2(d)
    rows = max(1, min(16, 4096 // block_d))
    warps = 4 if block_d * rows <= 4096 else (8 if block_d * rows <= 8192 else 16)
    if n:
        _rms_norm_kernel[(triton.cdiv(n, rows),)](
            x2, r2, weight if weight is not None else x2, out, h, n, d, x2.stride(0), r2.stride(0), float(eps),
            HAS_WEIGHT=weight is not None, HAS_RES=residual is not None, CODE=dtype_code(x.dtype),
            INTERP=interpreting(), ROWS=rows, BLOCK_D=block_d, num_warps=warps)
    return (out, h) if residual is not None else out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference with the signature of :func:`rms_norm`: calls the model's own
    ``RMSNorm.forward`` / ``unweighted_rms_norm``."""
    from deepinfer.models.norm import RMSNorm, unweighted_rms_norm

    h = x + residual if residual is not None else x
    if weight is None:
        y = unweighted_rms_norm(h, eps)
    else:
        y = RMSNorm.forward(types.SimpleNamespace(weight=weight, eps=eps), h)
    return (y, h) if residual is not None else y
