"""Batch-invariant GEMM ``a @ b.T`` (the "linear" and "matmul_nt" ops of batch-invariant mode).

cuBLAS picks its kernel (tile shape, split-K) from M, so a row's bits change with the
number of rows it is computed with. Here one fixed tiling per dtype serves every M and
N: a grid of BLOCK_M x BLOCK_N output tiles, each walking K in BLOCK_K steps from 0 up
with a float32 accumulator, then rounded once to the output dtype (as torch's GEMM
rounds). Element (i, j) therefore depends only on row i of ``a`` and row j of ``b``:
neither on M, nor on N (the indexer's queries x keys, whose count changes every step),
nor on where row i sits in its tile.

``matmul_nt_ref`` is the torch reference of the same function (float32 products and
sums, one rounding); results agree within the dtype's tolerance, not bitwise (the
order of the K sum differs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, round_to
from .batch_invariant_common import bi_dot

__all__ = ["matmul_nt", "matmul_nt_ref", "linear", "tile_config"]


@triton.jit(do_not_specialize=["M", "N"])
def _matmul_nt_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                      CODE: tl.constexpr, INTERP: tl.constexpr, EVEN_K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_N: tl.constexpr = 0, stride_ag=0):
    # GROUP_N > 0 (a multiple of BLOCK_N): block-diagonal b, output columns
    # [g * GROUP_N, (g + 1) * GROUP_N) read a's K columns at offset g * stride_ag
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
    if GROUP_N > 0:
        a_ptrs += ((pid_n * BLOCK_N) // GROUP_N).to(tl.int64) * stride_ag
    b_ptrs = b_ptr + rn[None, :].to(tl.int64) * stride_bn + rk[:, None]  # [BLOCK_K, BLOCK_N] view of b^T
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:  # the K tail: masked lanes add exact zeros
            k_ok = (k0 + rk) < K
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = bi_dot(a, b, acc, CODE == 0, INTERP)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c = round_to(acc, CODE, INTERP)  # the interpreter's own cast truncates
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptrs, c.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def tile_config(dtype: torch.dtype) -> dict[str, int]:
    """The one tiling used for ``dtype`` (never a function of M or N)."""
    if interpreting():  # small tiles keep the CPU tests fast; any fixed tiling is invariant
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=1, num_stages=1)
    if dtype == torch.float32:  # IEEE float32 dots run on FMA units: small tiles
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    # bf16/fp16: BLOCK_N 128 keeps decode (M = 1..64) spread over enough SMs for
    # hidden-sized N while prefill tiles stay large enough for the tensor cores.
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)


def matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` for a [M, K], b [N, K] (same dtype: float32, bf16 or fp16; unit stride
    along K) -> [M, N] in a's dtype, bitwise independent of M and N per element."""
    check_device(a, b)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"matmul_nt needs a [M, K] and b [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"matmul_nt: a is {a.dtype} but b is {b.dtype}")
    a = a if a.stride(1) == 1 else a.contiguous()
    b = b if b.stride(1) == 1 else b.contiguous()
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_()
    cfg = tile_config(a.dtype)
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    _matmul_nt_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
        a, b, c, m, n, k, a.stride(0), b.stride(0), c.stride(0),
        CODE=dtype_code(a.dtype), INTERP=interpreting(), EVEN_K=k % bk == 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **cfg)
    return c


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` without bias for x [..., K], w [N, K] (the "linear" op)."""
    lead = x.shape[:-1]
    return matmul_nt(x.reshape(-1, x.shape[-1]), w).reshape(*lead, w.shape[0])


def matmul_nt_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`matmul_nt`: float32 products and sums, rounded once."""
    return (a.float() @ b.float().T).to(a.dtype)
