"""DeepSeek-V4 mixture of experts: sqrtsoftplus router (or frozen hash routing in the
first layers), clipped-SwiGLU routed experts and one shared expert.

Reference path: experts run one at a time over the tokens routed to them; the fused
MoE kernel replaces this behind the same module.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer import batch_invariant

from . import invariant_ops
from .linear import Linear


def clipped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit): V4 clips pre-activations."""
    return invariant_ops.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class Expert(nn.Module):
    """One SwiGLU expert in the official layout: w1 = gate, w3 = up, w2 = down."""

    def __init__(self, hidden: int, inter: int, limit: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.w1 = Linear(hidden, inter, dtype)
        self.w2 = Linear(inter, hidden, dtype)
        self.w3 = Linear(hidden, inter, dtype)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clipped_swiglu(self.w1(x), self.w3(x), self.limit))


def score(logits: torch.Tensor, func: str) -> torch.Tensor:
    if func == "sqrtsoftplus":
        return invariant_ops.softplus(logits).sqrt()
    if func == "sigmoid":
        return invariant_ops.sigmoid(logits)
    return logits.softmax(dim=-1)


class Gate(nn.Module):
    """Router. Routed layers pick top-k of score + bias (the aux-loss-free correction
    bias only steers selection); hash layers read the experts from `tid2eid[token]`.
    Either way the weights are the selected scores, normalised, times the routed scale."""

    def __init__(self, hidden: int, n_experts: int, top_k: int, is_hash: bool, vocab: int,
                 func: str, route_scale: float, normalize: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, hidden, dtype=dtype))
        self.is_hash, self.top_k, self.func = is_hash, top_k, func
        self.route_scale, self.normalize = route_scale, normalize
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(vocab, top_k, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] -> (weights [T, k] float, expert ids [T, k] int64)."""
        scores = score(invariant_ops.linear(x, self.weight), self.func)
        if self.is_hash:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, ids


class MoE(nn.Module):
    """Routed experts + shared expert for one layer (`ffn.*` in the checkpoint)."""

    def __init__(self, hidden: int, inter: int, n_experts: int, top_k: int, n_shared: int, is_hash: bool,
                 vocab: int, func: str, route_scale: float, normalize: bool, limit: float,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.gate = Gate(hidden, n_experts, top_k, is_hash, vocab, func, route_scale, normalize, dtype)
        self.experts = nn.ModuleList(Expert(hidden, inter, limit, dtype) for _ in range(n_experts))
        self.shared_experts = Expert(hidden, inter, limit, dtype) if n_shared else None
        self.n_experts = n_experts
        # Optional per-expert token counter (EPLB / metrics); None keeps the hot path free.
        self.load_counter: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        # Batch-invariant as written once the linears are: each token's outputs are
        # added in ascending expert id (a fixed order per token) by index_add_.
        if batch_invariant.enabled() and (fused := batch_invariant.get_kernel("moe", x.device.type)):
            return fused(self, x, input_ids)  # GPU: fused grouped GEMM with a fixed combine order
        weights, ids = self.gate(x, input_ids)
        out = torch.zeros_like(x)
        counts = torch.bincount(ids.flatten(), minlength=self.n_experts)
        if self.load_counter is not None:
            self.load_counter += counts
        for e in counts.nonzero().flatten().tolist():
            token, slot = torch.where(ids == e)
            y = self.experts[e](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
