"""Value-level simulation of DeepSeek-V4.1's KV-cache storage formats (reference path).

The official reference (and transformers' port) stores window KV as FP8 e4m3 with one
power-of-two scale per 32 channels, the shared compressed KV as FP4 e2m1 with one e4m3
scale per 16 channels, and indexer queries / keys as FP4 with a power-of-two scale per
32 channels. The model was trained with that rounding ("QAT semantics"), so the reference
path rounds the values it stores and reads exactly the same way; a tensor whose last
dimension is not a multiple of the block (tiny test shapes) is left as it is.
"""

from __future__ import annotations

import torch

from .quant import FP4_E2M1_MAX, FP8_E4M3_MAX

_E2M1_MAG = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x for positive normal float32 x, as the ue8m0 scale
    rounding does; bit operations only (no host sync: CUDA-graph safe)."""
    bits = x.float().contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp.clamp(max=254) << 23).view(torch.float32)


_E2M1_CONSTS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _e2m1_consts(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(bounds, magnitudes) on ``device``, built once (a host-built tensor per call would
    be a host -> device copy, which a CUDA-graph capture forbids)."""
    consts = _E2M1_CONSTS.get(device)
    if consts is None:
        consts = _E2M1_CONSTS[device] = (torch.tensor(_E2M1_BOUNDS, dtype=torch.float32, device=device),
                                         torch.tensor(_E2M1_MAG, dtype=torch.float32, device=device))
    return consts


def e2m1_round(q: torch.Tensor) -> torch.Tensor:
    """Round float32 values (already within +-6) to the e2m1 grid, ties to the even code."""
    bounds, mags = _e2m1_consts(q.device)
    a = q.abs()
    code = torch.bucketize(a, bounds)  # a == bound goes to the lower code ...
    tie = (a == bounds[code.clamp(max=len(_E2M1_BOUNDS) - 1)]) & (code % 2 == 1)
    code = code + tie.to(code.dtype)  # ... and up when the lower code is odd
    return torch.where(q < 0, -mags[code], mags[code])


def fp8_block_sim(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 e4m3 with a power-of-two scale per `block` channels (window KV)."""
    n = x.shape[-1]
    if n % block:
        return x
    b = x.float().unflatten(-1, (n // block, block))
    scale = _pow2_ceil(b.abs().amax(-1).clamp_min(1e-4) / FP8_E4M3_MAX).unsqueeze(-1)
    q = (b / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).flatten(-2).to(x.dtype)


def fp4_block_sim(x: torch.Tensor, block: int, e4m3_scale: bool = False) -> torch.Tensor:
    """FP4 e2m1 per `block` channels: power-of-two scales (index q/k, block 32) or e4m3
    scales (shared compressed KV, block 16)."""
    n = x.shape[-1]
    if n % block:
        return x
    b = x.float().unflatten(-1, (n // block, block))
    amax = b.abs().amax(-1)
    if e4m3_scale:
        scale = (amax.clamp_min(FP4_E2M1_MAX * 2.0 ** -9) / FP4_E2M1_MAX).to(torch.float8_e4m3fn).float()
    else:
        scale = _pow2_ceil(amax.clamp_min(FP4_E2M1_MAX * 2.0 ** -126) / FP4_E2M1_MAX)
    scale = scale.unsqueeze(-1)
    q = e2m1_round((b / scale).clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX))
    return (q * scale).flatten(-2).to(x.dtype)
