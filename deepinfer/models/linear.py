"""Linear layers of the reference path.

Weights are dense tensors in the compute dtype. A checkpoint's FP8/FP4 bytes are
dequantized by the loader; it also keeps the raw quantized tensors on `quantized`
so compiled kernels can consume them without re-reading the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer import batch_invariant

from . import invariant_ops


@dataclass
class QuantizedWeight:
    """Raw checkpoint bytes of one quantized weight: format 'fp8' (e4m3, block scales)
    or 'fp4' (packed e2m1, one scale per 32 inputs)."""

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]


class Linear(nn.Module):
    """y = x @ W^T without bias; W is [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.quantized: QuantizedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if batch_invariant.enabled():  # fixed-shape GEMMs (invariant_ops.linear)
            return invariant_ops.linear(x, self.weight)
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        q = f", quantized={self.quantized.fmt}" if self.quantized is not None else ""
        return f"{self.in_features} -> {self.out_features}{q}"


class GroupedLinear(Linear):
    """Block-diagonal projection of the grouped low-rank attention output (`wo_a`):
    head group g ([T, in_per_group]) is projected by rows [g*rank, (g+1)*rank) of W."""

    def __init__(self, in_per_group: int, out_features: int, groups: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(in_per_group, out_features, dtype)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, groups, in_per_group] -> [T, groups * rank]."""
        w = self.weight.view(self.groups, -1, self.in_features)  # [G, rank, in]
        if batch_invariant.enabled():
            return invariant_ops.grouped_linear(x, w)
        y = torch.bmm(x.transpose(0, 1), w.transpose(1, 2))  # [G, T, rank]
        return y.transpose(0, 1).reshape(x.shape[0], -1)
