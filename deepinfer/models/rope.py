"""Rotary position embedding for DeepSeek-V4: interleaved pairs on the trailing
`rope_dim` channels of each head, plain RoPE (theta 10000) for sliding-only layers and
YaRN-scaled RoPE (theta 160000) for the compressed branches."""

from __future__ import annotations

import math

import torch


def default_inv_freq(rope_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device="cpu") / rope_dim))


def yarn_inv_freq(rope_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN frequencies (NTK-by-parts). V4 keeps the attention factor at 1.0, so only
    the frequencies change."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device="cpu") / rope_dim)
    extrapolation, interpolation = 1.0 / pos, 1.0 / (factor * pos)
    keep = 1 - ramp  # share of the unscaled frequency
    return interpolation * (1 - keep) + extrapolation * keep


class Rotary:
    """cos/sin tables for one rope flavour, computed on demand for given positions."""

    def __init__(self, rope_dim: int, theta: float, scaling: dict | None = None) -> None:
        self.rope_dim = rope_dim
        kind = (scaling or {}).get("type", (scaling or {}).get("rope_type"))
        self.inv_freq = yarn_inv_freq(rope_dim, theta, scaling) if kind == "yarn" else default_inv_freq(rope_dim, theta)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for `positions` [T], rounded through `dtype` (the activation dtype) as
        the reference implementation does, returned in float32."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        return freqs.cos().to(dtype).float(), freqs.sin().to(dtype).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing `2 * cos.shape[-1]` channels of `x` in interleaved pairs.

    x: [T, ..., D]; cos/sin: [T, rope_dim // 2] (one row per token). Math in float32.
    Pass `-sin` to undo the rotation.
    """
    rope_dim = 2 * cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)
