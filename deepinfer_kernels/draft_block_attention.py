"""DSpark's block attention in one launch: R draft blocks of G rows, H query heads of width
D and ONE shared KV vector per key (keys = values), the output's RoPE rotated back.

Block r's row g (at position ``pos[r * G + g]``) attends to

* its context rows ``ctx_kv[r]`` [L, D] at ``ctx_pos[r]`` [L] inside the sliding window
  (``ctx_pos > pos - window``; padding rows sit at a position no window reaches), and
* every row of its own block (bidirectional): ``kv[r * G : (r + 1) * G]``,

with the per-head sink logit added to the denominator only, and the logits rounded as
the reference's bf16 einsum rounds them (``s = round(round(q . k) * D^-0.5)``, the decode
kernel's ``_update``). The output's trailing rope channels are rotated back by the row's
position, as ``norm_rope(..., inverse=True)`` does after the reference's attention.

Why a kernel: the reference (`deepinfer/models/v4/dspark.py` ``block_attention`` then an
inverse ``norm_rope``) is about sixteen small launches per stage (concat, masks, two
einsums, the softmax's pieces), which a graphed draft step pays one by one at batch 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, next_pow2, rope_tile, round_to
from .decode_attention import _update


@triton.jit
def _block_attention_kernel(q_ptr, kv_ptr, pos_ptr, ctx_ptr, ctx_pos_ptr, sink_ptr, freq_ptr, out_ptr,
                            H, L, window, scale, G: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                            CODE: tl.constexpr, INTERP: tl.constexpr):
    r, g, hb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, D)
    row = r.to(tl.int64) * G + g
    q = tl.load(q_ptr + (row * H + heads)[:, None] * D + d[None, :], mask=hmask[:, None], other=0.0)
    p = tl.load(pos_ptr + row)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    for n0 in range(0, L, BLOCK_N):  # the context rows inside the window
        n = n0 + tl.arange(0, BLOCK_N)
        live = n < L
        kpos = tl.load(ctx_pos_ptr + r.to(tl.int64) * L + n, mask=live, other=0)
        valid = live & (kpos > p - window)
        k = tl.load(ctx_ptr + (r.to(tl.int64) * L + n)[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        m, l, acc = _update(q, k.to(q.dtype), valid, m, l, acc, scale, CODE, INTERP)
    j = tl.arange(0, BLOCK_G)  # the block's own rows, all visible
    own = j < G
    k = tl.load(kv_ptr + (r.to(tl.int64) * G + j)[:, None] * D + d[None, :], mask=own[:, None], other=0.0)
    m, l, acc = _update(q, k.to(q.dtype), own, m, l, acc, scale, CODE, INTERP)
    sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
    big = tl.maximum(m, sink)
    a = tl.exp2((m - big) * 1.4426950408889634)
    den = l * a + tl.exp2((sink - big) * 1.4426950408889634)
    o = (acc * a[:, None]) / den[:, None]
    o = rope_tile(round_to(o, CODE, INTERP), p, freq_ptr, BLOCK_H, D, HALF, True, CODE, INTERP)
    tl.store(out_ptr + (row * H + heads)[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=hmask[:, None])


def _check(q: torch.Tensor, kv: torch.Tensor, pos: torch.Tensor, block: int, ctx_kv: torch.Tensor,
           ctx_pos: torch.Tensor, attn_sink: torch.Tensor, inv_freq: torch.Tensor) -> None:
    rows, h, d = q.shape
    if block < 1 or rows % block:
        raise ValueError(f"draft_block_attention: {rows} query rows are not whole blocks of {block}")
    r = rows // block
    if kv.shape != (rows, d) or pos.shape != (rows,):
        raise ValueError(f"draft_block_attention: kv {tuple(kv.shape)} / pos {tuple(pos.shape)} must be "
                         f"[{rows}, {d}] / [{rows}]")
    if ctx_kv.dim() != 3 or ctx_kv.shape[0] != r or ctx_kv.shape[2] != d or ctx_pos.shape != ctx_kv.shape[:2]:
        raise ValueError(f"draft_block_attention: ctx_kv {tuple(ctx_kv.shape)} / ctx_pos {tuple(ctx_pos.shape)} "
                         f"must be [{r}, L, {d}] / [{r}, L]")
    if attn_sink.shape != (h,) or 2 * inv_freq.numel() > d:
        raise ValueError(f"draft_block_attention: attn_sink must be [{h}] and the rope dim at most {d}")


def draft_block_attention(q: torch.Tensor, kv: torch.Tensor, pos: torch.Tensor, block: int, ctx_kv: torch.Tensor,
                          ctx_pos: torch.Tensor, window: int, attn_sink: torch.Tensor, inv_freq: torch.Tensor,
                          out_dtype: torch.dtype | None = None, block_n: int = 32) -> torch.Tensor:
    """q [R * block, H, D] (post-RoPE), kv [R * block, D] (the blocks' own keys, post-RoPE),
    pos [R * block] int, ctx_kv [R, L, D] / ctx_pos [R, L] int (each block's context rows),
    attn_sink [H], inv_freq f32 [rope_dim / 2] -> [R * block, H, D] of ``out_dtype``
    (default q's) with the rope channels rotated back. D a power of two."""
    check_device(q, kv, ctx_kv)
    _check(q, kv, pos, block, ctx_kv, ctx_pos, attn_sink, inv_freq)
    rows, h, d = q.shape
    if d != next_pow2(d) or d < 16:
        raise ValueError(f"draft_block_attention: head width {d} must be a power of two >= 16")
    q, kv, ctx_kv = q.contiguous(), kv.contiguous(), ctx_kv.contiguous()
    out = torch.empty(rows, h, d, dtype=out_dtype or q.dtype, device=q.device)
    if rows == 0:
        return out
    bh = 16  # heads per program: tl.dot's smallest tile
    opts = {} if interpreting() else {"enable_fp_fusion": False}
    _block_attention_kernel[(rows // block, block, triton.cdiv(h, bh))](
        q, kv, pos.contiguous(), ctx_kv, ctx_pos.contiguous(), attn_sink.float().contiguous(),
        inv_freq.to(device=q.device, dtype=torch.float32).contiguous(), out,
        h, ctx_kv.shape[1], window, float(d ** -0.5), G=block, D=d, HALF=max(1, inv_freq.numel()),
        BLOCK_H=bh, BLOCK_N=block_n, BLOCK_G=max(16, next_pow2(block)), CODE=dtype_code(q.dtype),
        INTERP=interpreting(), num_warps=4, **opts)
    return out


def draft_block_attention_ref(q: torch.Tensor, kv: torch.Tensor, pos: torch.Tensor, block: int,
                              ctx_kv: torch.Tensor, ctx_pos: torch.Tensor, window: int, attn_sink: torch.Tensor,
                              inv_freq: torch.Tensor, out_dtype: torch.dtype | None = None,
                              block_n: int = 32) -> torch.Tensor:
    """Torch reference: the stages' ``block_attention`` then the inverse ``norm_rope``."""
    from deepinfer.models.v4.dspark import block_attention

    from .norm_rope import norm_rope_ref

    _check(q, kv, pos, block, ctx_kv, ctx_pos, attn_sink, inv_freq)
    out = block_attention(q, kv, pos, block, ctx_kv, ctx_pos, window, attn_sink)
    return norm_rope_ref(out, pos, inv_freq, "none", inverse=True, out_dtype=out_dtype or q.dtype)


__all__ = ["draft_block_attention", "draft_block_attention_ref"]
