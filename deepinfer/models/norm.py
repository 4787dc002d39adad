"""RMSNorm variants used by DeepSeek-V4 (reference path)."""

from __future__ import annotations

import torch
from torch import nn

from .invariant_ops import mean_square


class RMSNorm(nn.Module):
    """Weighted RMSNorm. Normalises in float32; the weight stays float32 (as the
    checkpoint's norms are kept in full precision) and multiplies the normalised value
    cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(mean_square(xf) + self.eps)  # fixed-order on GPUs in batch-invariant mode
        return (self.weight * xf.to(dtype)).to(dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (per-head query norm, mHC input norm)."""
    return x * torch.rsqrt(mean_square(x) + eps).to(x.dtype)
