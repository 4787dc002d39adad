"""Fused routed-expert MoE (bf16): align, grouped GEMM gate/up + clipped SwiGLU,
grouped GEMM down (weighted), and a fixed-order combine.

Math per routed (token t, slot j) with expert e = ids[t, j], as the routed part of
``deepinfer.models.moe.MoE`` computes it (torch's bf16 rounding points kept):
``g = round(x_t W1[e]^T)``, ``u = round(x_t W3[e]^T)``,
``a = round(round(silu(min(g, L))) * clamp(u, -L, L))``, ``y = round(a W2[e]^T)``,
``y = round(y * w[t, j])`` and ``out[t]`` the slots added one at a time in ascending
expert id with ``out = round(out + y_j)`` after each add, as the reference's
``index_add_`` per expert into a bf16 output does (a fixed order per token, so the
output does not depend on the other tokens).

Weights are stacked over experts: w1 (gate) and w3 (up) [E, I, H], w2 (down) [E, H, I];
ids outside [0, E) (experts on another rank) contribute nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, next_pow2, round_to, mma
from .moe_align import moe_align


@triton.jit
def block_slots(block_expert_ptr, sorted_ptr, n_slots, BLOCK_M: tl.constexpr):
    """Program pid_m's expert (-1: no work) and its BLOCK_M flat slots (int64, 0 where
    padding) with their validity, from the :func:`moe_align` buffers."""
    pid_m = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < n_slots
    return e, tl.where(valid, slots, 0).to(tl.int64), valid


@triton.jit
def clipped_swiglu_rounded(acc_g, acc_u, limit, CODE: tl.constexpr, INTERP: tl.constexpr):
    """``round(round(silu(min(g, L))) * clamp(u, -L, L))`` of the float32 gate / up sums,
    with the reference's roundings to the activation dtype."""
    g = tl.minimum(round_to(acc_g, CODE, INTERP), limit)
    u = tl.minimum(tl.maximum(round_to(acc_u, CODE, INTERP), -limit), limit)
    silu = round_to(g / (1.0 + tl.exp(-g)), CODE, INTERP)
    return round_to(silu * u, CODE, INTERP)


@triton.jit(do_not_specialize=["n_slots"])
def _gate_up_kernel(x_ptr, w1_ptr, w3_ptr, act_ptr, sorted_ptr, block_expert_ptr, n_slots, H, I,
                    stride_x, stride_we, stride_wn, limit,
                    TOPK: tl.constexpr, CODE: tl.constexpr, INTERP: tl.constexpr, EVEN_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    e, slots, valid = block_slots(block_expert_ptr, sorted_ptr, n_slots, BLOCK_M)
    if e < 0:
        return
    toks = slots // TOPK
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + toks[:, None] * stride_x + k[None, :]
    w_off = e.to(tl.int64) * stride_we + n[None, :].to(tl.int64) * stride_wn + k[:, None]
    g_ptrs, u_ptrs = w1_ptr + w_off, w3_ptr + w_off
    nmask = n[None, :] < I
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            bg = tl.load(g_ptrs, mask=nmask, other=0.0)
            bu = tl.load(u_ptrs, mask=nmask, other=0.0)
        else:
            km = (k0 + k) < H
            a = tl.load(a_ptrs, mask=valid[:, None] & km[None, :], other=0.0)
            bg = tl.load(g_ptrs, mask=nmask & km[:, None], other=0.0)
            bu = tl.load(u_ptrs, mask=nmask & km[:, None], other=0.0)
        acc_g = mma(a, bg, acc_g, INTERP)
        acc_u = mma(a, bu, acc_u, INTERP)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    act = clipped_swiglu_rounded(acc_g, acc_u, limit, CODE, INTERP)
    out = act_ptr + slots[:, None] * I + n[None, :]
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & nmask)


@triton.jit(do_not_specialize=["n_slots"])
def _down_kernel(act_ptr, w2_ptr, topw_ptr, y_ptr, sorted_ptr, block_expert_ptr, n_slots, H, I,
                 stride_we, stride_wn,
                 CODE: tl.constexpr, INTERP: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    e, rows, valid = block_slots(block_expert_ptr, sorted_ptr, n_slots, BLOCK_M)
    if e < 0:
        return
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * I + k[None, :]
    b_ptrs = w2_ptr + e.to(tl.int64) * stride_we + n[None, :].to(tl.int64) * stride_wn + k[:, None]
    nmask = n[None, :] < H
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=nmask, other=0.0)
        else:
            km = (k0 + k) < I
            a = tl.load(a_ptrs, mask=valid[:, None] & km[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=nmask & km[:, None], other=0.0)
        acc = mma(a, b, acc, INTERP)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    w = tl.load(topw_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    y = round_to(round_to(acc, CODE, INTERP) * w[:, None], CODE, INTERP)
    tl.store(y_ptr + rows[:, None] * H + n[None, :], y.to(y_ptr.dtype.element_ty), mask=valid[:, None] & nmask)


@triton.jit
def _combine_kernel(y_ptr, ids_ptr, out_ptr, H, E, TOPK: tl.constexpr, CODE: tl.constexpr,
                    INTERP: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < H
    # The reference adds the slots with one index_add_ per expert, ascending expert id,
    # into an output of the activation dtype: out = round(out + y) after every add. Do
    # the same: pass i adds the slot of the i-th smallest expert id (ids of one token are
    # distinct; equal ids, which routing never produces, go in slot order).
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    prev_e = -1
    prev_j = -1
    for i in tl.static_range(TOPK):
        best_e = 2147483647
        best_j = -1
        for j in tl.static_range(TOPK):
            ej = tl.load(ids_ptr + t * TOPK + j)
            after = (ej > prev_e) | ((ej == prev_e) & (j > prev_j))
            better = after & ((ej < best_e) | ((ej == best_e) & (j < best_j)))
            best_e = tl.where(better, ej, best_e)
            best_j = tl.where(better, j, best_j)
        prev_e = best_e
        prev_j = best_j
        e = best_e + tl.zeros([BLOCK], dtype=tl.int32)
        ok = cmask & (e >= 0) & (e < E)
        y = tl.load(y_ptr + (t * TOPK + best_j) * H + cols, mask=ok, other=0.0).to(tl.float32)
        acc = tl.where(ok, round_to(acc + y, CODE, INTERP), acc)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def _config(n_slots: int, n_experts: int) -> dict[str, int]:
    """Tile sizes from the average rows per expert (decode: few; prefill: many)."""
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
    # H200 (profiling/results/kernel_bench_h200.json): T=64 at the weight-read roofline
    # with BLOCK_M=16; at 96 and 384 rows/expert BLOCK_M=128 beat 64 (docs/measurements.md).
    per_expert = n_slots / max(1, n_experts)
    if per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    if per_expert <= 48:
        return dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def fused_moe(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, limit: float, config: dict[str, int] | None = None) -> torch.Tensor:
    """Routed experts for x [T, H] (bf16): returns sum_j w[t,j] * expert_{ids[t,j]}(x_t) as [T, H].

    w1/w3 [E, I, H] (gate/up), w2 [E, H, I], each with a contiguous last dim;
    topk_weights [T, k] (bf16/fp32), topk_ids [T, k] (int). `config` overrides tiles.
    """
    check_device(x)
    t, h = x.shape
    n_experts, inter = w1.shape[0], w1.shape[1]
    k = topk_ids.shape[1]
    assert w3.shape == w1.shape and w1.stride() == w3.stride() and w2.shape == (n_experts, h, inter)
    assert x.stride(1) == 1 and w1.stride(2) == 1 and w2.stride(2) == 1
    n_slots = t * k
    cfg = dict(config or _config(n_slots, n_experts))
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    out = torch.empty_like(x)
    if t == 0:
        return out
    align = moe_align(topk_ids, n_experts, bm)
    ids = topk_ids.to(torch.int32).contiguous()
    topw = topk_weights.contiguous().view(-1)
    act = torch.empty(n_slots, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(n_slots, h, dtype=x.dtype, device=x.device)
    code, interp = dtype_code(x.dtype), interpreting()
    _gate_up_kernel[(triton.cdiv(inter, bn), align.max_blocks)](
        x, w1, w3, act, align.sorted_ids, align.block_expert, n_slots, h, inter,
        x.stride(0), w1.stride(0), w1.stride(1), float(limit),
        TOPK=k, CODE=code, INTERP=interp, EVEN_K=h % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **cfg)
    _down_kernel[(triton.cdiv(h, bn), align.max_blocks)](
        act, w2, topw, y, align.sorted_ids, align.block_expert, n_slots, h, inter,
        w2.stride(0), w2.stride(1),
        CODE=code, INTERP=interp, EVEN_K=inter % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **cfg)
    block = min(1024, next_pow2(h))
    _combine_kernel[(t, triton.cdiv(h, block))](y, ids, out, h, n_experts, TOPK=k, CODE=code, INTERP=interp,
                                                BLOCK=block, num_warps=4)
    return out


def fused_moe_ref(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, limit: float,
                  config: dict[str, int] | None = None) -> torch.Tensor:
    """Torch reference with the signature of :func:`fused_moe`: the routed loop of
    ``MoE.forward`` (experts one at a time, ``clipped_swiglu``, bf16 index_add)."""
    from deepinfer.models.moe import clipped_swiglu

    out = torch.zeros_like(x)
    ids = topk_ids.long()
    n_experts = w1.shape[0]
    counts = torch.bincount(ids[(ids >= 0) & (ids < n_experts)].flatten(), minlength=n_experts)
    for e in counts.nonzero().flatten().tolist():
        token, slot = torch.where(ids == e)
        xe = x[token]
        y = F.linear(clipped_swiglu(F.linear(xe, w1[e]), F.linear(xe, w3[e]), limit), w2[e])
        out.index_add_(0, token, (y * topk_weights[token, slot, None]).to(out.dtype))
    return out


def stack_expert_weights(moe: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w1, w3, w2) stacked over a ``deepinfer.models.moe.MoE``'s routed experts."""
    experts = list(moe.experts)
    return (torch.stack([ex.w1.weight for ex in experts]), torch.stack([ex.w3.weight for ex in experts]),
            torch.stack([ex.w2.weight for ex in experts]))
