"""Helpers shared by deepinfer's Triton kernels.

Two quirks of Triton's CPU interpreter (``TRITON_INTERPRET=1``, used by the CPU tests)
are handled here so that every kernel computes the same numbers there as on a GPU:

* its float32 -> bfloat16 cast truncates instead of rounding to nearest even, so
  :func:`round_to` rounds with integer bit arithmetic when interpreting;
* its ``tl.dot`` on bfloat16 operands multiplies the raw bit patterns, so :func:`mma`
  upcasts the operands to float32 first when interpreting (bf16 x bf16 products are
  exact in float32, so this matches the tensor cores' float32 accumulation);
* it has no libdevice, which :func:`cos_sin` uses on GPUs (RoPE angles reach thousands of
  radians at long contexts, where only a fully range-reduced cos/sin matches torch's).

Row / token counts and table widths that change with the batch are ``do_not_specialize``
arguments of the decode kernels: one compiled variant then serves every batch bucket and
context length (each compile costs seconds on a fresh device, inside the first step of
each new shape).

Kernels take ``INTERP: tl.constexpr`` (from :func:`interpreting`) and a dtype code
(:func:`dtype_code`) instead of a ``tl.dtype`` so the same source compiles everywhere.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

#: Codes for the activation dtype passed to kernels as a constexpr.
FP32, BF16, FP16 = 0, 1, 2
_CODES = {torch.float32: FP32, torch.bfloat16: BF16, torch.float16: FP16}


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dtype_code(dtype: torch.dtype) -> int:
    """The constexpr code of a supported activation dtype."""
    if dtype not in _CODES:
        raise TypeError(f"unsupported dtype {dtype}; expected one of {list(_CODES)}")
    return _CODES[dtype]


def check_device(*tensors: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under the interpreter."""
    for t in tensors:
        if not (t.is_cuda or interpreting()):
            raise RuntimeError("deepinfer_kernels: CPU tensors need TRITON_INTERPRET=1 "
                               "(use the *_ref functions on CPU otherwise)")


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1); bit arithmetic, as every kernel launch calls it."""
    return 1 << (max(1, int(n)) - 1).bit_length()


@triton.jit
def round_to(x, CODE: tl.constexpr, INTERP: tl.constexpr):
    """Round float32 `x` to the dtype of CODE (nearest even) and return it as float32.
    This is what torch does when an op's float32 result is stored in bf16/fp16."""
    if CODE == 1:
        if INTERP:
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            x = bits.to(tl.float32, bitcast=True)
        else:
            x = x.to(tl.bfloat16).to(tl.float32)
    elif CODE == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def mma(a, b, acc, INTERP: tl.constexpr):
    """acc + a @ b with float32 accumulation (bf16/fp16 operands on tensor cores)."""
    if INTERP:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def cos_sin(x, INTERP: tl.constexpr):
    """float32 (cos x, sin x) accurate at large |x|: libdevice on a GPU, numpy when interpreting."""
    if INTERP:
        c = tl.cos(x)
        s = tl.sin(x)
    else:
        c = libdevice.cos(x)
        s = libdevice.sin(x)
    return c, s


@triton.jit
def rope_tile(v, pos, freq_ptr, ROWS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, INVERSE: tl.constexpr,
              CODE: tl.constexpr, INTERP: tl.constexpr):
    """Interleaved RoPE on the trailing 2 * HALF channels of a [ROWS, D] float32 tile (rows of
    one token at position ``pos``): cos/sin rounded through the dtype of CODE as
    ``Rotary.cos_sin`` does, the rotation in float32 and rounded (``apply_rope``)."""
    even, odd = tl.split(tl.reshape(v, [ROWS, D // 2, 2]))
    pair = tl.arange(0, D // 2) - (D // 2 - HALF)
    is_rope = pair >= 0
    ang = pos.to(tl.float32) * tl.load(freq_ptr + tl.where(is_rope, pair, 0), mask=is_rope, other=0.0)
    cos, sin = cos_sin(ang, INTERP)
    c = round_to(cos, CODE, INTERP)[None, :]
    s = round_to(sin, CODE, INTERP)[None, :]
    if INVERSE:
        s = -s
    rope = is_rope[None, :]
    new_even = tl.where(rope, round_to(even * c - odd * s, CODE, INTERP), even)
    new_odd = tl.where(rope, round_to(odd * c + even * s, CODE, INTERP), odd)
    return tl.reshape(tl.join(new_even, new_odd), [ROWS, D])


@triton.jit
def pooled_entry(acc, wpos, norm_w_ptr, freq_ptr, eps, D: tl.constexpr, ROPE_HALF: tl.constexpr,
                 CODE: tl.constexpr, INTERP: tl.constexpr):
    """A closing window's entry [D] from its float32 weighted sum ``acc``: rounded once,
    RMSNorm, then interleaved RoPE of the trailing 2 * ROPE_HALF channels at the window's
    first position ``wpos`` (cos/sin rounded through the activation dtype)."""
    d = tl.arange(0, D)
    pooled = round_to(acc, CODE, INTERP)
    inv = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(pooled * pooled, axis=0) / D + eps))
    y = round_to(round_to(pooled * inv, CODE, INTERP) * tl.load(norm_w_ptr + d), CODE, INTERP)
    even, odd = tl.split(tl.reshape(y, [D // 2, 2]))
    pair = tl.arange(0, D // 2) - (D // 2 - ROPE_HALF)
    is_rope = pair >= 0
    ang = wpos.to(tl.float32) * tl.load(freq_ptr + tl.where(is_rope, pair, 0), mask=is_rope, other=0.0)
    cos, sin = cos_sin(ang, INTERP)
    c = round_to(cos, CODE, INTERP)
    s = round_to(sin, CODE, INTERP)
    new_even = tl.where(is_rope, round_to(even * c - odd * s, CODE, INTERP), even)
    new_odd = tl.where(is_rope, round_to(odd * c + even * s, CODE, INTERP), odd)
    return tl.reshape(tl.join(new_even, new_odd), [D])
