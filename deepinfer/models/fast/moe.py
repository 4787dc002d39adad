"""MoE of the fast path: gate GEMM + router kernel + fused experts (``MoE.forward``
without the per-expert loop and its host reads).

The shared expert has the routed experts' shape, so it is stacked after them as expert
E and every token gets one extra slot (weight 1, id E) from the router: the fused
combine adds slots in ascending expert id with a rounding after each add, so the shared
output lands last, exactly as the reference's ``routed + shared_experts(x)``.

Routed experts that keep only their checkpoint bytes (FP8 block-scaled or FP4, the
official V4 layout) run the weight-only quantized kernels
(``deepinfer_kernels.fused_moe_quant``: the weights decoded in the kernel, bit for bit
the reference's dequantized weights); the shared expert (FP8 in checkpoints) then runs
its own Linears after them, as the reference adds it. Prefill-sized steps on FP8 experts
quantize the activations too and run both GEMMs in FP8 (``fused_moe_w8a8``: faster than
the weight-only kernel and than bf16 at 8k tokens on an H200, V4-Flash widths;
docs/measurements.md), the numerics
the dense FP8 linears already have; ``DEEPINFER_MOE_W8A8`` picks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from deepinfer import batch_invariant, envs

W8A8_MODES = ("auto", "0", "1")  # DEEPINFER_MOE_W8A8 (declared in deepinfer/envs.py)
#: auto takes w8a8 from this many routed rows per expert (decode batches stay weight-only,
#: bound by weight reads, where the activation quantization would only add a launch) ...
W8A8_MIN_ROWS_PER_EXPERT = 16
#: ... for experts at least this wide: faster than weight-only at V4-Flash's 2048 (flash4 8k
#: prefill), slower at mini's 512 (forced; not yet profiled), so auto leaves narrower experts
#: weight-only (the runs: docs/measurements.md)
W8A8_MIN_INTER = 2048


def w8a8_auto(is_cuda: bool, n_slots: int, n_experts: int, inter: int) -> bool:
    """auto's choice: a CUDA step, prefill-sized per expert, on experts wide enough."""
    return is_cuda and n_slots >= W8A8_MIN_ROWS_PER_EXPERT * n_experts and inter >= W8A8_MIN_INTER


def w8a8_routed(quantized: Any, x: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """Whether this step's FP8 routed experts run w8a8 (module doc)."""
    mode = envs.DEEPINFER_MOE_W8A8
    if quantized.fmt != "fp8" or mode == "0" or batch_invariant.enabled():
        return False
    from deepinfer_kernels.fused_moe_w8a8 import w8a8_supported

    if not w8a8_supported(x.shape[1], quantized.w1.shape[1], quantized.block[1]):
        return False
    return mode == "1" or w8a8_auto(x.is_cuda, topk_ids.numel(), quantized.w1.shape[0], quantized.w1.shape[1])


def _experts(moe: torch.nn.Module) -> list[torch.nn.Module]:
    """Routed experts, plus the shared expert when it can ride along (same shapes)."""
    experts = list(moe.experts)
    shared = moe.shared_experts
    if shared is not None and shared.w1.quantized is None and \
            shared.w1.weight.shape == experts[0].w1.weight.shape and \
            shared.w2.weight.shape == experts[0].w2.weight.shape and shared.limit == experts[0].limit:
        # (an FP8 shared expert keeps only its checkpoint bytes and runs the FP8 GEMM instead)
        experts.append(shared)
    return experts


def stacked_experts(moe: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w1, w3, w2) [E', I, H] / [E', H, I] of a MoE's experts (E' = E + 1 with the shared
    expert stacked last), stacked once; the experts' own weights become views of the
    stacks, so memory is not doubled and the reference path keeps reading the same values."""
    stacks = getattr(moe, "_fast_stacks", None)
    experts = _experts(moe)
    lin = experts[0].w1
    # experts that keep only checkpoint bytes dequantize on every `.weight` read: key the
    # stacks on those bytes (a read inside a CUDA graph capture would copy from the host)
    dense = lin._parameters.get("weight") is not None or lin.quantized is None
    key = lin.weight.data_ptr() if dense else lin.quantized.data.data_ptr()
    if stacks is not None and getattr(moe, "_fast_stacks_key", None) == key:
        return stacks
    stacks = tuple(torch.stack([getattr(ex, n).weight.data for ex in experts]) for n in ("w1", "w3", "w2"))
    if dense:
        for e, ex in enumerate(experts):
            ex.w1.weight.data, ex.w3.weight.data, ex.w2.weight.data = stacks[0][e], stacks[1][e], stacks[2][e]
        key = experts[0].w1.weight.data_ptr()
    moe._fast_stacks, moe._fast_stacks_key = stacks, key
    return stacks


def quantized_experts(moe: torch.nn.Module) -> Any | None:
    """The routed experts' checkpoint bytes stacked once for the quantized kernels, or None
    when they hold dense weights. Each expert's ``QuantizedWeight`` then views the stacks
    (scales as E8M0 bytes, the same values), so the bytes are not held twice."""
    experts = list(moe.experts)
    lin = experts[0].w1
    if lin.quantized is None or lin._parameters.get("weight") is not None:
        return None
    stacks = getattr(moe, "_fast_qstacks", None)
    if stacks is not None and stacks.w1.data_ptr() == lin.quantized.data.data_ptr():
        return stacks
    from deepinfer_kernels.fused_moe_quant import stack_quantized_experts

    from ..linear import QuantizedWeight

    names = ("w1", "w3", "w2")
    stacks = stack_quantized_experts(*([getattr(ex, n).quantized for ex in experts] for n in names))
    for e, ex in enumerate(experts):
        for n in names:
            q = getattr(ex, n).quantized
            getattr(ex, n).quantized = QuantizedWeight(q.fmt, getattr(stacks, n)[e], getattr(stacks, "s" + n[1])[e],
                                                       q.block)
    moe._fast_qstacks = stacks
    return stacks


def supported(moe: torch.nn.Module) -> bool:
    """A plain ``MoE`` (not an expert-parallel replacement) with a router the kernel has and
    no load counting (EPLB counts on the reference path)."""
    from ..moe import MoE

    return isinstance(moe, MoE) and moe.gate.func in ("sqrtsoftplus", "sigmoid") and moe.load_counter is None


def _route(ops: Any, gate: torch.nn.Module, logits: torch.Tensor, input_ids: torch.Tensor,
           extra: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The router kernel over a gate's logits: hash layers look their experts up by token."""
    if getattr(gate, "is_hash", False):
        return ops.router(logits, None, gate.top_k, gate.route_scale, gate.normalize, gate.func,
                          tid2eid=gate.tid2eid, input_ids=input_ids, **extra)
    return ops.router(logits, gate.bias, gate.top_k, gate.route_scale, gate.normalize, gate.func, **extra)


def _moe_invariant(moe: torch.nn.Module, x: torch.Tensor, input_ids: torch.Tensor, ops: Any,
                   logits: torch.Tensor | None) -> torch.Tensor:
    """``moe_forward`` in batch-invariant mode: the gate GEMM at the mode's fixed tiling,
    the router kernel (per row), and the experts (the shared one stacked last) through
    ``batch_invariant_moe.routed_experts`` (one tiling, combine in ascending expert id).
    Checkpoint-byte experts and the torch references run the module (the mode's reference)."""
    from .. import invariant_ops

    if quantized_experts(moe) is not None or ops.kind != "triton":
        return moe(x, input_ids)
    from deepinfer_kernels.batch_invariant_moe import routed_experts

    gate = moe.gate
    w1, w3, w2 = stacked_experts(moe)
    fused_shared = w1.shape[0] > moe.n_experts
    extra = {"extra_id": moe.n_experts} if fused_shared else {}
    if logits is None:
        logits = invariant_ops.linear(x, gate.weight)
    weights, ids = _route(ops, gate, logits, input_ids, extra)
    out = routed_experts(x, w1, w3, w2, weights, ids, moe.experts[0].limit)
    if moe.shared_experts is not None and not fused_shared:
        out = out + moe.shared_experts(x)
    return out


def moe_forward(moe: torch.nn.Module, x: torch.Tensor, input_ids: torch.Tensor, ops: Any,
                logits: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden]; same math as ``MoE.forward``. ``logits``: the router
    logits when the family computes them its own way (V4.1: float32, over gate_temp);
    default the gate GEMM in x's dtype."""
    gate = moe.gate
    if getattr(ops, "invariant", False):
        return _moe_invariant(moe, x, input_ids, ops, logits)
    quantized = quantized_experts(moe)
    w1, w3, w2 = stacked_experts(moe) if quantized is None else (None, None, None)
    fused_shared = w1 is not None and w1.shape[0] > moe.n_experts
    extra = {"extra_id": moe.n_experts} if fused_shared else {}
    if logits is None:
        logits = F.linear(x, gate.weight)
    weights, ids = _route(ops, gate, logits, input_ids, extra)
    if quantized is not None and w8a8_routed(quantized, x, ids):
        q = quantized
        out = ops.fused_moe_w8a8(x, q.w1, q.w3, q.w2, q.s1, q.s3, q.s2, q.block, weights, ids, moe.experts[0].limit)
    elif quantized is not None:
        out = quantized(x, weights, ids, moe.experts[0].limit, ref=ops.kind == "ref")
    else:
        out = ops.fused_moe(x, w1, w3, w2, weights, ids, moe.experts[0].limit)
    if moe.shared_experts is not None and not fused_shared:
        out = out + moe.shared_experts(x)
    return out
