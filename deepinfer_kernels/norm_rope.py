"""Per-head RMSNorm (none / unweighted / weighted) + interleaved partial RoPE in one pass,
optionally scattered into a paged pool: the query and KV epilogues of V4 attention.

Math per token t at position p and head h (``round`` = round to the output dtype):

* ``v = round(x)`` (a float32 input, e.g. the attention output, is first rounded as the
  reference's ``.to(dtype)`` does; bf16 inputs are unchanged);
* ``unweighted``: ``v = round(v * round(rsqrt(mean(v^2) + eps)))`` (``unweighted_rms_norm``);
  ``weighted``: ``v = round(w * round(v * rsqrt(mean(v^2) + eps)))`` (``RMSNorm``);
* RoPE on the trailing ``2 * len(inv_freq)`` channels by angle ``p * inv_freq`` (or its
  negative with ``inverse``), cos/sin rounded through the output dtype as
  ``Rotary.cos_sin(positions, dtype)`` does, math in float32, rounded (``apply_rope``).

With ``pool``/``table`` (one head) the rows go to ``pool[table[t, p // bs], p % bs]``
(the sliding-window KV write of a decode step) instead of a new tensor. With ``ratio`` r
(V4.1's pooled entries) row t is the entry of group ``g = p // r``: RoPE'd at position
``g * r``, written to slot g, and only by the row that closes the group (``(p + 1) % r ==
0``). ``quant`` rounds the result to a KV-cache format per ``quant_block`` channels last
(``kv_quant_sim``: FP8 / FP4 as the checkpoint stores them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, next_pow2, rope_tile, round_to
from .kv_quant_sim import block_quant_sim, check_mode

_NORMS = {"none": 0, "unweighted": 1, "weighted": 2}


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, pos_ptr, freq_ptr, out_ptr, tab_ptr, H, stride_xt, stride_xh,
                      stride_ot, stride_oh, stride_tab, BS, eps,
                      NORM: tl.constexpr, INVERSE: tl.constexpr, SCATTER: tl.constexpr, D: tl.constexpr,
                      HALF: tl.constexpr, CODE: tl.constexpr, INTERP: tl.constexpr, BLOCK_H: tl.constexpr,
                      RATIO: tl.constexpr, QUANT: tl.constexpr, QB: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, D)
    x = tl.load(x_ptr + t * stride_xt + heads[:, None] * stride_xh + d[None, :], mask=hmask[:, None], other=0.0)
    v = round_to(x.to(tl.float32), CODE, INTERP)
    if NORM > 0:
        inv = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(v * v, axis=1) / D + eps))[:, None]
        if NORM == 1:
            v = round_to(v * round_to(inv, CODE, INTERP), CODE, INTERP)
        else:
            v = round_to(round_to(v * inv, CODE, INTERP) * tl.load(w_ptr + d)[None, :], CODE, INTERP)
    p = tl.load(pos_ptr + t)
    slot = p // RATIO
    y = rope_tile(v, slot * RATIO, freq_ptr, BLOCK_H, D, HALF, INVERSE, CODE, INTERP)
    if QUANT > 0:
        y = round_to(block_quant_sim(y, BLOCK_H, D, QUANT, QB), CODE, INTERP)
    keep = hmask[:, None] & (d[None, :] < D)
    if SCATTER:
        blk = tl.load(tab_ptr + t * stride_tab + slot // BS).to(tl.int64)
        dst = out_ptr + (blk * BS + slot % BS) * D + heads[:, None] * 0 + d[None, :]
        keep = keep & (((p + 1) % RATIO + d[None, :] * 0) == 0)
    else:
        dst = out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=keep)


def norm_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, norm: str = "none",
              weight: torch.Tensor | None = None, eps: float = 0.0, inverse: bool = False,
              out_dtype: torch.dtype | None = None, pool: torch.Tensor | None = None,
              table: torch.Tensor | None = None, ratio: int = 1, quant: str = "none",
              quant_block: int = 32) -> torch.Tensor | None:
    """x [T, H, D] or [T, D] (last dim contiguous, D a power of two); positions [T] int;
    inv_freq f32 [rope_dim / 2]; ``norm`` in none / unweighted / weighted (weight f32 [D]).
    Returns a new [T, H, D] tensor of ``out_dtype`` (default x's), or None after writing
    into ``pool`` [blocks, block_size, D] through ``table`` [T, W] (one head only; with
    ``ratio``, group ``p // ratio`` by the row closing it). ``quant``: see kv_quant_sim."""
    check_device(x)
    if ratio < 1 or (ratio > 1 and pool is None):
        raise ValueError(f"norm_rope: ratio {ratio} needs ratio >= 1 and a pool to write groups into")
    if norm not in _NORMS:
        raise ValueError(f"norm_rope: norm={norm!r}, expected one of {list(_NORMS)}")
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    t, h, d = x3.shape
    half = inv_freq.numel()
    if d != next_pow2(d) or 2 * half > d or x3.stride(2) != 1:
        raise ValueError(f"norm_rope: head width {d} must be a power of two >= rope dim {2 * half}, contiguous")
    if norm == "weighted" and (weight is None or weight.shape != (d,)):
        raise ValueError(f"norm_rope: weighted norm needs a weight of shape ({d},)")
    scatter = pool is not None
    if scatter:
        assert h == 1 and table is not None and pool.is_contiguous() and pool.shape[-1] == d
        out = pool
    else:
        out = torch.empty(t, h, d, dtype=out_dtype or x.dtype, device=x.device)
    code = dtype_code(out.dtype)
    qmode = check_mode(quant, quant_block, d)
    block_h = max(1, min(next_pow2(h), 4096 // d))
    if t:
        _norm_rope_kernel[(t, triton.cdiv(h, block_h))](
            x3, weight.float().contiguous() if weight is not None else inv_freq, positions,
            inv_freq.to(device=x.device, dtype=torch.float32).contiguous(), out,
            table if scatter else positions, h, x3.stride(0), x3.stride(1),
            0 if scatter else out.stride(0), 0 if scatter else out.stride(1),
            table.stride(0) if scatter else 0, pool.shape[1] if scatter else 1, float(eps),
            NORM=_NORMS[norm], INVERSE=inverse, SCATTER=scatter, D=d, HALF=half, CODE=code, INTERP=interpreting(),
            BLOCK_H=block_h, RATIO=ratio, QUANT=qmode, QB=quant_block if qmode else 1, num_warps=4)
    if scatter:
        return None
    return out if x.dim() == 3 else out[:, 0]


def norm_rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, norm: str = "none",
                  weight: torch.Tensor | None = None, eps: float = 0.0, inverse: bool = False,
                  out_dtype: torch.dtype | None = None, pool: torch.Tensor | None = None,
                  table: torch.Tensor | None = None, ratio: int = 1, quant: str = "none",
                  quant_block: int = 32) -> torch.Tensor | None:
    """Torch reference with the signature of :func:`norm_rope`: the model's
    ``unweighted_rms_norm`` / ``RMSNorm``, ``Rotary.cos_sin``, ``apply_rope`` and
    ``kv_quant``'s block rounding."""
    from .kv_quant_sim import kv_quant_sim_ref

    from types import SimpleNamespace

    from deepinfer.models.norm import RMSNorm, unweighted_rms_norm
    from deepinfer.models.rope import Rotary, apply_rope

    dtype = out_dtype or (pool.dtype if pool is not None else x.dtype)
    v = x.to(dtype)
    if norm == "unweighted":
        v = unweighted_rms_norm(v, eps)
    elif norm == "weighted":
        v = RMSNorm.forward(SimpleNamespace(weight=weight, eps=eps), v)
    pos = positions.long()
    cos, sin = Rotary.cos_sin(SimpleNamespace(inv_freq=inv_freq), pos // ratio * ratio, dtype)
    y = kv_quant_sim_ref(apply_rope(v, cos, -sin if inverse else sin), quant, quant_block)
    if pool is None:
        return y
    keep = (pos + 1) % ratio == 0
    rows, slot = y.reshape(y.shape[0], -1)[keep], (pos // ratio)[keep]
    blk = table.long()[keep].gather(1, (slot // pool.shape[1])[:, None])[:, 0]
    pool[blk, slot % pool.shape[1]] = rows.to(pool.dtype)
    return None
