"""Block-scaled FP8 GEMM (w8a8) for the checkpoint's FP8 e4m3 linears.

``C[m, n] = sum_kb (A_q[m, kb] . W_q[n, kb]) * a_scale[m, kb] * w_scale[n // BN_w, kb]``
(each K block's partial dot scaled once; steps narrower than a scale block are scaled
per step, the same value up to float32 rounding)

* ``W_q`` float8_e4m3fn [N, K] exactly as the checkpoint stores it, with its block
  scales [ceil(N / BN_w), ceil(K / BK_w)] as E8M0 bytes (uint8 / float8_e8m0fnu, decoded
  in the kernel) or float32; blocks (128, 128) for V4, (32, 32) for V4.1;
* ``A_q`` / ``a_scale``: the activations quantised per token and group of BK_w columns
  (:mod:`fp8_act_quant`), so every K step of the kernel multiplies one e4m3 block pair
  on the tensor cores (fp32 accumulation) and applies both scales once in float32;
* ``groups > 1``: the grouped low-rank output projection (``wo_a``): A is [M, G, K],
  group g uses weight rows [g * N/G, (g+1) * N/G) and writes those output columns.

The output is rounded once to ``out_dtype``. The K reduction runs in a fixed order (K
blocks ascending) whatever M is, so a row's result does not depend on the batch.

:func:`fp8_linear` sends prefill-sized, ungrouped GEMMs with (128, 128) weight blocks to
cuBLAS's block-scaled FP8 GEMM instead (``torch._scaled_mm`` with 1x128 activation and
128x128 weight scales, the same math): on an H200 at 8k rows it beats cuBLAS bf16 where
this kernel's best tiles do not quite reach it (profiling/fp8_prefill_tuning.py;
docs/measurements.md). Narrow outputs (N < 1024, where cuBLAS FP8 loses), decode-sized
batches and the grouped ``wo_a`` stay here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, round_to
from .fp8_act_quant import act_quant, act_quant_ref

_E8M0 = tuple(d for d in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)) if d is not None)


@triton.jit(do_not_specialize=["M"])  # token counts: one compiled variant for all
def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, M, N, K, n_ws_cols,
                     stride_am, stride_ag, stride_asm, stride_asg, stride_wn, stride_cm,
                     GK: tl.constexpr, GN: tl.constexpr, WS_E8M0: tl.constexpr, CODE: tl.constexpr, INTERP: tl.constexpr,
                     EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
    pid, g = tl.program_id(0), tl.program_id(1)
    # Grouped launch order: GROUP_M row tiles share each weight column tile in L2.
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows / columns past the edge wrap around (no load masks; not stored). The hints keep
    # the pointer analysis vectorised (clamping or masking the rows spills on sm_90).
    rm_c = tl.max_contiguous(tl.multiple_of(rm % M, BLOCK_M), BLOCK_M)
    rn_c = tl.max_contiguous(tl.multiple_of(rn % N, BLOCK_N), BLOCK_N)
    # Group g: its own activation slice and weight rows [g * N, (g+1) * N), as scalar base
    # offsets (N % GN == 0 when grouped; per-element group offsets spill on sm_90).
    a_ptr += g * stride_ag
    as_ptr += g * stride_asg
    w_ptr += g * N * stride_wn
    ws_ptr += (g * N // GN) * n_ws_cols
    c_ptr += g * N
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm_c.to(tl.int64)[:, None] * stride_am + kk[None, :]
    w_ptrs = w_ptr + rn_c.to(tl.int64)[None, :] * stride_wn + kk[:, None]
    as_ptrs = as_ptr + rm_c.to(tl.int64) * stride_asm
    ws_ptrs = ws_ptr + (rn_c // GN).to(tl.int64) * n_ws_cols
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # K steps of BLOCK_K (<= 64: wider steps spill registers) inside scale blocks of GK.
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(w_ptrs)
        else:
            a = tl.load(a_ptrs, mask=kk[None, :] < K - k0, other=0.0)
            b = tl.load(w_ptrs, mask=kk[:, None] < K - k0, other=0.0)
        kb = k0 // GK
        a_s = tl.load(as_ptrs + kb)
        if WS_E8M0:
            bits = tl.load(ws_ptrs + kb).to(tl.int32)
            w_s = tl.where(bits == 0, 0x00400000, bits << 23).to(tl.float32, bitcast=True)
        else:
            w_s = tl.load(ws_ptrs + kb)
        acc += tl.dot(a, b) * (a_s[:, None] * w_s[None, :])
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = round_to(acc, CODE, INTERP)  # round to nearest even (the interpreter's own cast truncates)
    c = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def _config(m: int, gk: int) -> dict[str, int]:
    """Tiles by token count. Decode (few rows) is weight-read bound: narrow tiles for more
    programs, K steps of 64. Prefill: 128x128 tiles with K steps of a whole 128 scale block
    (H200, 8k rows: near cuBLAS bf16, where K steps of 64 were well below it;
    profiling/results/fp8_prefill_tuning_h200_db38bed.json, docs/measurements.md)."""
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=min(32, gk), GROUP_M=4, num_warps=4, num_stages=1)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=min(64, gk), GROUP_M=1, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=min(128, gk), GROUP_M=8, num_warps=8, num_stages=3)


#: cuBLAS block-scaled FP8 from this many rows and output columns. H200: at 8k rows it wins
#: every N >= 1024; at 2k only the widest (wq_b, wo_b) beat the Triton kernel, at 256 none
#: (each call also costs host time: heuristics, launches; docs/measurements.md)
CUBLAS_MIN_ROWS, CUBLAS_MIN_N = 2048, 1024
#: cuBLAS rejects (CUBLAS_STATUS_NOT_SUPPORTED) block-scaled problems whose rows are not a
#: multiple of 16 (seen at 145 rows): the activations are padded to it
CUBLAS_ROW_PAD = 16


def use_cublas(m: int, n: int, k: int, block: tuple[int, int], groups: int, device: torch.device) -> bool:
    """Whether :func:`fp8_linear` takes cuBLAS's block-scaled GEMM for this problem: a CUDA
    device (not the interpreter), torch's ``_scaled_mm``, (128, 128) weight blocks (the
    only weight blocking cuBLAS scales), one group, and a prefill-sized problem."""
    return (device.type == "cuda" and not interpreting() and hasattr(torch, "_scaled_mm") and
            tuple(block) == (128, 128) and groups == 1 and m >= CUBLAS_MIN_ROWS and n >= CUBLAS_MIN_N and
            k % 128 == 0 and n % 16 == 0)


def _cached_scales_f32(w_scale: torch.Tensor) -> torch.Tensor:
    """The block scales as float32 (``deepinfer.models.quant.e8m0_to_float``), kept on the
    scale tensor (a checkpoint's scales do not change; decoding them per call cost launches
    on every prefill GEMM)."""
    cached = getattr(w_scale, "_deepinfer_f32", None)
    if cached is None or cached.device != w_scale.device:
        from deepinfer.models.quant import e8m0_to_float

        cached = e8m0_to_float(w_scale)
        w_scale._deepinfer_f32 = cached
    return cached


def fp8_gemm_cublas(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`fp8_gemm` for (128, 128) weight blocks through ``torch._scaled_mm``: a_scale
    [M, K/128] must be column-major (``act_quant(..., col_major_scales=True)``)."""
    _check(w_q, w_scale, (128, 128))
    # cuBLAS reads both scale tensors outer-dim-major: the weight's [N/128, K/128] transposed
    # is exactly that, the activation's comes that way from act_quant
    return torch._scaled_mm(a_q, w_q.t(), a_scale, _cached_scales_f32(w_scale).t(), out_dtype=out_dtype)


def _check(w_q: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int]) -> None:
    n, k = w_q.shape
    gn, gk = block
    want = (triton.cdiv(n, gn), triton.cdiv(k, gk))
    if w_q.dtype != torch.float8_e4m3fn or not w_q.is_contiguous():
        raise ValueError(f"w_q: expected a contiguous float8_e4m3fn [N, K], got {w_q.dtype} {tuple(w_q.shape)}")
    if tuple(w_scale.shape) != want:
        raise ValueError(f"w_scale: expected shape {want} for weight {tuple(w_q.shape)} and block {block}, "
                         f"got {tuple(w_scale.shape)}")
    if w_scale.dtype not in _E8M0 and w_scale.dtype != torch.float32:
        raise ValueError(f"w_scale: expected E8M0 bytes (uint8) or float32, got {w_scale.dtype}")


def fp8_gemm(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
             block: tuple[int, int], out_dtype: torch.dtype, groups: int = 1,
             config: dict[str, int] | None = None) -> torch.Tensor:
    """C = dequant(A) @ dequant(W)^T. a_q [M, K] (or [M, groups, K]) float8_e4m3fn,
    a_scale [M, (groups,) ceil(K / block[1])] float32; w_q [N, K] (N = groups * N_g);
    returns [M, N] in ``out_dtype``."""
    check_device(a_q)
    _check(w_q, w_scale, block)
    gn, gk = block
    a3 = a_q.view(a_q.shape[0], groups, -1)
    s3 = a_scale.view(a_scale.shape[0], groups, -1)
    m, k = a3.shape[0], a3.shape[2]
    n_total = w_q.shape[0]
    if w_q.shape[1] != k or n_total % groups:
        raise ValueError(f"shapes: activations [{m}, {groups}, {k}] do not fit weight {tuple(w_q.shape)}")
    n = n_total // groups
    if groups > 1 and n % gn:
        raise ValueError(f"groups: {groups} groups of {n} weight rows must each cover whole {gn}-row scale blocks")
    out = torch.empty(m, n_total, dtype=out_dtype, device=a_q.device)
    if m == 0:
        return out
    cfg = dict(config or _config(m, gk))
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    if gk % bk:
        raise ValueError(f"config: BLOCK_K={bk} must divide the weight block's K extent {gk}")
    ws = w_scale.view(torch.uint8) if w_scale.dtype in _E8M0 else w_scale.contiguous()
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), groups)
    _fp8_gemm_kernel[grid](
        a3, s3, w_q, ws, out, m, n, k, w_scale.shape[1],
        a3.stride(0), a3.stride(1), s3.stride(0), s3.stride(1), w_q.stride(0), out.stride(0),
        GK=gk, GN=gn, WS_E8M0=w_scale.dtype in _E8M0, CODE=dtype_code(out_dtype), INTERP=interpreting(),
        EVEN_K=k % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **cfg)
    return out


def fp8_gemm_ref(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                 block: tuple[int, int], out_dtype: torch.dtype, groups: int = 1,
                 config: dict[str, int] | None = None) -> torch.Tensor:
    """Torch reference of :func:`fp8_gemm`: dequantise both sides to float32, matmul."""
    from deepinfer.models.quant import dequantize_fp8_block

    _check(w_q, w_scale, block)
    gk = block[1]
    a3 = a_q.view(a_q.shape[0], groups, -1).float()
    m, k = a3.shape[0], a3.shape[2]
    s = a_scale.view(m, groups, -1).repeat_interleave(gk, dim=2)[..., :k]
    w = dequantize_fp8_block(w_q, w_scale, block).view(groups, -1, k)  # [G, N_g, K]
    out = torch.einsum("mgk,gnk->mgn", a3 * s, w)
    return out.reshape(m, -1).to(out_dtype)


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int],
               groups: int = 1) -> torch.Tensor:
    """y = x @ W^T for x [..., K] (or [M, groups, K] grouped) with the FP8 weight: quantise
    x per token and group of block[1] columns, then :func:`fp8_gemm`; y in x's dtype."""
    lead = x.shape[:-2] if groups > 1 else x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    if use_cublas(m, w_q.shape[0], rows.shape[1], block, groups, rows.device):
        a_q, a_s = act_quant(rows, 128, col_major_scales=True, pad_rows=CUBLAS_ROW_PAD)
        return fp8_gemm_cublas(a_q, a_s, w_q, w_scale, x.dtype)[:m].view(*lead, w_q.shape[0])
    a_q, a_s = act_quant(rows, block[1])
    # scale blocks straddling two groups (toy configs: rank < block) take the reference GEMM
    gemm = fp8_gemm if groups == 1 or (w_q.shape[0] // groups) % block[0] == 0 else fp8_gemm_ref
    out = gemm(a_q.view(-1, groups * x.shape[-1]), a_s.view(a_q.shape[0] // groups, -1), w_q, w_scale,
               block, x.dtype, groups)
    return out.view(*lead, w_q.shape[0])


def fp8_linear_ref(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int],
                   groups: int = 1) -> torch.Tensor:
    """Torch reference of :func:`fp8_linear` (same activation quantisation)."""
    lead = x.shape[:-2] if groups > 1 else x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    a_q, a_s = act_quant_ref(rows, block[1])
    out = fp8_gemm_ref(a_q.view(-1, groups * x.shape[-1]), a_s.view(a_q.shape[0] // groups, -1), w_q, w_scale,
                       block, x.dtype, groups)
    return out.view(*lead, w_q.shape[0])
