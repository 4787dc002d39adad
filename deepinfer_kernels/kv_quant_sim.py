"""Value-level FP8 / FP4 block rounding of DeepSeek-V4.1's KV-cache formats inside a kernel
(``deepinfer.models.kv_quant`` is the torch reference; the math is the same operation by
operation, so results are bitwise equal):

* ``FP8``: e4m3 with a power-of-two scale per block (window KV, block 32);
* ``FP4``: e2m1 with a power-of-two scale per block (indexer queries / keys, block 32);
* ``FP4_E4M3``: e2m1 with an e4m3 scale per block (shared compressed KV, block 16).

The e4m3 / e2m1 roundings are done with float32 bit arithmetic rather than Triton's fp8
casts, whose rounding is not defined the same way by the interpreter and every target;
divisions are IEEE (``div_rn``), as torch's are. :func:`kv_quant_sim` runs the rounding on
its own (tests, and a tensor that no fused kernel writes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, next_pow2, round_to

NONE, FP8, FP4, FP4_E4M3 = 0, 1, 2, 3
MODES = {"none": NONE, "fp8": FP8, "fp4": FP4, "fp4_e4m3": FP4_E4M3}


@triton.jit
def _pow2_ceil(x):
    """Smallest power of two >= x (positive normal float32), as ``kv_quant._pow2_ceil``."""
    bits = x.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (tl.minimum(exp, 254) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_round(v):
    """float32 |v| <= 448 to the nearest e4m3 value (ties to even)."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    normal = (((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) << 20).to(tl.float32, bitcast=True)
    sub = (a + 16384.0) - 16384.0  # 2 ** 14: float32 spacing 2 ** -9 there, the subnormal step
    r = tl.where(a < 0.015625, sub, normal)
    return tl.where(v < 0, -r, r)


@triton.jit
def _e2m1_round(v):
    """float32 |v| <= 6 to the e2m1 grid (0, .5, 1, 1.5, 2, 3, 4, 6), ties to the even code."""
    a = tl.abs(v)
    m = (0.5 * (a > 0.25).to(tl.float32) + 0.5 * (a >= 0.75).to(tl.float32) + 0.5 * (a > 1.25).to(tl.float32)
         + 0.5 * (a >= 1.75).to(tl.float32) + (a > 2.5).to(tl.float32) + (a >= 3.5).to(tl.float32)
         + 2.0 * (a > 5.0).to(tl.float32))
    return tl.where(v < 0, -m, m)


@triton.jit
def block_quant_sim(v, ROWS: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr, QB: tl.constexpr):
    """Round a [ROWS, D] float32 tile per QB channels in the format MODE (values of the
    tile's dtype already; the result is float32 and still to be rounded to it)."""
    if MODE == 0:
        return v
    b = tl.reshape(v, [ROWS, D // QB, QB])
    amax = tl.max(tl.abs(b), axis=2)
    if MODE == 1:
        scale = _pow2_ceil(tl.div_rn(tl.maximum(amax, 1e-4), 448.0))
        lim = 448.0
    elif MODE == 2:
        scale = _pow2_ceil(tl.div_rn(tl.maximum(amax, 6.0 * 2.0 ** -126), 6.0))
        lim = 6.0
    else:
        scale = _e4m3_round(tl.minimum(tl.div_rn(tl.maximum(amax, 6.0 * 2.0 ** -9), 6.0), 448.0))  # saturated
        lim = 6.0
    q = tl.minimum(tl.maximum(tl.div_rn(b, scale[:, :, None]), -lim), lim)
    if MODE == 1:
        q = _e4m3_round(q)
    else:
        q = _e2m1_round(q)
    return tl.reshape(q * scale[:, :, None], [ROWS, D])


@triton.jit
def _quant_sim_kernel(x_ptr, out_ptr, D: tl.constexpr, MODE: tl.constexpr, QB: tl.constexpr,
                      CODE: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)
    v = tl.load(x_ptr + t * D + d).to(tl.float32)
    y = tl.reshape(block_quant_sim(tl.reshape(v, [1, D]), 1, D, MODE, QB), [D])
    tl.store(out_ptr + t * D + d, round_to(y, CODE, INTERP).to(out_ptr.dtype.element_ty))


def check_mode(mode: str, block: int, width: int) -> int:
    """The constexpr of ``mode``; a width the block does not divide is left unrounded (as the
    reference does), so it maps to ``none``."""
    if mode not in MODES:
        raise ValueError(f"kv quant mode {mode!r}: expected one of {list(MODES)}")
    if MODES[mode] and (block <= 0 or block != next_pow2(block)):
        raise ValueError(f"kv quant block {block}: expected a power of two")
    return MODES[mode] if MODES[mode] and width % block == 0 else NONE


def kv_quant_sim(x: torch.Tensor, mode: str, block: int) -> torch.Tensor:
    """x [..., D] (D a power of two) rounded per ``block`` channels in ``mode``."""
    check_device(x)
    d = x.shape[-1]
    code = check_mode(mode, block, d)
    if d != next_pow2(d):
        raise ValueError(f"kv_quant_sim: width {d} must be a power of two")
    rows = x.reshape(-1, d).contiguous()
    out = torch.empty_like(rows)
    if rows.shape[0]:
        _quant_sim_kernel[(rows.shape[0],)](rows, out, D=d, MODE=code, QB=block if code else 1,
                                            CODE=dtype_code(x.dtype), INTERP=interpreting(), num_warps=4)
    return out.view(x.shape)


def kv_quant_sim_ref(x: torch.Tensor, mode: str, block: int) -> torch.Tensor:
    """Torch reference of :func:`kv_quant_sim` (``deepinfer.models.kv_quant``)."""
    from deepinfer.models.kv_quant import fp4_block_sim, fp8_block_sim

    check_mode(mode, block, x.shape[-1])
    if mode == "fp8":
        return fp8_block_sim(x, block)
    if mode in ("fp4", "fp4_e4m3"):
        return fp4_block_sim(x, block, e4m3_scale=mode == "fp4_e4m3")
    return x
