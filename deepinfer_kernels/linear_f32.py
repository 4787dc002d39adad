"""A float32 linear of a few activation rows in one launch: ``F.linear(x.float(), w) / div``
for x [T, K] in the activation dtype and a float32 weight [N, K]. DeepSeek-V4.1 projects
in float32 where V4 uses the activation dtype: the router logits (``Gate41``: over
gate_temp) and the ratio-2 compressor's kv / gate projections of a decode step.

Why a kernel: the reference's steps (an upcast copy of x, cuBLAS's float32 GEMM, the
division) are up to three launches for a product of a few rows and a small weight; here x
is upcast as it is loaded and the division is the epilogue. Products and sums are float32
on the CUDA cores (not TF32) and the division IEEE, so only the order of the K-sum differs
from cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import check_device, interpreting, next_pow2


#: Rows of one launch at most: every row of the step in one register tile per program.
MAX_ROWS = 16


@triton.jit(do_not_specialize=["T"])
def _linear_f32_kernel(x_ptr, w_ptr, out_ptr, T, N, K, stride_x, div,
                       BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # a weight stream: one or two output columns per program (many programs, each reading
    # its weight rows once), products summed on the CUDA cores (a tensor-core dot would
    # round through TF32)
    rows = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, cmask = rows < T, cols < N
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :], mask=cmask[:, None] & kmask[None, :],
                    other=0.0)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    out = tl.div_rn(acc, tl.full([BLOCK_T, BLOCK_N], div, tl.float32))
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], out, mask=rmask[:, None] & cmask[None, :])


def linear_f32(x: torch.Tensor, w: torch.Tensor, div: float = 1.0) -> torch.Tensor:
    """Float32 [T, N] = x [T, K] (any float dtype) @ w [N, K] (float32)^T / div; more than
    MAX_ROWS rows take the reference (cuBLAS)."""
    check_device(x, w)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or w.dtype != torch.float32:
        raise ValueError(f"linear_f32: x [T, K] and a float32 w [N, K], got {tuple(x.shape)} and "
                         f"{tuple(w.shape)} {w.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    w = w.contiguous()
    t, k = x.shape
    e = w.shape[0]
    if t > MAX_ROWS:  # cuBLAS's float32 GEMM (an upcast copy first) is faster from here
        return linear_f32_ref(x, w, div)
    out = torch.empty(t, e, dtype=torch.float32, device=x.device)
    block_t = next_pow2(t)
    block_n = 1 if e <= 256 else 2  # one or two weight rows per program: N / block_n programs
    block_k = 32 if interpreting() else min(next_pow2(k), 4096 // (block_t * block_n))
    if t:
        _linear_f32_kernel[(triton.cdiv(e, block_n), 1)](
            x, w, out, t, e, k, x.stride(0), float(div), BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=4)
    return out


def linear_f32_ref(x: torch.Tensor, w: torch.Tensor, div: float = 1.0) -> torch.Tensor:
    """Torch reference of :func:`linear_f32` (``Gate41.forward``'s logits when div = gate_temp)."""
    y = F.linear(x.float(), w.float())
    return y if div == 1.0 else y / div
