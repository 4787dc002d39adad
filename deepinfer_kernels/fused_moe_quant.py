"""Fused routed-expert MoE on quantized expert weights, FP8 e4m3 block-scaled or FP4 e2m1
group-scaled, weight-only (w8a16 / w4a16: activations stay in the compute dtype).

:mod:`fused_moe`'s kernels (alignment, grid, GEMM loops, clipped SwiGLU, fixed-order combine, every
rounding point) with each weight tile decoded in the kernel: ``q * 2**(b-127)`` in float32 (``q`` the
e4m3 / e2m1 value, ``b`` its E8M0 scale byte), cast to the activation dtype, fed to ``tl.dot``. With 4 /
2 significant bits against bf16's 8, the product is exact in bf16 (no flush-to-zero, no overflow) for
scale exponents in [-117, 119] (FP4: [-125, 113]), far wider than any checkpoint's (amax / 448 or / 6
rounded up to a power of two): bit for bit the weight ``deepinfer.models.quant`` dequantizes. So the
output is :func:`fused_moe.fused_moe`'s on the dequantized weights with the same tiles (up to the float32
accumulation order, see FP4 below), from 1/2 (FP8) or ~1/4 (FP4) of the weight bytes. Weight-only suits
decode, bound by weight reads; w8a8 would change the numbers.

Scales: E8M0 bytes (uint8 / float8_e8m0fnu; float powers of two are encoded on the host). With
SB_K a scale block's K extent (FP8 block[1], FP4 the group), ``_scales`` reads one per row and
tile when BLOCK_K divides SB_K, [BLOCK_N, BLOCK_K // SB_K] broadcast along K when SB_K divides
BLOCK_K, else one per element. FP4 bytes hold element 2k in the low nibble, 2k+1 in the high:
the nibbles decode to the tile's even and odd columns, multiplied by the activation's even and
odd columns (two K = BLOCK_K / 2 dots: faster on an H200 than tl.join-interleaving into one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, mma, next_pow2, round_to
from .fused_moe import _combine_kernel, _config, block_slots, clipped_swiglu_rounded, fused_moe_ref
from .moe_align import moe_align

_E8M0_DTYPES = tuple(d for d in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)) if d is not None)


@triton.jit
def _e8m0(b):  # E8M0 bytes -> float32 2**(b - 127) (0: the subnormal 2**-127; 255: NaN), as quant.py
    bits = tl.where(b == 0, 0x00400000, tl.where(b == 255, 0x7FC00000, b.to(tl.int32) << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scales(s_ptr, n, nmask, k0, stride_sn, n_sk, SB_N: tl.constexpr, SB_K: tl.constexpr, SMODE: tl.constexpr,
            STEP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 scales [BLOCK_N, BLOCK_K / STEP] of rows n, column c holding elements k0 + STEP * c
    .. + STEP - 1 (STEP divides SB_K); [BLOCK_N, 1] in SMODE 1."""
    srow = s_ptr + (n // SB_N).to(tl.int64) * stride_sn
    if SMODE == 1:  # the tile lies inside one scale block along K
        s = _e8m0(tl.load(srow + k0 // SB_K, mask=nmask, other=127))[:, None]
    else:  # SMODE 2: BLOCK_K // SB_K whole scale blocks; 0 (unaligned): one scale per column
        c = tl.arange(0, BLOCK_K // SB_K if SMODE == 2 else BLOCK_K // STEP)
        j = k0 // SB_K + c if SMODE == 2 else (k0 + STEP * c) // SB_K
        s = _e8m0(tl.load(srow[:, None] + j[None, :], mask=nmask[:, None] & (j < n_sk)[None, :], other=127))
        if SMODE == 2:
            s = tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_N, BLOCK_K // SB_K, SB_K // STEP]),
                           [BLOCK_N, BLOCK_K // STEP])
    return s


@triton.jit
def _tile_mma(acc, a, w_ptr, s_ptr, n, nmask, k0, K, stride_wn, stride_sn, n_sk, FP4: tl.constexpr,
              SB_N: tl.constexpr, SB_K: tl.constexpr, SMODE: tl.constexpr, EVEN_K: tl.constexpr, INTERP: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + a @ W[n, k0 : k0 + BLOCK_K]^T, this expert's weight tile decoded (0 past K)."""
    kk = tl.arange(0, BLOCK_K // 2 if FP4 else BLOCK_K)  # FP4: byte columns
    mask = nmask[:, None]
    if not EVEN_K:
        mask = mask & (kk < ((K - k0) // 2 if FP4 else K - k0))[None, :]
    ptrs = w_ptr + n.to(tl.int64)[:, None] * stride_wn + ((k0 // 2 if FP4 else k0) + kk)[None, :]
    s = _scales(s_ptr, n, nmask, k0, stride_sn, n_sk, SB_N, SB_K, SMODE, 2 if FP4 else 1, BLOCK_N, BLOCK_K)
    if FP4:
        # magnitude bits at fp16 bits 9-11 (exponent LSBs, mantissa MSB), sign at 15: fp16 2**-14 * e2m1
        p = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        lo = (((p & 7) << 9) | ((p & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (((p & 0x70) << 5) | ((p & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        s = s * 16384.0
        a_even, a_odd = tl.split(tl.reshape(a, [BLOCK_M, BLOCK_K // 2, 2]))  # columns k0 + 2c, k0 + 2c + 1
        acc = mma(a_even, tl.trans((lo * s).to(a.dtype)), acc, INTERP)
        acc = mma(a_odd, tl.trans((hi * s).to(a.dtype)), acc, INTERP)
    else:
        w = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * s
        acc = mma(a, tl.trans(w.to(a.dtype)), acc, INTERP)
    return acc


@triton.jit(do_not_specialize=["n_slots"])
def _expert_gemm_kernel(a_ptr, w_ptr, w3_ptr, s_ptr, s3_ptr, topw_ptr, out_ptr, sorted_ptr, block_expert_ptr,
                        n_slots, K, N, stride_a, stride_we, stride_wn, stride_se, stride_sn, n_sk, limit,
                        GATE_UP: tl.constexpr, TOPK: tl.constexpr, FP4: tl.constexpr, SB_N: tl.constexpr,
                        SB_K: tl.constexpr, SMODE: tl.constexpr, CODE: tl.constexpr, INTERP: tl.constexpr,
                        EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """GATE_UP: act = clipped SwiGLU(x W1^T, x W3^T) (K = H, N = I, rows = tokens);
    else the down projection y = round(act W2^T) * w (K = I, N = H, rows = slots, TOPK = 1).
    The loops and epilogues of fused_moe's _gate_up_kernel / _down_kernel."""
    pid_n = tl.program_id(0)
    e, slots, valid = block_slots(block_expert_ptr, sorted_ptr, n_slots, BLOCK_M)
    if e < 0:
        return
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (slots // TOPK)[:, None] * stride_a + k[None, :]
    e = e.to(tl.int64)
    w_ptr, w3_ptr = w_ptr + e * stride_we, w3_ptr + e * stride_we
    s_ptr, s3_ptr = s_ptr + e * stride_se, s3_ptr + e * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=valid[:, None] & ((k0 + k) < K)[None, :], other=0.0)
        acc = _tile_mma(acc, a, w_ptr, s_ptr, n, nmask, k0, K, stride_wn, stride_sn, n_sk,
                        FP4, SB_N, SB_K, SMODE, EVEN_K, INTERP, BLOCK_M, BLOCK_N, BLOCK_K)
        if GATE_UP:
            acc_u = _tile_mma(acc_u, a, w3_ptr, s3_ptr, n, nmask, k0, K, stride_wn, stride_sn, n_sk,
                              FP4, SB_N, SB_K, SMODE, EVEN_K, INTERP, BLOCK_M, BLOCK_N, BLOCK_K)
        a_ptrs += BLOCK_K
    if GATE_UP:
        y = clipped_swiglu_rounded(acc, acc_u, limit, CODE, INTERP)
    else:
        w = tl.load(topw_ptr + slots, mask=valid, other=0.0).to(tl.float32)
        y = round_to(round_to(acc, CODE, INTERP) * w[:, None], CODE, INTERP)
    out = out_ptr + slots[:, None] * N + n[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


def _e8m0_bytes(name: str, s: torch.Tensor) -> torch.Tensor:
    """Scales as E8M0 uint8: bytes as they are, float powers of two encoded (host check)."""
    from deepinfer.models.quant import e8m0_to_float, float_to_e8m0

    if s.dtype in _E8M0_DTYPES:
        return s.view(torch.uint8)
    if not s.is_floating_point():
        raise ValueError(f"{name}: expected E8M0 scales (uint8 / float8_e8m0fnu) or float powers of two, got {s.dtype}")
    b = float_to_e8m0(s)
    if not torch.equal(e8m0_to_float(b), s.float()):
        raise ValueError(f"{name}: float scales must be powers of two (E8M0)")
    return b


def _want(name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype not in dtypes or (t.numel() and t.stride(-1) != 1):
        raise ValueError(f"{name}: expected {'/'.join(str(d).replace('torch.', '') for d in dtypes)} of shape "
                         f"{tuple(shape)} with a contiguous last dim, got {t.dtype} {tuple(t.shape)}")


def _validate(fp4: bool, x, w1, w3, w2, s1, s3, s2, sb: tuple[int, int], topk_weights, topk_ids):
    """Checks every argument (ValueError naming it); returns (E, I, uint8 scales)."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32) or x.stride(-1) != 1:
        raise ValueError(f"x: expected a bfloat16 / float32 [T, H] with a contiguous last dim (fp16 cannot hold "
                         f"every dequantized weight exactly), got {x.dtype} {tuple(x.shape)}")
    if len(sb) != 2 or not all(isinstance(b, int) and b > 0 for b in sb) or (fp4 and sb[1] % 2):
        raise ValueError(f"{'group' if fp4 else 'block'}: expected positive (FP4: even) ints, got {sb!r}")
    if w1.dim() != 3:  # E and I are read from w1
        raise ValueError(f"w1: expected a 3-D [E, I, H{'/2' if fp4 else ''}] weight, got shape {tuple(w1.shape)}")
    (t, h), (e, i) = x.shape, w1.shape[:2]
    if fp4 and (h % sb[1] or i % sb[1]):
        raise ValueError(f"{'x' if h % sb[1] else 'w1'}: H={h} and I={i} must be multiples of the FP4 group {sb[1]}")
    if fp4:
        wd, ws1, ws2 = (torch.int8, torch.uint8), (e, i, h // 2), (e, h, i // 2)
        ss1, ss2 = (e, i, h // sb[1]), (e, h, i // sb[1])
    else:
        wd, ws1, ws2 = (torch.float8_e4m3fn,), (e, i, h), (e, h, i)
        ss1, ss2 = (e, triton.cdiv(i, sb[0]), triton.cdiv(h, sb[1])), (e, triton.cdiv(h, sb[0]), triton.cdiv(i, sb[1]))
    for name, w, shape in (("w1", w1, ws1), ("w3", w3, ws1), ("w2", w2, ws2)):
        _want(name, w, shape, wd)
    if w1.stride() != w3.stride():
        raise ValueError(f"w3: expected the strides of w1 {w1.stride()}, got {w3.stride()}")
    scales = [_e8m0_bytes(name, s).contiguous() for name, s in (("s1", s1), ("s3", s3), ("s2", s2))]
    for name, s, shape in zip(("s1", "s3", "s2"), scales, (ss1, ss1, ss2)):
        _want(name, s, shape, (torch.uint8,))
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.is_floating_point():
        raise ValueError(f"topk_ids: expected integer ids [{t}, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights: expected shape {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
    return e, i, scales


def _run(fp4: bool, x, w1, w3, w2, s1, s3, s2, sb, topk_weights, topk_ids, limit, config):
    check_device(x)
    n_experts, inter, (s1, s3, s2) = _validate(fp4, x, w1, w3, w2, s1, s3, s2, sb, topk_weights, topk_ids)
    (t, h), k = x.shape, topk_ids.shape[1]
    n_slots = t * k
    cfg = dict(config or _config(n_slots, n_experts))
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    if bk < 16 * (1 + fp4) or bk & (bk - 1):  # tl.dot's K >= 16 (FP4: two dots of BLOCK_K / 2)
        raise ValueError(f"config: BLOCK_K={bk} must be a power of two >= {16 * (1 + fp4)}")
    out = torch.empty_like(x)
    if t == 0:
        return out
    sb_n, sb_k = (1, sb[1]) if fp4 else sb
    smode = 1 if sb_k % bk == 0 else 2 if bk % sb_k == 0 else 0
    meta = dict(FP4=fp4, SB_N=sb_n, SB_K=sb_k, SMODE=smode, CODE=dtype_code(x.dtype), INTERP=interpreting(),
                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **cfg)
    align = moe_align(topk_ids, n_experts, bm)
    ids = topk_ids.to(torch.int32).contiguous()
    topw = topk_weights.contiguous().view(-1)
    act = torch.empty(n_slots, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(n_slots, h, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(inter, bn), align.max_blocks)
    _expert_gemm_kernel[grid](x, w1, w3, s1, s3, topw, act, align.sorted_ids, align.block_expert, n_slots, h, inter,
                              x.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1), s1.shape[2],
                              float(limit), GATE_UP=True, TOPK=k, EVEN_K=h % bk == 0, **meta)
    grid = (triton.cdiv(h, bn), align.max_blocks)
    _expert_gemm_kernel[grid](act, w2, w2, s2, s2, topw, y, align.sorted_ids, align.block_expert, n_slots, inter, h,
                              inter, w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), s2.shape[2],
                              float(limit), GATE_UP=False, TOPK=1, EVEN_K=inter % bk == 0, **meta)
    block = min(1024, next_pow2(h))
    _combine_kernel[(t, triton.cdiv(h, block))](y, ids, out, h, n_experts, TOPK=k, CODE=meta["CODE"],
                                                INTERP=meta["INTERP"], BLOCK=block, num_warps=4)
    return out


def fused_moe_fp8(x, w1, w3, w2, s1, s3, s2, block, topk_weights, topk_ids, limit, config=None) -> torch.Tensor:
    """:func:`fused_moe.fused_moe` with FP8 e4m3 experts: w1/w3 [E, I, H], w2 [E, H, I]
    float8_e4m3fn; E8M0 scales s1/s3 [E, ceil(I/b0), ceil(H/b1)], s2 [E, ceil(H/b0), ceil(I/b1)]
    for ``block = (b0, b1)``. x [T, H] bf16 / fp32; returns [T, H] in x's dtype."""
    return _run(False, x, w1, w3, w2, s1, s3, s2, tuple(block), topk_weights, topk_ids, limit, config)


def fused_moe_fp4(x, w1, w3, w2, s1, s3, s2, topk_weights, topk_ids, limit, group=32, config=None) -> torch.Tensor:
    """:func:`fused_moe.fused_moe` with FP4 e2m1 experts: packed int8 w1/w3 [E, I, H/2],
    w2 [E, H, I/2] (element 2k in the low nibble of byte k); E8M0 scales s1/s3 [E, I, H/group],
    s2 [E, H, I/group]. x [T, H] bf16 / fp32; returns [T, H] in x's dtype."""
    return _run(True, x, w1, w3, w2, s1, s3, s2, (1, group), topk_weights, topk_ids, limit, config)


def _ref(fp4, x, w1, w3, w2, s1, s3, s2, sb, topk_weights, topk_ids, limit, config=None):
    """fused_moe_ref on the experts that are used, dequantized (quant.py) to x's dtype."""
    from deepinfer.models.quant import dequantize_fp4, dequantize_fp8_block

    n_experts, _, scales = _validate(fp4, x, w1, w3, w2, s1, s3, s2, sb, topk_weights, topk_ids)
    ids = topk_ids.long()
    ok = (ids >= 0) & (ids < n_experts)
    used = torch.unique(ids[ok])
    if used.numel() == 0:
        return torch.zeros_like(x)
    lut = torch.full((n_experts,), -1, dtype=torch.long, device=ids.device)
    lut[used] = torch.arange(used.numel(), device=ids.device)
    local = torch.where(ok, lut[ids.clamp(0, n_experts - 1)], -1)  # ascending ids stay ascending
    deq = (lambda w, s: dequantize_fp4(w, s, sb[1], dtype=x.dtype)) if fp4 else \
        (lambda w, s: dequantize_fp8_block(w, s, sb, dtype=x.dtype))
    dense = [torch.stack([deq(w[e], s[e]) for e in used.tolist()]) for w, s in zip((w1, w3, w2), scales)]
    return fused_moe_ref(x, *dense, topk_weights, local, limit)


def fused_moe_fp8_ref(x, w1, w3, w2, s1, s3, s2, block, topk_weights, topk_ids, limit, config=None) -> torch.Tensor:
    """Torch reference of :func:`fused_moe_fp8`: dequantize, then :func:`fused_moe.fused_moe_ref`."""
    return _ref(False, x, w1, w3, w2, s1, s3, s2, tuple(block), topk_weights, topk_ids, limit)


def fused_moe_fp4_ref(x, w1, w3, w2, s1, s3, s2, topk_weights, topk_ids, limit, group=32, config=None) -> torch.Tensor:
    """Torch reference of :func:`fused_moe_fp4`: dequantize, then :func:`fused_moe.fused_moe_ref`."""
    return _ref(True, x, w1, w3, w2, s1, s3, s2, (1, group), topk_weights, topk_ids, limit)


@dataclass
class QuantizedExperts:
    """Stacked checkpoint bytes of a MoE's experts (:func:`stack_quantized_experts`)."""

    fmt: str  # 'fp8' | 'fp4'
    w1: torch.Tensor  # data [E, ...] as the kernels take them
    w3: torch.Tensor
    w2: torch.Tensor
    s1: torch.Tensor  # E8M0 uint8 scales
    s3: torch.Tensor
    s2: torch.Tensor
    block: tuple[int, int]  # FP8 block; FP4: (1, group)

    def __call__(self, x, topk_weights, topk_ids, limit, config=None, ref: bool = False) -> torch.Tensor:
        """The routed output [T, H] through the kernel (``ref``: its torch reference)."""
        w = (self.w1, self.w3, self.w2, self.s1, self.s3, self.s2)
        return (_ref if ref else _run)(self.fmt == "fp4", x, *w, self.block, topk_weights, topk_ids, limit, config)


def stack_quantized_experts(w1: list, w3: list, w2: list) -> QuantizedExperts:
    """Stack per-expert ``QuantizedWeight``s (``[ex.w1.quantized for ex in experts]`` etc.,
    fields fmt / data / scale / block) into the kernels' [E, ...] tensors; scales become
    E8M0 bytes. All experts must share one format, block and shape."""
    first = w1[0] if w1 else None
    if first is None or first.fmt not in ("fp8", "fp4"):
        raise ValueError(f"w1: expected a non-empty list of 'fp8' / 'fp4' quantized weights, got {w1!r:.80}")
    stacks = {}
    for name, ws in (("w1", w1), ("w3", w3), ("w2", w2)):
        for q in ws:
            if q is None or q.fmt != first.fmt or tuple(q.block) != tuple(first.block):
                raise ValueError(f"{name}: every expert must be {first.fmt} with block {tuple(first.block)}, "
                                 f"got {None if q is None else (q.fmt, tuple(q.block))}")
        stacks[name] = torch.stack([q.data for q in ws])
        stacks["s" + name[1]] = torch.stack([_e8m0_bytes(f"{name} scale", q.scale) for q in ws])
    return QuantizedExperts(first.fmt, block=tuple(first.block), **stacks)
