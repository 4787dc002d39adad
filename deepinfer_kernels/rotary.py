"""Interleaved partial RoPE on the trailing ``rope_dim`` channels of every head.

Same math as ``deepinfer.models.rope.apply_rope``: channel pairs (2i, 2i+1) of the rope
slice rotate by angle ``pos * inv_freq[i]``; math in float32, result rounded to x's
dtype; the leading (nope) channels pass through. The cos/sin table is either given
(float32 [T, rope_dim/2], as ``Rotary.cos_sin`` returns it) or computed in the kernel
from per-token positions and ``inv_freq``, rounded through x's dtype exactly as
``Rotary.cos_sin(positions, x.dtype)`` does. ``inverse=True`` rotates by -angle (the
output un-rotation of V4 attention).

One program handles one token and ``BLOCK_H`` heads: the rope slice is loaded as
contiguous rows and split into even/odd lanes in registers.
"""

from __future__ import annotations

import types

import torch
import triton
import triton.language as tl

from ._common import check_device, cos_sin, dtype_code, interpreting, next_pow2, round_to


@triton.jit
def _rotary_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, freq_ptr, H, D, NOPE,
                   stride_xt, stride_xh, stride_ot, stride_oh, stride_ct,
                   FROM_POS: tl.constexpr, INVERSE: tl.constexpr, COPY_NOPE: tl.constexpr,
                   CODE: tl.constexpr, INTERP: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    lanes = tl.arange(0, HALF)
    if FROM_POS:
        pos = tl.load(pos_ptr + t).to(tl.float32)
        ang = pos * tl.load(freq_ptr + lanes)
        cos, sin = cos_sin(ang, INTERP)
        c = round_to(cos, CODE, INTERP)
        s = round_to(sin, CODE, INTERP)
    else:
        c = tl.load(cos_ptr + t * stride_ct + lanes)
        s = tl.load(sin_ptr + t * stride_ct + lanes)
    if INVERSE:
        s = -s
    x_row = x_ptr + t * stride_xt + heads[:, None].to(tl.int64) * stride_xh
    o_row = out_ptr + t * stride_ot + heads[:, None].to(tl.int64) * stride_oh
    cols = tl.arange(0, 2 * HALF)
    x = tl.load(x_row + NOPE + cols[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
    even, odd = tl.split(tl.reshape(x, [BLOCK_H, HALF, 2]))
    new_even = even * c[None, :] - odd * s[None, :]
    new_odd = odd * c[None, :] + even * s[None, :]
    y = tl.reshape(tl.join(new_even, new_odd), [BLOCK_H, 2 * HALF])
    y = round_to(y, CODE, INTERP)
    tl.store(o_row + NOPE + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    if COPY_NOPE:
        for c0 in range(0, NOPE, BLOCK_C):
            cc = c0 + tl.arange(0, BLOCK_C)
            m = hmask[:, None] & (cc[None, :] < NOPE)
            tl.store(o_row + cc[None, :], tl.load(x_row + cc[None, :], mask=m), mask=m)


def _as_thd(x: torch.Tensor) -> torch.Tensor:
    """[T, ..., D] -> a [T, H, D] view (last dim contiguous), without copying."""
    if x.dim() == 2:
        x = x.unsqueeze(1)
    v = x.view(x.shape[0], -1, x.shape[-1]) if x.dim() > 3 else x
    if v.stride(-1) != 1:
        raise ValueError("rotary: the last dim of x must be contiguous")
    return v


def rotary(x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, *,
           positions: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
           inverse: bool = False, inplace: bool = False) -> torch.Tensor:
    """RoPE on the trailing channels of x ([T, D] or [T, ..., D], bf16/fp16/fp32).

    Give either `cos`/`sin` (float32 [T, rope_dim/2]) or `positions` ([T] int) and
    `inv_freq` (float32 [rope_dim/2]). `inplace=True` rotates x's rope slice in place
    and returns x; otherwise returns a new tensor with the nope channels copied.
    """
    check_device(x)
    from_pos = positions is not None
    if from_pos:
        assert inv_freq is not None and cos is None and sin is None
        half = inv_freq.numel()
        freq = inv_freq.to(device=x.device, dtype=torch.float32).contiguous()
        pos = positions.to(x.device).contiguous()
        cos = sin = freq  # unused
        stride_ct = 0
    else:
        assert cos is not None and sin is not None and cos.shape == sin.shape
        half = cos.shape[-1]
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        pos = freq = cos  # unused
        stride_ct = cos.stride(0)
    assert half & (half - 1) == 0, "rope_dim/2 must be a power of two"
    d = x.shape[-1]
    assert 2 * half <= d
    xv = _as_thd(x)
    out = x if inplace else torch.empty_like(x, memory_format=torch.contiguous_format)
    ov = xv if inplace else _as_thd(out)
    t, h = xv.shape[0], xv.shape[1]
    block_h = min(next_pow2(h), max(1, 4096 // (2 * half)))
    if t and h:
        _rotary_kernel[(t, triton.cdiv(h, block_h))](
            xv, ov, cos, sin, pos, freq, h, d, d - 2 * half,
            xv.stride(0), xv.stride(1), ov.stride(0), ov.stride(1), stride_ct,
            FROM_POS=from_pos, INVERSE=inverse, COPY_NOPE=not inplace and d > 2 * half,
            CODE=dtype_code(x.dtype), INTERP=interpreting(), HALF=half, BLOCK_H=block_h,
            BLOCK_C=min(next_pow2(d - 2 * half), 256), num_warps=4)
    return out


def rotary_ref(x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, *,
               positions: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
               inverse: bool = False, inplace: bool = False) -> torch.Tensor:
    """Torch reference with the signature of :func:`rotary`: the model's
    ``Rotary.cos_sin`` (for positions) and ``apply_rope``."""
    from deepinfer.models.rope import Rotary, apply_rope

    if positions is not None:
        cos, sin = Rotary.cos_sin(types.SimpleNamespace(inv_freq=inv_freq), positions, x.dtype)
    y = apply_rope(x, cos, -sin if inverse else sin)
    if inplace:
        x.copy_(y)
        return x
    return y
