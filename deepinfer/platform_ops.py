"""Ops that the platform dispatches: the torch references (the default everywhere) and the
adapters that put Ascend's fused torch_npu ops behind the same signatures.

Nothing here imports torch_npu: the adapters receive the module that
`deepinfer.platform` imported (guarded) and only look attributes up on it.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

# ---- torch reference ops: the dispatch defaults on every platform ------------------------
def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm, bit-identical to ``deepinfer.models.norm.RMSNorm.forward``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype)).to(x.dtype)


def ref_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing channels: ``deepinfer.models.rope.apply_rope``."""
    from deepinfer.models.rope import apply_rope
    return apply_rope(x, cos, sin)


def ref_moe_gating(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, func: str,
                   normalize: bool, route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed-layer gate of ``deepinfer.models.moe.Gate``: (weights [T, k], ids [T, k] int64)."""
    from deepinfer.models.moe import score
    scores = score(logits, func)
    ids = torch.topk(scores if bias is None else scores + bias, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * route_scale, ids


def ref_attention(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Shared-KV attention with a per-head sink logit, as in ``Attention._attend_one``.
    q [L, H, D], kv [K, D] (keys = values), mask [L, K] (True = visible), sink [H]."""
    logits = torch.einsum("lhd,kd->lhk", q, kv) * scale
    logits = logits.float().masked_fill(~mask[:, None, :], float("-inf"))
    combined = torch.cat([logits, sink.float()[None, :, None].expand(logits.shape[0], -1, 1)], dim=-1)
    probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum("lhk,kd->lhd", probs.to(kv.dtype), kv)


def reference_ops() -> dict[str, Callable[..., Any]]:
    """Name -> torch reference implementation of every dispatched op."""
    return {"rms_norm": ref_rms_norm, "rope": ref_rope, "moe_gating": ref_moe_gating,
            "attention": ref_attention}



# ---- Ascend fused-op adapters (same signatures as the references) -------------------------
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _ascend_fused_ops(npu: ModuleType) -> dict[str, Callable[..., Any]]:
    """Adapters around the fused ops that ``npu`` (the torch_npu module) exposes."""
    ops: dict[str, Callable[..., Any]] = {}
    if hasattr(npu, "npu_rms_norm"):
        def npu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            """Fused RMSNorm in float32, cast back (bf16: one rounding fewer than the reference)."""
            return npu.npu_rms_norm(x.float(), weight.float(), epsilon=eps)[0].to(x.dtype)
        ops["rms_norm"] = npu_rms_norm
    if hasattr(npu, "npu_rotary_mul"):
        def npu_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            """Interleaved pairs regrouped as [evens | odds] for npu_rotary_mul's 'half' mode
            (present in every torch_npu release), in float32, then interleaved back."""
            half, t = cos.shape[-1], x.shape[0]
            nope, rope = x[..., :-2 * half], x[..., -2 * half:].float()
            grouped = torch.cat([rope[..., 0::2], rope[..., 1::2]], dim=-1).reshape(1, t, -1, 2 * half)
            c = torch.cat([cos, cos], dim=-1).float().reshape(1, t, 1, 2 * half)
            s = torch.cat([sin, sin], dim=-1).float().reshape(1, t, 1, 2 * half)
            out = npu.npu_rotary_mul(grouped, c, s).reshape(rope.shape)
            rotated = torch.stack((out[..., :half], out[..., half:]), dim=-1).flatten(-2)
            return torch.cat([nope, rotated.to(x.dtype)], dim=-1)
        ops["rope"] = npu_rope
    if hasattr(npu, "npu_moe_gating_top_k_softmax"):
        def npu_moe_gating(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, func: str,
                           normalize: bool, route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
            """Fused softmax + top-k for a plain softmax gate; other gates (V4's sqrtsoftplus,
            any selection bias) take the reference."""
            if func != "softmax" or bias is not None or logits.dim() != 2:
                return ref_moe_gating(logits, bias, top_k, func, normalize, route_scale)
            weights, ids, _ = npu.npu_moe_gating_top_k_softmax(logits, None, k=top_k)
            if normalize:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            return weights * route_scale, ids.long()
        ops["moe_gating"] = npu_moe_gating
    if hasattr(npu, "npu_fused_infer_attention_score"):
        def npu_attention(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
                          scale: float) -> torch.Tensor:
            """Fused attention, BSND with one shared KV head; the sink is folded in from the
            returned log-sum-exp: out * sigmoid(lse - sink). float32 takes the reference."""
            if q.dtype not in _HALF_DTYPES:
                return ref_attention(q, kv, mask, sink, scale)
            length, heads, _ = q.shape
            k = kv[None, :, None, :]
            kw: dict[str, Any] = dict(atten_mask=~mask[None, None], num_heads=heads, num_key_value_heads=1,
                                      input_layout="BSND", softmax_lse_flag=True)
            try:
                out, lse = npu.npu_fused_infer_attention_score(q[None], k, k, scale=scale, **kw)
            except TypeError:  # older torch_npu releases call it scale_value
                out, lse = npu.npu_fused_infer_attention_score(q[None], k, k, scale_value=scale, **kw)
            keep = torch.sigmoid(lse.float().reshape(heads, length).t() - sink.float()[None, :])
            return (out[0].float() * keep[..., None]).nan_to_num(0.0).to(kv.dtype)
        ops["attention"] = npu_attention
    return ops


