"""Batch-invariant versions of the reference path's ops, and their dispatchers.

Each dispatcher (``linear``, ``sigmoid``, ``silu``, ``softplus``, ``grouped_linear``)
calls the plain torch op when batch-invariant mode is off, so the default path is
numerically unchanged; in the mode it calls a registered compiled kernel for the
tensor's device (:func:`deepinfer.batch_invariant.register_kernel`) or the torch
reference below.

What varies with the batch on CPU (torch 2.13 + MKL / oneDNN, AVX-512, 1 and 2 threads,
measured by tests/test_batch_invariance.py and profiling/batch_invariance_probe.py):

* ``F.linear`` / ``bmm`` in float32: MKL takes a GEMV path for one row and GEMM
  micro-kernels for more, and a row's bits depend on its place in the micro-kernel
  tile (M=3 agrees with M=2, M=4 does not); bfloat16 (oneDNN) differs for one row
  on large K. With one fixed M every row agrees bitwise at every position, whatever
  the other rows hold -> :func:`tiled_linear`.
* float32 ``sigmoid`` / ``silu`` / ``softplus``: the vectorised body and the scalar
  tail of the element-wise loop give different last bits (~4-10 % of inputs), and
  which elements land in the tail depends on the tensor's numel -> compositions of
  ``exp`` / ``log1p`` / add / div, whose two code paths agree bitwise.
* attention over a request's keys: the row length and the key offsets of the softmax
  and of the PV product depend on where the chunk starts and ends, so chunked prefill
  (which depends on the other requests' budget) changes a token's bits ->
  :mod:`deepinfer.models.invariant_attention`; the indexer's scores GEMM likewise
  -> :func:`matmul_nt` (rows and keys both blocked).

Invariant without the mode on CPU (row-wise kernels of a fixed row length): RMSNorm
and the unweighted norm, softmax / log_softmax over the last dim, exp, log, cos, sin,
sqrt, rsqrt (float32), casts, top-k / stable sort per row, the mHC small reductions
and ``hc_post``'s batched 4x4 matmul, the compressor's window softmax / sum, the MoE
combine (``index_add_`` adds each token's expert outputs in ascending expert id) and
the sampler (row-wise, counter-based RNG).

On CUDA two more families vary with the batch and get dispatchers here: torch's
reductions over the last dim choose their thread layout from the number of rows too
(fewer than 16 rows: up to 512 lanes per row; 16 or more: 32), which moves the bits
of RMSNorm's mean of squares -> :func:`mean_square` / :func:`row_sum` (the "row_sum"
kernel), and so does ``cumsum`` (CUB for one row, a tree sized by the row count for
more) -> :func:`row_cumsum` (the sampler's top-p); and batched matmuls pick their
cuBLAS kernel from the batch count -> :func:`stream_mix` / :func:`collapse_streams`
(mHC's per-token 4-stream products as explicit float32 sums in a fixed order, any
device).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer import batch_invariant as bi

__all__ = ["linear", "tiled_linear", "matmul_nt", "grouped_linear", "sigmoid", "silu", "softplus", "pad_rows",
           "row_sum", "mean_square", "row_cumsum", "stream_mix", "collapse_streams"]


def pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """A fresh contiguous copy of 2-D ``t`` with rows zero-padded to a multiple of
    ``multiple`` (fresh, so every GEMM operand has the allocator's alignment)."""
    pad = -t.shape[0] % multiple
    return F.pad(t, (0, 0, 0, pad)) if pad else t.clone(memory_format=torch.contiguous_format)


def _tiled_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [Mp, K] (Mp a multiple of ROW_TILE) @ b[N, K]^T, one GEMM per ROW_TILE rows."""
    tile, bt = bi.ROW_TILE, b.t()
    if a.shape[0] == tile:
        return torch.mm(a, bt)
    return torch.cat([torch.mm(a[i:i + tile], bt) for i in range(0, a.shape[0], tile)])


def tiled_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` with every GEMM at M = ROW_TILE: row i's bits never depend on how many
    rows come with it, where it sits among them or what they hold. x: [..., K]."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*lead, w.shape[0])
    out = _tiled_mm(pad_rows(x2, bi.ROW_TILE), w)[:m]
    return out.reshape(*lead, w.shape[0])


def matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` ([M, K] x [N, K] -> [M, N]) where both M and N depend on the step (the
    indexer's queries x compressed keys): rows in ROW_TILE tiles, b's rows in KEY_BLOCK
    blocks, so element (i, j) depends on neither M nor N."""
    kernel = bi.get_kernel("matmul_nt", a.device.type)
    if kernel is not None:
        return kernel(a, b)
    m, n = a.shape[0], b.shape[0]
    if m == 0 or n == 0:
        return a.new_zeros(m, n)
    ap, bp = pad_rows(a, bi.ROW_TILE), pad_rows(b, bi.KEY_BLOCK)
    blocks = [_tiled_mm(ap, bp[j:j + bi.KEY_BLOCK]) for j in range(0, bp.shape[0], bi.KEY_BLOCK)]
    return torch.cat(blocks, dim=1)[:m, :n]


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)``; in batch-invariant mode the registered kernel or :func:`tiled_linear`."""
    if not bi.enabled():
        return F.linear(x, w)
    kernel = bi.get_kernel("linear", x.device.type)
    return kernel(x, w) if kernel is not None else tiled_linear(x, w)


def grouped_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Block-diagonal projection: x [T, G, in], w [G, rank, in] -> [T, G * rank].
    Off the mode one batched GEMM; in it one invariant linear per group."""
    if not bi.enabled():
        y = torch.bmm(x.transpose(0, 1), w.transpose(1, 2))  # [G, T, rank]
        return y.transpose(0, 1).reshape(x.shape[0], -1)
    return torch.cat([linear(x[:, g], w[g]) for g in range(w.shape[0])], dim=-1)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``torch.sigmoid``; in the mode ``1 / (1 + exp(-x))`` computed in float32."""
    if not bi.enabled():
        return torch.sigmoid(x)
    xf = x.float()
    return torch.reciprocal(1.0 + torch.exp(-xf)).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``F.silu``; in the mode ``x / (1 + exp(-x))`` computed in float32."""
    if not bi.enabled():
        return F.silu(x)
    xf = x.float()
    return (xf / (1.0 + torch.exp(-xf))).to(x.dtype)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """``F.softplus`` (beta 1, threshold 20); in the mode ``log1p(exp(x))`` (x above 20
    kept as is, as torch does) computed in float32."""
    if not bi.enabled():
        return F.softplus(x)
    xf = x.float()
    return torch.where(xf > 20.0, xf, torch.log1p(torch.exp(xf.clamp(max=20.0)))).to(x.dtype)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """``x.sum(-1)``; in the mode, with a "row_sum" kernel for the device, float32 sums
    in an order fixed by the row length."""
    kernel = bi.get_kernel("row_sum", x.device.type) if bi.enabled() else None
    return x.sum(-1) if kernel is None else kernel(x, False)


def mean_square(x: torch.Tensor) -> torch.Tensor:
    """``x.float().pow(2).mean(-1, keepdim=True)`` (RMSNorm's statistic, float32); in the
    mode, with a "row_sum" kernel for the device, from its fixed-order sum of squares."""
    kernel = bi.get_kernel("row_sum", x.device.type) if bi.enabled() else None
    if kernel is None:
        return x.float().pow(2).mean(-1, keepdim=True)
    return kernel(x, True).unsqueeze(-1) / x.shape[-1]


def row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``x.cumsum(dim=-1)`` of a float32 [R, V] (the sampler's top-p mass); in the mode,
    with a "row_cumsum" kernel for the device, each row scanned in an order fixed by V
    (CUDA's own scan depends on the number of rows)."""
    kernel = bi.get_kernel("row_cumsum", x.device.type) if bi.enabled() else None
    return x.cumsum(dim=-1) if kernel is None else kernel(x)


def stream_mix(a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(a, s)`` for a [T, N, N], s [T, N, D] (mHC's stream mixing); in the
    mode ``sum_j a[:, :, j] * s[:, j]`` added in j order in float32, rounded once to
    s's dtype (a GEMM's own rounding), on every device."""
    if not bi.enabled():
        return torch.matmul(a, s)
    af, sf = a.float(), s.float()
    acc = af[:, :, 0, None] * sf[:, None, 0]
    for j in range(1, s.shape[1]):
        acc = acc + af[:, :, j, None] * sf[:, None, j]
    return acc.to(s.dtype)


def collapse_streams(pre: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``(pre.unsqueeze(-1) * s).sum(dim=1)`` for pre [T, N], s [T, N, D] (mHC's
    collapse, before the cast); in the mode the N products are added in stream order."""
    if not bi.enabled():
        return (pre.unsqueeze(-1) * s).sum(dim=1)
    acc = pre[:, 0, None] * s[:, 0]
    for j in range(1, s.shape[1]):
        acc = acc + pre[:, j, None] * s[:, j]
    return acc
