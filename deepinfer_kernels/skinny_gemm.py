"""GEMM for a few rows against a wide weight: ``y = x @ W^T`` for x [M <= 64, K] and a
dense W [N, K] (the LM head of a decode step: M = the step's sampled rows, N = vocab).

Why a kernel: the product is a pure weight stream (a `mini` head is 129,280 x 1,024 bf16,
265 MB): one program per BLOCK_N output columns walks K with the rows padded to one
16-row MMA tile, so W is read once at full width. On an H200 (kernel_bench_h200.json,
``skinny`` section, graphed) it streams the mini / V4-Flash heads near the copy ceiling for
M <= 16, at least as fast as cuBLAS; at M = 64 cuBLAS is faster, so the engine keeps
F.linear there (numbers in docs/measurements.md).

The kernel is ``batch_invariant_matmul``'s row-tile GEMM (one tile walks K in fixed
steps) launched with few-row tiles and many column programs. Numerics: float32
accumulation (IEEE for float32 inputs), rounded once to the activation dtype (what
F.linear returns); the result may be stored as float32 holding those rounded values (the
logits the sampler takes, without a separate cast).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from ._common import check_device, dtype_code, interpreting
from .batch_invariant_matmul import _matmul_nt_kernel  # the same row-tile GEMM, launched with few-row tiles

MAX_ROWS = 64


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
    _launch(x, w, y, k, dict(config or _config(m)))
    return y


def _launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, k: int, cfg: dict[str, int], **group: int) -> None:
    """The row-tile GEMM over x's rows (row stride ``x.stride(0)``) and w's rows into y;
    ``group``: GROUP_N / stride_ag of a block-diagonal w."""
    m, n = y.shape
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    _matmul_nt_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        CODE=dtype_code(x.dtype), INTERP=interpreting(), EVEN_K=k % bk == 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **group, **cfg)


def skinny_linear_ref(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
                      config: dict[str, int] | None = None) -> torch.Tensor:
    """Torch reference of :func:`skinny_linear`."""
    y = F.linear(x, w)
    return y if out_dtype is None else y.to(out_dtype)


def skinny_grouped_linear(x: torch.Tensor, w: torch.Tensor, config: dict[str, int] | None = None) -> torch.Tensor:
    """``GroupedLinear`` (the attention's ``wo_a``) for a few rows: x [M, G, K] (M <= 64),
    w [G * R, K] block-diagonal by rows (group g: rows [g R, (g + 1) R)) -> [M, G * R].
    One launch, every group's columns in its own programs. H200, batch 1: faster than
    cuBLAS's batched GEMM on a `mini` layer (4 MB), slower on a V4-Flash layer (64 MB), so
    the engine keeps cuBLAS for large weights (models/fast/decode.py: grouped_out; numbers
    in docs/measurements.md)."""
    check_device(x, w)
    if x.dim() != 3 or w.dim() != 2 or x.shape[2] != w.shape[1] or w.shape[0] % x.shape[1]:
        raise ValueError(f"skinny_grouped_linear: x must be [M, G, K] and w [G * R, K], got {tuple(x.shape)} "
                         f"and {tuple(w.shape)}")
    if x.shape[0] > MAX_ROWS or x.dtype != w.dtype or w.stride(1) != 1:
        raise ValueError(f"skinny_grouped_linear: needs <= {MAX_ROWS} rows of w's dtype and a contiguous w, got "
                         f"{x.shape[0]} rows of {x.dtype} for {w.dtype}")
    m, g, k = x.shape
    n, rank = w.shape[0], w.shape[0] // g
    cfg = dict(config or _config(m))
    if config is None:  # column programs never straddle two groups
        cfg["BLOCK_N"] = min(cfg["BLOCK_N"], rank & -rank)
    bn = cfg["BLOCK_N"]
    if rank % bn or bn < 16:
        raise ValueError(f"skinny_grouped_linear: rank {rank} per group is not a multiple of {max(bn, 16)} columns")
    if x.stride(2) != 1:
        x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    _launch(x, w, y, k, cfg, GROUP_N=rank, stride_ag=x.stride(1))
    return y


def skinny_grouped_linear_ref(x: torch.Tensor, w: torch.Tensor, config: dict[str, int] | None = None
                              ) -> torch.Tensor:
    """Torch reference of :func:`skinny_grouped_linear` (``GroupedLinear.forward``'s bmm)."""
    m, g, k = x.shape
    y = torch.bmm(x.transpose(0, 1), w.view(g, -1, k).transpose(1, 2))  # [G, M, R]
    return y.transpose(0, 1).reshape(m, -1)
