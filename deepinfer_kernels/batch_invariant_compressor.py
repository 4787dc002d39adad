"""Batch-invariant compressor pooling: one closing window -> one compressed entry, from
explicitly indexed source rows, the same kernel for decode and prefill steps.

The compiled executor computes a request's compressed entries in two places: the decode
graph (``compressor_decode``: the window's rows from the request's ring) and prefill /
mixed steps (``fast/prefill_compressor.py``: rows from the ring's history and the
step's own projections, pooled with torch ops whose CUDA launch layout follows the
number of windows). In batch-invariant mode a token may land in either kind of step
depending on the traffic, so both must write bitwise the same entry. Here each window
is one program over float32 source rows ``src [S, 2, C]`` (kv at ``[:, 0]``, score at
``[:, 1]``; the ring's layout) picked by ``idx [Nw, NWIN]`` (-1 = no row: the window
before position 0), so the entry depends only on those rows, whatever else the step
holds; decode passes the ring itself, prefill a concatenation of ring history and the
step's rows.

Math of ``compressor_decode``'s closing branch (``Compressor.forward``'s rounding
points): window rows ``k < NWIN - RATIO`` read their first ``D`` columns (the previous
window's half of an overlapping CSA compressor), the others columns ``OWN..OWN + D``;
per channel ``a = round(softmax_k(sc))``, ``pooled = round(sum_k round(round(kv_k) * a_k))``
(float32 sums in fixed BLOCK_R blocks), RMSNorm, RoPE of the trailing channels at the
window's first position; stored to ``entries.view(-1, D)[dest]`` (``dest < 0``: skipped).

``pool_windows_ref`` is the torch reference (the model's own pieces); they agree within
the dtype's tolerance.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, next_pow2, pooled_entry, round_to

__all__ = ["pool_windows", "pool_windows_ref"]


@triton.jit(do_not_specialize=["n_win"])
def _pool_kernel(src_ptr, idx_ptr, wpos_ptr, dest_ptr, ent_ptr, norm_w_ptr, freq_ptr, n_win, eps,
                 RATIO: tl.constexpr, NWIN: tl.constexpr, D: tl.constexpr, C: tl.constexpr, OWN: tl.constexpr,
                 ROPE_HALF: tl.constexpr, CODE: tl.constexpr, INTERP: tl.constexpr, BLOCK_R: tl.constexpr):
    w = tl.program_id(0).to(tl.int64)
    dst = tl.load(dest_ptr + w)
    if dst >= 0:
        d = tl.arange(0, D)
        # pass 1: per-channel max, then the sum of exp, over the window's rows in BLOCK_R blocks
        mx = tl.full([D], float("-inf"), dtype=tl.float32)
        for k0 in range(0, NWIN, BLOCK_R):
            k = k0 + tl.arange(0, BLOCK_R)
            src = tl.load(idx_ptr + w * NWIN + k, mask=k < NWIN, other=-1).to(tl.int64)
            ok = src >= 0
            col = tl.where(k >= NWIN - RATIO, OWN, 0)
            sc = tl.load(src_ptr + tl.where(ok, src, 0)[:, None] * 2 * C + C + col[:, None] + d[None, :],
                         mask=ok[:, None], other=float("-inf"))
            mx = tl.maximum(mx, tl.max(sc, axis=0))
        den = tl.zeros([D], dtype=tl.float32)
        for k0 in range(0, NWIN, BLOCK_R):
            k = k0 + tl.arange(0, BLOCK_R)
            src = tl.load(idx_ptr + w * NWIN + k, mask=k < NWIN, other=-1).to(tl.int64)
            ok = src >= 0
            col = tl.where(k >= NWIN - RATIO, OWN, 0)
            sc = tl.load(src_ptr + tl.where(ok, src, 0)[:, None] * 2 * C + C + col[:, None] + d[None, :],
                         mask=ok[:, None], other=float("-inf"))
            den += tl.sum(tl.exp(sc - mx[None, :]), axis=0)
        # pass 2: rounded weights times rounded values, summed in float32, rounded once
        acc = tl.zeros([D], dtype=tl.float32)
        for k0 in range(0, NWIN, BLOCK_R):
            k = k0 + tl.arange(0, BLOCK_R)
            src = tl.load(idx_ptr + w * NWIN + k, mask=k < NWIN, other=-1).to(tl.int64)
            ok = src >= 0
            col = tl.where(k >= NWIN - RATIO, OWN, 0)
            base = src_ptr + tl.where(ok, src, 0)[:, None] * 2 * C + col[:, None] + d[None, :]
            sc = tl.load(base + C, mask=ok[:, None], other=float("-inf"))
            kv = tl.load(base, mask=ok[:, None], other=0.0)
            a = round_to(tl.exp(sc - mx[None, :]) / den[None, :], CODE, INTERP)
            acc += tl.sum(round_to(round_to(kv, CODE, INTERP) * a, CODE, INTERP), axis=0)
        y = pooled_entry(acc, tl.load(wpos_ptr + w), norm_w_ptr, freq_ptr, eps, D, ROPE_HALF, CODE, INTERP)
        tl.store(ent_ptr + dst * D + d, y.to(ent_ptr.dtype.element_ty))


def _check(src: torch.Tensor, idx: torch.Tensor, entries: torch.Tensor, ratio: int, overlap: bool) -> tuple[int, int]:
    d = entries.shape[-1]
    c = (2 if overlap else 1) * d
    nwin = (2 if overlap else 1) * ratio
    if src.dim() != 3 or tuple(src.shape[1:]) != (2, c) or src.dtype != torch.float32:
        raise ValueError(f"pool_windows: src must be float32 [S, 2, {c}], got {src.dtype} {tuple(src.shape)}")
    if idx.dim() != 2 or idx.shape[1] != nwin:
        raise ValueError(f"pool_windows: idx must be [Nw, {nwin}], got {tuple(idx.shape)}")
    if d != next_pow2(d):
        raise ValueError(f"pool_windows: entry width {d} must be a power of two")
    return d, nwin


def pool_windows(src: torch.Tensor, idx: torch.Tensor, win_pos: torch.Tensor, dest: torch.Tensor,
                 entries: torch.Tensor, norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor,
                 ratio: int, overlap: bool, dtype: torch.dtype) -> None:
    """Write one entry per window (see the module doc). src float32 [S, 2, C]; idx [Nw, NWIN]
    int (-1 = no row); win_pos [Nw] int (the window's first position); dest [Nw] int64
    flat entry row (-1 = skip); entries [..., D]; norm_weight [D]; inv_freq f32
    [rope_dim / 2]; ``dtype``: the activation dtype whose roundings the pooling keeps."""
    check_device(src)
    d, nwin = _check(src, idx, entries, ratio, overlap)
    n_win = idx.shape[0]
    assert src.is_contiguous() and entries.is_contiguous()
    if n_win == 0:
        return
    _pool_kernel[(n_win,)](
        src, idx.to(torch.int32).contiguous(), win_pos.contiguous(), dest.to(torch.int64).contiguous(), entries,
        norm_weight.float().contiguous(), inv_freq.to(device=src.device, dtype=torch.float32).contiguous(),
        n_win, float(eps), RATIO=ratio, NWIN=nwin, D=d, C=src.shape[2], OWN=d if overlap else 0,
        ROPE_HALF=inv_freq.numel(), CODE=dtype_code(dtype), INTERP=interpreting(), BLOCK_R=min(16, next_pow2(nwin)),
        num_warps=4 if d <= 128 else 8)


def pool_windows_ref(src: torch.Tensor, idx: torch.Tensor, win_pos: torch.Tensor, dest: torch.Tensor,
                     entries: torch.Tensor, norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor,
                     ratio: int, overlap: bool, dtype: torch.dtype) -> None:
    """Torch reference of :func:`pool_windows` (``Compressor.forward``'s pooling with the
    model's ``RMSNorm``, ``Rotary.cos_sin`` and ``apply_rope``); no host read."""
    from types import SimpleNamespace

    from deepinfer.models.norm import RMSNorm
    from deepinfer.models.rope import Rotary, apply_rope

    d, nwin = _check(src, idx, entries, ratio, overlap)
    if idx.shape[0] == 0:
        return
    idx = idx.long()
    ok = idx >= 0
    rows = src[idx.clamp(min=0)]  # [Nw, NWIN, 2, C]
    own = d if overlap else 0
    first = torch.arange(nwin, device=src.device) < nwin - ratio  # the previous window's half
    kv = torch.where(first[None, :, None], rows[:, :, 0, :d], rows[:, :, 0, own:own + d])
    sc = torch.where(first[None, :, None], rows[:, :, 1, :d], rows[:, :, 1, own:own + d])
    kv = torch.where(ok[..., None], kv, 0.0).to(dtype)
    sc = torch.where(ok[..., None], sc, float("-inf"))
    weights = sc.softmax(dim=1, dtype=torch.float32).to(dtype)
    pooled = RMSNorm.forward(SimpleNamespace(weight=norm_weight, eps=eps), (kv * weights).sum(dim=1))
    cos, sin = Rotary.cos_sin(SimpleNamespace(inv_freq=inv_freq.to(src.device)), win_pos.long(), pooled.dtype)
    entry = apply_rope(pooled, cos, sin).to(entries.dtype)
    keep = dest.long() >= 0
    entries.view(-1, d)[dest.long()[keep]] = entry[keep]
