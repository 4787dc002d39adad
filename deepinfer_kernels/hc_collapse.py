"""DeepSeek-V4.1's model head input in one launch: the last sublayer's mHC expansion
(``v41.layers.hc_expand``, pending after the last MoE), the collapse of the streams with
the head's ``pre`` (``hc_collapse``), and the final RMSNorm (optional). The reference takes about
sixteen torch ops for it (a loop over the streams in each of the first two).

Math per token (float32, rounded to the activation dtype where the reference stores):
``s_k = round(post_k * out + sum_j comb[j, k] * s_j)`` (j in order), ``h =
round(sum_k pre_k * s_k)``, ``x = round(w * round(h * rsqrt(mean(h^2) + eps)))``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, next_pow2, round_to


@triton.jit
def streams_tile(s_ptr, o_ptr, post_ptr, comb_ptr, t, HC: tl.constexpr, D: tl.constexpr,
                 EXPAND: tl.constexpr, CODE: tl.constexpr, INTERP: tl.constexpr):
    """Token t's streams [HC, D] in float32; with EXPAND the pending expansion first
    (``hc_expand``): ``new_k = round(post_k * out + sum_j comb[j, k] * s_j)``, j in order."""
    ks = tl.arange(0, HC)
    d = tl.arange(0, D)
    s = tl.load(s_ptr + (t * HC + ks[:, None]) * D + d[None, :]).to(tl.float32)
    if EXPAND:
        mixed = tl.zeros([HC, D], dtype=tl.float32)
        for j in tl.static_range(HC):
            s_j = tl.load(s_ptr + (t * HC + j) * D + d).to(tl.float32)
            mixed += tl.load(comb_ptr + (t * HC + j) * HC + ks)[:, None] * s_j[None, :]
        o = tl.load(o_ptr + t * D + d).to(tl.float32)
        s = round_to(tl.load(post_ptr + t * HC + ks)[:, None] * o[None, :] + mixed, CODE, INTERP)
    return s


@triton.jit
def _collapse_kernel(s_ptr, pre_ptr, w_ptr, out_ptr, o_ptr, post_ptr, comb_ptr, eps,
                     HC: tl.constexpr, D: tl.constexpr, EXPAND: tl.constexpr, NORM: tl.constexpr,
                     CODE: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, HC)
    d = tl.arange(0, D)
    s = streams_tile(s_ptr, o_ptr, post_ptr, comb_ptr, t, HC, D, EXPAND, CODE, INTERP)  # [HC, D]
    h = round_to(tl.sum(tl.load(pre_ptr + t * HC + ks)[:, None] * s, axis=0), CODE, INTERP)  # [D]
    if NORM:
        inv = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(h * h, axis=0) / D + eps))
        h = round_to(round_to(h * inv, CODE, INTERP) * tl.load(w_ptr + d), CODE, INTERP)
    tl.store(out_ptr + t * D + d, h.to(out_ptr.dtype.element_ty))


def hc_collapse_norm(streams: torch.Tensor, pre: torch.Tensor, norm: tuple[torch.Tensor, float] | None,
                     prev: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """streams [T, hc, D] (bf16/fp32), pre [T, hc] float32, norm = (weight f32 [D], eps) or
    None (the collapsed hidden a verify step hands the spec runner), prev = (out [T, D],
    post [T, hc], comb [T, hc, hc]) to expand first -> [T, D]."""
    check_device(streams, pre)
    t, hc, d = streams.shape
    if hc != next_pow2(hc) or d != next_pow2(d):
        raise ValueError(f"hc_collapse_norm: streams {hc} x {d} must be powers of two")
    s = streams.contiguous()
    out = torch.empty(t, d, dtype=streams.dtype, device=streams.device)
    o, post, comb = prev if prev is not None else (s, pre, pre)
    if t:
        w, eps = (norm[0].float().contiguous(), float(norm[1])) if norm is not None else (pre, 0.0)
        _collapse_kernel[(t,)](s, pre.float().contiguous(), w, out, o.contiguous(), post.float().contiguous(),
                               comb.float().contiguous(), eps, HC=hc, D=d, EXPAND=prev is not None,
                               NORM=norm is not None, CODE=dtype_code(streams.dtype), INTERP=interpreting(),
                               num_warps=4)
    return out


def hc_collapse_norm_ref(streams: torch.Tensor, pre: torch.Tensor, norm: tuple[torch.Tensor, float] | None,
                         prev: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Torch reference of :func:`hc_collapse_norm`: the model's ``hc_expand``,
    ``hc_collapse`` and ``RMSNorm``."""
    from types import SimpleNamespace

    from deepinfer.models.norm import RMSNorm
    from deepinfer.models.v41.layers import hc_collapse, hc_expand

    if prev is not None:
        streams = hc_expand(prev[0], streams, prev[1], prev[2])
    h = hc_collapse(streams, pre)
    return h if norm is None else RMSNorm.forward(SimpleNamespace(weight=norm[0], eps=norm[1]), h)
