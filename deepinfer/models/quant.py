"""Weight-format codecs for DeepSeek-V4 official checkpoints (pure torch, CPU and GPU).

Formats
-------
* E8M0 scales: a uint8 ``b`` encodes ``2**(b - 127)``; ``b == 255`` is NaN. E8M0 is exactly the
  exponent field of an IEEE float32, which is how it is encoded/decoded here (bit-exact, no
  ``exp2``). Some checkpoints store scales as float32 powers of two instead; decoders accept
  uint8, ``torch.float8_e8m0fnu`` (when available) and floating tensors (used as is).
* FP8 linear weights: ``weight`` float8_e4m3fn ``[out, in]`` plus ``scale`` E8M0
  ``[ceil(out/B0), ceil(in/B1)]``; block (128, 128) for V4 and (32, 32) for V4.1. Partial
  trailing blocks are allowed.
* FP4 routed experts: ``weight`` int8 ``[..., out, in/2]`` holding two e2m1 codes per byte, the
  low nibble is element ``2k`` and the high nibble element ``2k+1``; ``scale`` E8M0
  ``[..., out, in/32]``. An e2m1 nibble is ``sign(bit 3) | magnitude index (bits 2..0)`` into
  ``[0, 0.5, 1, 1.5, 2, 3, 4, 6]``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "E2M1_VALUES", "FP8_E4M3_MAX", "FP4_E2M1_MAX", "SUPPORTED_FP8_BLOCKS",
    "e8m0_to_float", "float_to_e8m0", "quantize_fp8_block", "dequantize_fp8_block",
    "pack_e2m1", "unpack_e2m1", "quantize_fp4", "dequantize_fp4", "infer_block_size",
]

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
SUPPORTED_FP8_BLOCKS: tuple[tuple[int, int], ...] = ((128, 128), (32, 32))
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Value of each 4-bit e2m1 code (index = nibble); codes 8..15 are the negatives (8 is -0.0).
E2M1_VALUES: Tensor = torch.tensor(_E2M1_MAGNITUDES + tuple(-v for v in _E2M1_MAGNITUDES),
                                   dtype=torch.float32)
# Midpoints between consecutive magnitudes, used for round-to-nearest.
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def e8m0_to_float(scale: Tensor) -> Tensor:
    """Decode E8M0 scales to float32.

    uint8 / ``float8_e8m0fnu``: byte ``b`` -> ``2**(b-127)`` exactly (``b == 0`` gives the float32
    subnormal ``2**-127``; ``b == 255`` gives NaN). Floating tensors (checkpoints that store
    power-of-two float32 scales) are returned as float32 unchanged in value.
    """
    if _E8M0_DTYPE is not None and scale.dtype == _E8M0_DTYPE:
        scale = scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        b = scale.to(torch.int32)
        bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
        bits = torch.where(b == 255, torch.full_like(b, 0x7FC00000), bits)
        return bits.view(torch.float32)
    if scale.is_floating_point() and scale.element_size() > 1:
        return scale.to(torch.float32)
    raise ValueError(f"scale: expected dtype uint8, float8_e8m0fnu or a float dtype, "
                     f"got {scale.dtype}")


def float_to_e8m0(x: Tensor, rounding: str = "ceil") -> Tensor:
    """Encode positive finite values as E8M0 bytes (uint8).

    ``rounding="ceil"`` gives the smallest power of two ``>= x`` (so ``v / scale`` never exceeds
    the format maximum when ``x = amax / max``); ``"floor"`` the largest power of two ``<= x``.
    The exponent is clamped to ``[-127, 127]`` (bytes 0..254); 255 (NaN) is never produced.
    Values are taken at their float32 representation.
    """
    if rounding not in ("ceil", "floor"):
        raise ValueError(f"rounding: expected 'ceil' or 'floor', got {rounding!r}")
    if not x.is_floating_point():
        raise ValueError(f"x: expected a floating dtype, got {x.dtype}")
    x = x.to(torch.float32)
    if x.numel() and not bool(((x > 0) & torch.isfinite(x)).all()):
        raise ValueError("x: all values must be finite and > 0")
    bits = x.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    if rounding == "ceil":
        # Normal: 2**(exp-127) * 1.m -> bump exponent if m != 0. Subnormal (exp == 0): the value
        # is mant * 2**-149, i.e. <= 2**-127 iff mant <= 2**22.
        out = torch.where(exp == 0, (mant > 0x400000).to(torch.int32), exp + (mant != 0).to(torch.int32))
    else:
        out = exp  # subnormals floor to 2**-127 (byte 0, the clamp)
    return out.clamp(0, 254).to(torch.uint8)


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"block: expected two positive ints, got {block!r}")
    return int(block[0]), int(block[1])


def infer_block_size(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> tuple[int, int]:
    """Derive the square FP8 block (128 or 32) from a weight and its scale shape.

    Returns the first supported block whose ceil-division of ``weight_shape`` equals
    ``scale_shape`` (128 is tried first; both only match when ``out, in <= 32``, where they
    dequantize identically). Raises ValueError naming both shapes when none fits.
    """
    ws, ss = tuple(int(d) for d in weight_shape), tuple(int(d) for d in scale_shape)
    if len(ws) == 2 and len(ss) == 2:
        for b0, b1 in SUPPORTED_FP8_BLOCKS:
            if ss == (math.ceil(ws[0] / b0), math.ceil(ws[1] / b1)):
                return b0, b1
    raise ValueError(f"no supported block {SUPPORTED_FP8_BLOCKS} maps weight shape {ws} "
                     f"to scale shape {ss}")


def quantize_fp8_block(w: Tensor, block: tuple[int, int] = (128, 128)) -> tuple[Tensor, Tensor]:
    """Block-quantize a 2-D weight to (float8_e4m3fn ``[out, in]``, E8M0 uint8 scale).

    Per block: ``scale = pow2_ceil(amax / 448)`` (all-zero blocks get scale 1.0), weight =
    ``w / scale`` rounded to nearest-even e4m3 (never overflows since ``|w/scale| <= 448``).
    """
    b0, b1 = _check_block(block)
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"w: expected a 2-D floating tensor [out, in], got {w.dtype} {_shape(w)}")
    out, inn = w.shape
    n0, n1 = math.ceil(out / b0), math.ceil(inn / b1)
    wf = w.to(torch.float32)
    padded = torch.nn.functional.pad(wf.abs(), (0, n1 * b1 - inn, 0, n0 * b0 - out))
    amax = padded.view(n0, b0, n1, b1).amax(dim=(1, 3))
    ratio = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    scale = float_to_e8m0(ratio)
    full = e8m0_to_float(scale).repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :inn]
    q = (wf / full).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8_block(weight: Tensor, scale: Tensor, block: tuple[int, int] | None = (128, 128),
                         dtype: torch.dtype = torch.float32) -> Tensor:
    """Dequantize ``w[i, j] = weight[i, j] * scale[i // B0, j // B1]`` to ``dtype``.

    ``block=None`` infers it from the shapes (see :func:`infer_block_size`). ``scale`` may be
    uint8 / float8_e8m0fnu E8M0 or float32 powers of two.
    """
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-D float8_e4m3fn tensor [out, in], "
                         f"got {weight.dtype} {_shape(weight)}")
    out, inn = weight.shape
    if block is None:
        block = infer_block_size(_shape(weight), _shape(scale))
    b0, b1 = _check_block(block)
    expected = (math.ceil(out / b0), math.ceil(inn / b1))
    if _shape(scale) != expected:
        raise ValueError(f"scale: expected shape {expected} for weight shape {(out, inn)} and "
                         f"block {(b0, b1)}, got {_shape(scale)}")
    s = e8m0_to_float(scale).to(weight.device)
    full = s.repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :inn]
    return (weight.to(torch.float32) * full).to(dtype)


def pack_e2m1(codes: Tensor) -> Tensor:
    """Pack 4-bit codes ``[..., n]`` (integer, values 0..15, n even) into int8 ``[..., n/2]``.

    Element ``2k`` goes to the low nibble and ``2k+1`` to the high nibble of byte ``k``.
    """
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise ValueError(f"codes: expected an integer dtype (uint8), got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"codes: expected an even last dimension, got shape {_shape(codes)}")
    if codes.numel() and not bool(((codes >= 0) & (codes <= 15)).all()):
        raise ValueError("codes: values must be in [0, 15]")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def unpack_e2m1(packed: Tensor) -> Tensor:
    """Unpack int8/uint8 ``[..., m]`` into uint8 codes ``[..., 2m]`` (low nibble first)."""
    if packed.dtype not in (torch.int8, torch.uint8) or packed.dim() == 0:
        raise ValueError(f"packed: expected an int8/uint8 tensor [..., in/2], "
                         f"got {packed.dtype} {_shape(packed)}")
    p = packed.view(torch.uint8)
    return torch.stack((p & 0x0F, p >> 4), dim=-1).flatten(-2)


def quantize_fp4(w: Tensor, group: int = 32) -> tuple[Tensor, Tensor]:
    """Quantize ``w [..., out, in]`` to (int8 ``[..., out, in/2]``, E8M0 uint8 ``[..., out, in/group]``).

    Per group of ``group`` consecutive inputs: ``scale = pow2_ceil(amax / 6)`` (all-zero groups
    get 1.0); ``w / scale`` is rounded to the nearest e2m1 magnitude, exact ties going to the
    even code (i.e. the value with an even mantissa bit, IEEE round-half-even: 0.25->0,
    0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4). Zeros are encoded as +0 (code 0).
    """
    if not isinstance(group, int) or group <= 0 or group % 2:
        raise ValueError(f"group: expected a positive even int, got {group!r}")
    if w.dim() < 1 or not w.is_floating_point():
        raise ValueError(f"w: expected a floating tensor [..., out, in], got {w.dtype} {_shape(w)}")
    inn = w.shape[-1]
    if inn % group:
        raise ValueError(f"w: last dimension (in={inn}) must be a multiple of group={group}, "
                         f"got shape {_shape(w)}")
    g = w.to(torch.float32).reshape(*w.shape[:-1], inn // group, group)
    amax = g.abs().amax(dim=-1)
    scale = float_to_e8m0(torch.where(amax > 0, amax / FP4_E2M1_MAX, torch.ones_like(amax)))
    q = (g / e8m0_to_float(scale).unsqueeze(-1)).reshape(w.shape)
    a = q.abs().clamp(max=FP4_E2M1_MAX)
    bounds = torch.tensor(_E2M1_BOUNDS, dtype=torch.float32, device=w.device)
    code = torch.bucketize(a, bounds)  # ties (a == bound) go to the lower code ...
    tie = (a == bounds[code.clamp(max=len(_E2M1_BOUNDS) - 1)]) & (code % 2 == 1)
    code = code + tie.to(code.dtype)  # ... and are moved up when the lower code is odd
    code = code + 8 * ((q < 0) & (code != 0)).to(code.dtype)
    return pack_e2m1(code.to(torch.uint8)), scale


def dequantize_fp4(packed: Tensor, scale: Tensor, group: int = 32,
                   dtype: torch.dtype = torch.float32) -> Tensor:
    """Dequantize int8 ``[..., out, in/2]`` with E8M0 ``[..., out, in/group]`` to ``[..., out, in]``."""
    if not isinstance(group, int) or group <= 0:
        raise ValueError(f"group: expected a positive int, got {group!r}")
    if packed.dtype not in (torch.int8, torch.uint8) or packed.dim() == 0:
        raise ValueError(f"packed: expected an int8 tensor [..., out, in/2], "
                         f"got {packed.dtype} {_shape(packed)}")
    inn = 2 * packed.shape[-1]
    if inn % group:
        raise ValueError(f"packed: in={inn} (2 x last dim of shape {_shape(packed)}) must be a "
                         f"multiple of group={group}")
    expected = (*packed.shape[:-1], inn // group)
    if _shape(scale) != expected:
        raise ValueError(f"scale: expected shape {expected} for packed shape {_shape(packed)} "
                         f"and group {group}, got {_shape(scale)}")
    vals = E2M1_VALUES.to(packed.device)[unpack_e2m1(packed).long()]
    s = e8m0_to_float(scale).to(packed.device).unsqueeze(-1)
    out = vals.view(*packed.shape[:-1], inn // group, group) * s
    return out.reshape(*packed.shape[:-1], inn).to(dtype)
