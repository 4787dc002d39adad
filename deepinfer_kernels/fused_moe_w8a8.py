"""Fused routed-expert MoE on FP8 block-scaled experts with FP8 activations (w8a8), for
prefill-sized batches: both GEMMs run e4m3 x e4m3 on the tensor cores.

The weight-only kernel (:mod:`fused_moe_quant`) decodes every weight tile to bf16 and is
ALU-bound once the batch is large (H200, flash widths, 8k tokens: 10.4 ms against bf16's
7.4). Here the decode disappears: activations are quantized per token and group of
``block[1]`` columns (:mod:`fp8_act_quant`'s power-of-two scales, the checkpoint's
``ue8m0``), and each K step multiplies one e4m3 block pair with float32 accumulation,
then applies ``a_scale[row, kb] * w_scale[n // block[0], kb]`` once, as
:mod:`fp8_gemm` does for the dense linears (and DeepSeek's own FP8 inference).

Math per routed (token t, slot j), expert e: ``xq = act_quant(x)``;
``g = round(xq W1[e]^T)``, ``u = round(xq W3[e]^T)`` (float32 accumulation, one rounding
to the activation dtype); ``a = round(round(silu(min(g, L))) * clamp(u, -L, L))`` as
:mod:`fused_moe`; ``aq = act_quant(a)`` fused into the gate/up epilogue (a tile holds one
whole scale group of a row when BLOCK_N equals the group); ``y = round(round(aq W2[e]^T)
* w[t, j])``; and :mod:`fused_moe`'s fixed-order combine. The numbers differ from the
weight-only kernels by the activation rounding (e4m3: <= 2^-4 relative per element), the
price of FP8 tensor-core throughput, and are what :func:`fused_moe_w8a8_ref` computes.

Layout as :func:`fused_moe_quant.fused_moe_fp8`: w1/w3 [E, I, H], w2 [E, H, I]
float8_e4m3fn, E8M0 byte scales s1/s3 [E, I/b0, H/b1], s2 [E, H/b0, I/b1]; H and I must be
multiples of b1 >= 32 (every V4 width is a multiple of 128; e4m3 dots need K >= 32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, next_pow2, round_to
from .fp8_act_quant import act_quant, act_quant_ref, pow2_ceil, round_e4m3
from .fused_moe import _combine_kernel, block_slots, clipped_swiglu_rounded
from .fused_moe_quant import _e8m0, _validate
from .moe_align import moe_align


@triton.jit
def _dot8(a, b, INTERP: tl.constexpr):
    """a @ b of e4m3 tiles in float32 (the interpreter's dot needs float32 operands; e4m3
    values and their products are exact there)."""
    if INTERP:
        d = tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        d = tl.dot(a, b)
    return d


@triton.jit(do_not_specialize=["n_slots"])
def _w8a8_kernel(a_ptr, as_ptr, w_ptr, w3_ptr, ws_ptr, ws3_ptr, topw_ptr, out_ptr, outs_ptr, sorted_ptr,
                 block_expert_ptr, n_slots, K, N, stride_a, stride_as, stride_we, stride_wn, stride_se, stride_sn,
                 stride_os, limit, GATE_UP: tl.constexpr, TOPK: tl.constexpr, SB_N: tl.constexpr,
                 SB_K: tl.constexpr, CODE: tl.constexpr, INTERP: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """GATE_UP: e4m3(act) and its scales from x's e4m3 rows (K = H, N = I, rows = tokens);
    else y = round(round(act W2^T) * w) (K = I, N = H, rows = slots, TOPK = 1)."""
    pid_n = tl.program_id(0)
    e, slots, valid = block_slots(block_expert_ptr, sorted_ptr, n_slots, BLOCK_M)
    if e < 0:
        return
    rows = slots // TOPK
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    k = tl.arange(0, BLOCK_K)
    e = e.to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * stride_a + k[None, :]
    w_off = e * stride_we + n.to(tl.int64)[None, :] * stride_wn + k[:, None]  # [BLOCK_K, BLOCK_N]: W^T tiles
    w_ptrs, w3_ptrs = w_ptr + w_off, w3_ptr + w_off
    as_row = as_ptr + rows * stride_as
    s_off = e * stride_se + (n // SB_N).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # K is a multiple of SB_K and BLOCK_K divides SB_K (host check): no K masks
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
        kb = k0 // SB_K
        a_s = tl.load(as_row + kb, mask=valid, other=0.0)
        w_s = _e8m0(tl.load(ws_ptr + s_off + kb, mask=nmask, other=127))
        acc += _dot8(a, tl.load(w_ptrs, mask=nmask[None, :], other=0.0), INTERP) * (a_s[:, None] * w_s[None, :])
        if GATE_UP:
            w3_s = _e8m0(tl.load(ws3_ptr + s_off + kb, mask=nmask, other=127))
            acc_u += _dot8(a, tl.load(w3_ptrs, mask=nmask[None, :], other=0.0), INTERP) * \
                (a_s[:, None] * w3_s[None, :])
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        w3_ptrs += BLOCK_K
    if GATE_UP:
        y = clipped_swiglu_rounded(acc, acc_u, limit, CODE, INTERP)
        # act_quant of the rounded activation: this tile is one whole scale group of each row
        amax = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-10)
        scale = pow2_ceil(amax / 448.0)
        q = round_e4m3(y * (1.0 / scale)[:, None], INTERP)
        tl.store(out_ptr + slots[:, None] * N + n[None, :], q.to(tl.float8e4nv), mask=valid[:, None] & nmask[None, :])
        tl.store(outs_ptr + slots * stride_os + pid_n, scale, mask=valid)
    else:
        w = tl.load(topw_ptr + slots, mask=valid, other=0.0).to(tl.float32)
        y = round_to(round_to(acc, CODE, INTERP) * w[:, None], CODE, INTERP)
        tl.store(out_ptr + slots[:, None] * N + n[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & nmask[None, :])


def w8a8_config(n_slots: int, n_experts: int, group: int) -> dict[str, int]:
    """Tiles: BLOCK_M / BLOCK_K / warps / stages shared by both GEMMs, ``DOWN_N`` the down
    GEMM's column tile (the gate/up tile is one scale group wide). H200, flash widths
    (profiling/fp8_prefill_tuning.py): 64 x 128 x 128 tiles on 8 warps, 4 stages, were
    fastest at 2k and 8k tokens; 4 warps spill the two accumulators, 128-row tiles were
    slower (docs/measurements.md)."""
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_K=min(32, group), DOWN_N=32, num_warps=4, num_stages=1)
    return dict(BLOCK_M=64, BLOCK_K=min(128, group), DOWN_N=128, num_warps=8, num_stages=4)


def w8a8_supported(hidden: int, inter: int, group: int) -> bool:
    """Whether these experts fit the kernel: H and I multiples of the scale group, a power
    of two >= 32 (act_quant's group; e4m3 tensor-core dots take K >= 32)."""
    return group >= 32 and not group & (group - 1) and not hidden % group and not inter % group


def _check_w8a8(x, w1, block) -> tuple[int, int]:
    b0, b1 = block
    h, inter = x.shape[1], w1.shape[1]
    if not w8a8_supported(h, inter, b1):
        raise ValueError(f"block: w8a8 needs H={h} and I={inter} to be multiples of block[1]={b1}, a power of two "
                         f">= 32 (act_quant's group; e4m3 tensor-core dots take K >= 32)")
    return b0, b1


def fused_moe_w8a8(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, s1: torch.Tensor,
                   s3: torch.Tensor, s2: torch.Tensor, block: tuple[int, int], topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, limit: float, config: dict[str, int] | None = None) -> torch.Tensor:
    """Routed experts for x [T, H] (bf16 / fp32) on FP8 experts with FP8 activations (module
    doc); returns [T, H] in x's dtype. ``config`` overrides :func:`w8a8_config`."""
    check_device(x)
    n_experts, inter, (s1, s3, s2) = _validate(False, x, w1, w3, w2, s1, s3, s2, tuple(block), topk_weights,
                                               topk_ids)
    b0, b1 = _check_w8a8(x, w1, tuple(block))
    (t, h), k = x.shape, topk_ids.shape[1]
    n_slots = t * k
    cfg = dict(config or w8a8_config(n_slots, n_experts, b1))
    bm, bk, down_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_K"), cfg.pop("DOWN_N")
    if bk < 32 or bk & (bk - 1) or b1 % bk:
        raise ValueError(f"config: BLOCK_K={bk} must be a power of two >= 32 dividing block[1]={b1}")
    out = torch.empty_like(x)
    if t == 0:
        return out
    code, interp = dtype_code(x.dtype), interpreting()
    meta = dict(SB_N=b0, SB_K=b1, CODE=code, INTERP=interp, BLOCK_M=bm, BLOCK_K=bk, **cfg)
    x_q, x_s = act_quant(x if x.stride(-1) == 1 else x.contiguous(), b1)
    align = moe_align(topk_ids, n_experts, bm)
    ids = topk_ids.to(torch.int32).contiguous()
    topw = topk_weights.contiguous().view(-1)
    act_q = torch.empty(n_slots, inter, dtype=torch.float8_e4m3fn, device=x.device)
    act_s = torch.empty(n_slots, inter // b1, dtype=torch.float32, device=x.device)
    y = torch.empty(n_slots, h, dtype=x.dtype, device=x.device)
    _w8a8_kernel[(inter // b1, align.max_blocks)](
        x_q, x_s, w1, w3, s1, s3, topw, act_q, act_s, align.sorted_ids, align.block_expert, n_slots, h, inter,
        x_q.stride(0), x_s.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1), act_s.stride(0),
        float(limit), GATE_UP=True, TOPK=k, BLOCK_N=b1, **meta)
    _w8a8_kernel[(triton.cdiv(h, down_n), align.max_blocks)](
        act_q, act_s, w2, w2, s2, s2, topw, y, act_s, align.sorted_ids, align.block_expert, n_slots, inter, h,
        act_q.stride(0), act_s.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), 0,
        float(limit), GATE_UP=False, TOPK=1, BLOCK_N=down_n, **meta)
    block_c = min(1024, next_pow2(h))
    _combine_kernel[(t, triton.cdiv(h, block_c))](y, ids, out, h, n_experts, TOPK=k, CODE=code, INTERP=interp,
                                                  BLOCK=block_c, num_warps=4)
    return out


def fused_moe_w8a8_ref(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, s1: torch.Tensor,
                       s3: torch.Tensor, s2: torch.Tensor, block: tuple[int, int], topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, limit: float, config: dict[str, int] | None = None) -> torch.Tensor:
    """Torch reference of :func:`fused_moe_w8a8`: the same activation quantization and rounding
    points, float32 GEMMs on the dequantized operands, experts in ascending id into a
    bf16 (x's dtype) output, as ``MoE.forward``'s index_add."""
    from deepinfer.models.moe import clipped_swiglu
    from deepinfer.models.quant import dequantize_fp8_block

    n_experts, _, scales = _validate(False, x, w1, w3, w2, s1, s3, s2, tuple(block), topk_weights, topk_ids)
    _, b1 = _check_w8a8(x, w1, tuple(block))

    def deq_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return q.float() * s.repeat_interleave(b1, dim=1)

    x_q, x_s = act_quant_ref(x, b1)
    xd = deq_rows(x_q, x_s)
    out = torch.zeros_like(x)
    ids = topk_ids.long()
    counts = torch.bincount(ids[(ids >= 0) & (ids < n_experts)].flatten(), minlength=n_experts)
    for e in counts.nonzero().flatten().tolist():
        token, slot = torch.where(ids == e)
        wd = [dequantize_fp8_block(w[e], s[e], tuple(block)) for w, s in zip((w1, w3, w2), scales)]
        g, u = ((xd[token] @ w.T).to(x.dtype) for w in wd[:2])
        a_q, a_s = act_quant_ref(clipped_swiglu(g, u, limit), b1)
        y = (deq_rows(a_q, a_s) @ wd[2].T).to(x.dtype)
        out.index_add_(0, token, (y * topk_weights[token, slot, None]).to(out.dtype))
    return out
