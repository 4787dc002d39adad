"""GEMM for a few rows against a wide weight: ``y = x @ W^T`` for x [M <= 64, K] and a
dense W [N, K] (the LM head of a decode step: M = the step's sampled rows, N = vocab).

Why a kernel: the product is a pure weight stream (a `mini` head is 129,280 x 1,024 bf16,
265 MB): one program per BLOCK_N output columns walks K with the rows padded to one
16-row MMA tile, so W is read once at full width. On an H200 (kernel_bench_h200.json,
``skinny`` section, graphed) it streams the mini / V4-Flash heads at 4.1-4.5 TB/s for
M <= 16, 1.0-1.1x cuBLAS; at M = 64 cuBLAS is faster (0.9x), so the engine keeps F.linear
there.

Numerics: float32 accumulation, rounded once to the activation dtype (what F.linear
returns); the result may be stored as float32 holding those rounded values (the logits
the sampler takes, without a separate cast).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, mma, round_to

MAX_ROWS = 64


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   CODE: tl.constexpr, INTERP: tl.constexpr, EVEN_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=mmask[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=nmask[None, :], other=0.0)
        else:
            km = (k0 + rk) < K
            a = tl.load(x_ptrs, mask=mmask[:, None] & km[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=nmask[None, :] & km[:, None], other=0.0)
        acc = mma(a, b, acc, INTERP)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = round_to(acc, CODE, INTERP)
    out = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def _config(m: int) -> dict[str, int]:
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
    return dict(BLOCK_M=16 if m <= 16 else 64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
                  config: dict[str, int] | None = None) -> torch.Tensor:
    """``F.linear(x, w)`` for x [M, K] with M <= 64 (bf16/fp16/fp32) and w [N, K] of x's
    dtype; ``out_dtype=torch.float32`` returns the same rounded values as float32."""
    check_device(x, w)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"skinny_linear: x must be [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"skinny_linear: x has {x.shape[0]} rows; at most {MAX_ROWS} (use F.linear)")
    if x.dtype != w.dtype:
        raise ValueError(f"skinny_linear: x is {x.dtype} but w is {w.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        raise ValueError("skinny_linear: w needs a contiguous last dimension")
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = dict(config or _config(m))
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    _skinny_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        CODE=dtype_code(x.dtype), INTERP=interpreting(), EVEN_K=k % bk == 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **cfg)
    return y


def skinny_linear_ref(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
                      config: dict[str, int] | None = None) -> torch.Tensor:
    """Torch reference of :func:`skinny_linear`."""
    y = F.linear(x, w)
    return y if out_dtype is None else y.to(out_dtype)
