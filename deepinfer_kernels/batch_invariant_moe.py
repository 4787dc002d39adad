"""Batch-invariant MoE layer (the "moe" op): router, grouped expert GEMMs with one fixed
tiling, and a combine in ascending expert id.

Without the mode an expert's GEMM sees as many rows as tokens were routed to it, a
number that depends on the whole batch, and cuBLAS (or a tuned fused kernel) picks its
tiles from it. Here:

* the slots (token, choice) are grouped by expert (``moe_align``, a stable layout) and
  every expert GEMM runs in BLOCK_M x BLOCK_N tiles walking K in BLOCK_K steps, the
  tiling fixed per dtype (never from the row counts), float32 accumulation;
* each slot's value is formed with the reference's rounding points
  (``deepinfer.models.moe``: ``g``, ``u`` rounded, ``silu`` rounded, ``act = silu * u``
  rounded, ``y = act W2^T`` rounded, ``y * w`` rounded);
* a token's slots are added to zero in ascending expert id, rounding after each add,
  as the reference's per-expert ``index_add_`` does; then the shared expert.

The router (``module.gate``) and the shared expert run through the mode's invariant
linears (the gate's top-k and normalisation are per row). The reference is the
module's own ``forward`` in batch-invariant mode with no "moe" kernel registered;
results agree within the dtype's tolerance.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, round_to
from .batch_invariant_common import bi_dot
from .moe_align import moe_align

__all__ = ["moe", "moe_config", "routed_experts"]


@triton.jit(do_not_specialize=["n_slots"])
def _gate_up_kernel(x_ptr, w1_ptr, w3_ptr, act_ptr, sorted_ptr, block_expert_ptr, n_slots, H, I,
                    stride_x, stride_we, stride_wn, limit,
                    TOPK: tl.constexpr, CODE: tl.constexpr, INTERP: tl.constexpr, EVEN_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= 0:
        slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slots < n_slots
        toks = tl.where(valid, slots // TOPK, 0).to(tl.int64)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        n_ok = n < I
        a_ptrs = x_ptr + toks[:, None] * stride_x + k[None, :]
        w_off = e.to(tl.int64) * stride_we + n[None, :].to(tl.int64) * stride_wn + k[:, None]
        g_ptrs, u_ptrs = w1_ptr + w_off, w3_ptr + w_off
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            if EVEN_K:
                k_ok = k < BLOCK_K
            else:
                k_ok = (k0 + k) < H
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            bg = tl.load(g_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            bu = tl.load(u_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc_g = bi_dot(a, bg, acc_g, CODE == 0, INTERP)
            acc_u = bi_dot(a, bu, acc_u, CODE == 0, INTERP)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        g = tl.minimum(round_to(acc_g, CODE, INTERP), limit)
        u = tl.minimum(tl.maximum(round_to(acc_u, CODE, INTERP), -limit), limit)
        act = round_to(round_to(g / (1.0 + tl.exp(-g)), CODE, INTERP) * u, CODE, INTERP)
        out = act_ptr + slots[:, None].to(tl.int64) * I + n[None, :]
        tl.store(out, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["n_slots"])
def _down_kernel(act_ptr, w2_ptr, topw_ptr, y_ptr, sorted_ptr, block_expert_ptr, n_slots, H, I,
                 stride_we, stride_wn,
                 CODE: tl.constexpr, INTERP: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= 0:
        slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slots < n_slots
        rows = tl.where(valid, slots, 0).to(tl.int64)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        n_ok = n < H
        a_ptrs = act_ptr + rows[:, None] * I + k[None, :]
        b_ptrs = w2_ptr + e.to(tl.int64) * stride_we + n[None, :].to(tl.int64) * stride_wn + k[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            if EVEN_K:
                k_ok = k < BLOCK_K
            else:
                k_ok = (k0 + k) < I
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc = bi_dot(a, b, acc, CODE == 0, INTERP)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        w = tl.load(topw_ptr + rows, mask=valid, other=0.0).to(tl.float32)
        y = round_to(round_to(acc, CODE, INTERP) * w[:, None], CODE, INTERP)
        tl.store(y_ptr + rows[:, None] * H + n[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=valid[:, None] & n_ok[None, :])


def moe_config(dtype: torch.dtype) -> dict[str, int]:
    """The one tiling of the expert GEMMs for ``dtype`` (never from the row counts)."""
    if interpreting():
        return dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)


def routed_experts(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, limit: float) -> torch.Tensor:
    """sum_j w[t, j] * expert_{ids[t, j]}(x_t) for x [T, H]; w1/w3 [E, I, H], w2 [E, H, I]
    (unit stride along the last dim); ids in [0, E), distinct per token."""
    check_device(x, w1, w3, w2)
    t, h = x.shape
    n_experts, inter = w1.shape[0], w1.shape[1]
    k = topk_ids.shape[1]
    if w3.shape != w1.shape or w1.stride() != w3.stride() or w2.shape != (n_experts, h, inter):
        raise ValueError(f"expert weights: w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)} "
                         f"do not match x [{t}, {h}]")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.zeros_like(x)
    if t == 0:
        return out
    cfg = moe_config(x.dtype)
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    n_slots = t * k
    align = moe_align(topk_ids, n_experts, bm)
    act = torch.empty(n_slots, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(n_slots, h, dtype=x.dtype, device=x.device)
    code, interp = dtype_code(x.dtype), interpreting()
    _gate_up_kernel[(triton.cdiv(inter, bn), align.max_blocks)](
        x, w1, w3, act, align.sorted_ids, align.block_expert, n_slots, h, inter,
        x.stride(0), w1.stride(0), w1.stride(1), float(limit),
        TOPK=k, CODE=code, INTERP=interp, EVEN_K=h % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **cfg)
    _down_kernel[(triton.cdiv(h, bn), align.max_blocks)](
        act, w2, topk_weights.contiguous().view(-1), y, align.sorted_ids, align.block_expert, n_slots, h, inter,
        w2.stride(0), w2.stride(1),
        CODE=code, INTERP=interp, EVEN_K=inter % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **cfg)
    # combine: ascending expert id per token, rounding after each add (elementwise, per token)
    order = torch.argsort(topk_ids, dim=1)
    y = y.view(t, k, h).gather(1, order[:, :, None].expand(t, k, h))
    for j in range(k):
        out = out + y[:, j]
    return out


def moe(module: torch.nn.Module, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The "moe" op: ``deepinfer.models.moe.MoE.forward`` (or a subclass with the same
    parts, e.g. V4.1's MoE41) for x [T, hidden] in batch-invariant mode."""
    from deepinfer.models.fast.moe import stacked_experts  # experts become views of one stack: no copy

    weights, ids = module.gate(x, input_ids)
    if module.load_counter is not None:
        module.load_counter += torch.bincount(ids.flatten(), minlength=module.n_experts)
    w1, w3, w2 = stacked_experts(module)
    out = routed_experts(x, w1, w3, w2, weights, ids, module.experts[0].limit)
    if module.shared_experts is not None:
        out = out + module.shared_experts(x)
    return out
