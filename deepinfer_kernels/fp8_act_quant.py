"""Per-token-group FP8 activation quantisation (the "a8" of the w8a8 FP8 GEMM).

Math, for each row of ``x`` [M, K] and each group of ``group`` consecutive columns
(the weight block's K extent: 128 for V4, 32 for V4.1; a trailing group may be short):

* ``amax = max(|x|, 1e-10)`` over the group (in float32);
* ``scale = 2 ** ceil(log2(amax / 448))``, an exact power of two (the checkpoint's
  ``scale_fmt: ue8m0``), computed from the float32 bits so it is exact everywhere;
* ``q = e4m3(x / scale)`` rounded to nearest even; ``|x / scale| <= 448`` so it never
  saturates. Returns ``(q float8_e4m3fn [M, K], scale float32 [M, ceil(K / group)])``.

Dividing by a power of two is exact, so ``q * scale`` differs from ``x`` only by the
e4m3 rounding (at most 2^-4 relative).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import check_device, interpreting, next_pow2

FP8_MAX = 448.0
AMAX_FLOOR = 1e-10  # all-zero groups get a normal (finite, non-zero) scale


@triton.jit
def pow2_ceil(x):
    """Smallest power of two >= x for positive normal float32 x, from the bits (exact)."""
    bits = x.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exp << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_e4m3(x, INTERP: tl.constexpr):
    """x (float32, |x| <= 448) rounded to the nearest e4m3 value (ties to even), as
    float32. The GPU's cvt rounds this way; the CPU interpreter's cast does not, so
    there the rounding is done by hand: scale by the value's e4m3 ulp (2^(e-3), with
    e >= -6 for subnormals), round half-even with the 1.5 * 2^23 trick, scale back."""
    if INTERP:
        bits = x.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127
        e = tl.maximum(e, -6)
        ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
        r = x / ulp
        r = (r + 12582912.0) - 12582912.0
        x = r * ulp
    else:
        x = x.to(tl.float8e4nv).to(tl.float32)
    return x


@triton.jit(do_not_specialize=["M"])  # token counts: one compiled variant for all
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, stride_s, stride_sg,
                      GROUP: tl.constexpr, GROUPS: tl.constexpr, INTERP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    j = tl.arange(0, GROUP)
    cols = g[:, None] * GROUP + j[None, :]
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10)
    scale = pow2_ceil(amax / 448.0)
    q = round_e4m3(x * (1.0 / scale)[:, None], INTERP)
    tl.store(q_ptr + row * stride_q + cols, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row * stride_s + g * stride_sg, scale, mask=g * GROUP < K)


def act_quant(x: torch.Tensor, group: int, col_major_scales: bool = False,
              pad_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise x [M, K] (any float dtype, last dim contiguous) per row and group of
    ``group`` columns (a power of two >= 16): (float8_e4m3fn [M, K], float32 [M, G]).
    ``col_major_scales``: the scales are a transposed view of a [G, M] buffer (strides
    (1, M)), the layout cuBLAS's block-scaled FP8 GEMM reads. ``pad_rows``: both outputs
    get M rounded up to a multiple of it rows, the extra ones zero (scale 1)."""
    check_device(x)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x: expected a 2-D tensor with a contiguous last dim, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if group < 16 or group != next_pow2(group):
        raise ValueError(f"group: expected a power of two >= 16, got {group}")
    m, k = x.shape
    n_groups = math.ceil(k / group)
    rows = -(-m // pad_rows) * pad_rows
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(n_groups, rows, dtype=torch.float32, device=x.device).t() if col_major_scales else \
        torch.empty(rows, n_groups, dtype=torch.float32, device=x.device)
    if rows > m:
        q[m:].view(torch.uint8).zero_()
        s[m:].fill_(1.0)
    if m == 0 or k == 0:
        return q, s
    groups = max(1, min(next_pow2(n_groups), 2048 // group))  # ~2k elements a program
    _act_quant_kernel[(m, triton.cdiv(n_groups, groups))](
        x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
        GROUP=group, GROUPS=groups, INTERP=interpreting(), num_warps=4)
    return q, s


def act_quant_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`act_quant` (same power-of-two scales, torch's RNE cast)."""
    from deepinfer.models.quant import e8m0_to_float, float_to_e8m0

    m, k = x.shape
    n_groups = math.ceil(k / group)
    xf = torch.nn.functional.pad(x.float(), (0, n_groups * group - k)).view(m, n_groups, group)
    amax = xf.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    scale = e8m0_to_float(float_to_e8m0(amax / FP8_MAX, "ceil"))
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, n_groups * group)[:, :k].contiguous(), scale
