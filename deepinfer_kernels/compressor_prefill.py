"""Every compressor write of a prefill / mixed step for one compressor, in two launches:
the closing windows' pooled entries and the overlap tails of block ends (launch 1), then
the ring rows the next step reads (launch 2). The torch version of the same step,
``models/fast/prefill_compressor.compress_prefill``, costs ~45 small launches and gathers
per compressor; a prefill step of a short prompt is host-bound on them.

Each read names its source row by one int code (``models/fast/prefill_compressor_fused``
builds them on the host):

* ``code >= 0``: row ``code`` of the step (kv = ``wkv(x)``, score = ``wgate(x)`` + ape of
  the row's position);
* ``code == -1``: no row (kv 0, score -inf: the missing previous window of window 0);
* ``-2 >= code > -2 - n_ring``: ring row ``f = -2 - code`` of ``ring.view(-1, 2, C)``
  (history an earlier step wrote; its score includes ape);
* ``code <= -2 - n_ring``: tail row ``t = -2 - n_ring - code`` of ``tail.view(-1, 2, d)``
  (a newly admitted request's history rows, restored from its last prefix-cached block;
  first-half columns only, the second half reads as no row).

A window reads NWIN rows: CSA (overlap) the previous window's first halves ``[:d]`` then
its own second halves ``[d:]``, HCA its own rows. Math as ``compressor_decode``: per channel
``a = round(softmax(sc))``, ``pooled = round(sum round(round(kv) * a))``, RMSNorm, RoPE at
the window's first position. Launch 1 reads the ring and launch 2 writes it, so no program
reads a row another program of its launch writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, next_pow2, pooled_entry, round_to


@triton.jit
def _source_rows(codes, col, kv_ptr, sc_ptr, ape_ptr, pos_ptr, ring_ptr, tail_ptr, stride_kv, stride_sc, n_ring,
                 RATIO: tl.constexpr, D: tl.constexpr, C: tl.constexpr, CODE: tl.constexpr, INTERP: tl.constexpr):
    """(kv rounded to the activation dtype, score), float32 [BLOCK, D], of the rows named by
    ``codes`` [BLOCK], columns ``col`` [BLOCK] + [0, D)."""
    d = tl.arange(0, D)
    f = -2 - codes
    is_step = codes >= 0
    is_ring = (codes <= -2) & (f < n_ring)
    is_tail = (codes <= -2) & (f >= n_ring) & (col == 0)
    step = tl.where(is_step, codes, 0).to(tl.int64)
    p = tl.load(pos_ptr + step, mask=is_step, other=0).to(tl.int64)
    cols = col[:, None] + d[None, :]
    m_step = is_step[:, None]
    kv_s = tl.load(kv_ptr + step[:, None] * stride_kv + cols, mask=m_step, other=0.0).to(tl.float32)
    sc_s = (tl.load(sc_ptr + step[:, None] * stride_sc + cols, mask=m_step, other=0.0).to(tl.float32)
            + tl.load(ape_ptr + (p % RATIO)[:, None] * C + cols, mask=m_step, other=0.0))
    ring_row = ring_ptr + tl.where(is_ring, f, 0).to(tl.int64)[:, None] * 2 * C + cols
    kv_r = tl.load(ring_row, mask=is_ring[:, None], other=0.0)
    sc_r = tl.load(ring_row + C, mask=is_ring[:, None], other=0.0)
    tail_row = tail_ptr + tl.where(is_tail, f - n_ring, 0).to(tl.int64)[:, None] * 2 * D + d[None, :]
    kv_t = tl.load(tail_row, mask=is_tail[:, None], other=0.0)
    sc_t = tl.load(tail_row + D, mask=is_tail[:, None], other=float("-inf"))
    kv = tl.where(m_step, kv_s, tl.where(is_ring[:, None], kv_r, kv_t))
    sc = tl.where(m_step, sc_s, tl.where(is_ring[:, None], sc_r, sc_t))
    return round_to(kv, CODE, INTERP), sc


@triton.jit
def _window_rows(win_src_ptr, i, k, kv_ptr, sc_ptr, ape_ptr, pos_ptr, ring_ptr, tail_ptr, stride_kv, stride_sc, n_ring,
                 RATIO: tl.constexpr, NWIN: tl.constexpr, OWN: tl.constexpr, D: tl.constexpr, C: tl.constexpr,
                 CODE: tl.constexpr, INTERP: tl.constexpr):
    """Rows ``k`` [BLOCK] of window ``i``: the previous window's first halves, then (the last
    RATIO) its own rows at column OWN; each of the kernel's three passes reads them again."""
    codes = tl.load(win_src_ptr + i * NWIN + k, mask=k < NWIN, other=-1)
    return _source_rows(codes, tl.where(k >= NWIN - RATIO, OWN, 0), kv_ptr, sc_ptr, ape_ptr, pos_ptr, ring_ptr,
                        tail_ptr, stride_kv, stride_sc, n_ring, RATIO, D, C, CODE, INTERP)


@triton.jit(do_not_specialize=["n_win", "n_ring"])
def _windows_and_tails_kernel(win_src_ptr, win_dest_ptr, win_pos_ptr, tail_src_ptr, tail_dest_ptr, n_win,
                              kv_ptr, sc_ptr, ape_ptr, pos_ptr, ring_ptr, tail_ptr, ent_ptr, norm_w_ptr, freq_ptr,
                              stride_kv, stride_sc, n_ring, eps, RATIO: tl.constexpr, NWIN: tl.constexpr,
                              OWN: tl.constexpr, D: tl.constexpr, C: tl.constexpr, ROPE_HALF: tl.constexpr,
                              CODE: tl.constexpr, INTERP: tl.constexpr, BLOCK_R: tl.constexpr):
    # programs [0, n_win): one closing window each; then one overlap tail each
    i = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)
    if i < n_win:
        mx = tl.full([D], float("-inf"), dtype=tl.float32)
        for k0 in range(0, NWIN, BLOCK_R):
            k = k0 + tl.arange(0, BLOCK_R)
            _, sc = _window_rows(win_src_ptr, i, k, kv_ptr, sc_ptr, ape_ptr, pos_ptr, ring_ptr, tail_ptr, stride_kv,
                                 stride_sc, n_ring, RATIO, NWIN, OWN, D, C, CODE, INTERP)
            mx = tl.maximum(mx, tl.max(sc, axis=0))
        den = tl.zeros([D], dtype=tl.float32)
        for k0 in range(0, NWIN, BLOCK_R):
            k = k0 + tl.arange(0, BLOCK_R)
            _, sc = _window_rows(win_src_ptr, i, k, kv_ptr, sc_ptr, ape_ptr, pos_ptr, ring_ptr, tail_ptr, stride_kv,
                                 stride_sc, n_ring, RATIO, NWIN, OWN, D, C, CODE, INTERP)
            den += tl.sum(tl.exp(sc - mx[None, :]), axis=0)
        acc = tl.zeros([D], dtype=tl.float32)
        for k0 in range(0, NWIN, BLOCK_R):
            k = k0 + tl.arange(0, BLOCK_R)
            kv, sc = _window_rows(win_src_ptr, i, k, kv_ptr, sc_ptr, ape_ptr, pos_ptr, ring_ptr, tail_ptr, stride_kv,
                                  stride_sc, n_ring, RATIO, NWIN, OWN, D, C, CODE, INTERP)
            a = round_to(tl.exp(sc - mx[None, :]) / den[None, :], CODE, INTERP)
            acc += tl.sum(round_to(kv * a, CODE, INTERP), axis=0)
        y = pooled_entry(acc, tl.load(win_pos_ptr + i), norm_w_ptr, freq_ptr, eps, D, ROPE_HALF, CODE, INTERP)
        dest = tl.load(win_dest_ptr + i).to(tl.int64)
        tl.store(ent_ptr + dest * D + d, y.to(ent_ptr.dtype.element_ty))
    else:
        t = i - n_win
        rows = tl.arange(0, RATIO)
        codes = tl.load(tail_src_ptr + t * RATIO + rows)
        kv, sc = _source_rows(codes, rows * 0, kv_ptr, sc_ptr, ape_ptr, pos_ptr, ring_ptr, tail_ptr, stride_kv,
                              stride_sc, n_ring, RATIO, D, C, CODE, INTERP)
        dst = tail_ptr + tl.load(tail_dest_ptr + t).to(tl.int64) * RATIO * 2 * D + rows[:, None] * 2 * D + d[None, :]
        tl.store(dst, kv)
        tl.store(dst + D, sc)


@triton.jit(do_not_specialize=["n_rows", "n_ring"])
def _ring_write_kernel(ring_src_ptr, ring_dest_ptr, n_rows, kv_ptr, sc_ptr, ape_ptr, pos_ptr, ring_ptr, tail_ptr,
                       stride_kv, stride_sc, n_ring, RATIO: tl.constexpr, D: tl.constexpr, C: tl.constexpr,
                       CODE: tl.constexpr, INTERP: tl.constexpr, BLOCK_R: tl.constexpr):
    k = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = k < n_rows
    codes = tl.load(ring_src_ptr + k, mask=ok, other=-1)
    dest = tl.load(ring_dest_ptr + k, mask=ok, other=0).to(tl.int64)
    d = tl.arange(0, D)
    for c0 in tl.static_range(0, C, D):
        kv, sc = _source_rows(codes, tl.zeros([BLOCK_R], dtype=tl.int32) + c0, kv_ptr, sc_ptr, ape_ptr, pos_ptr,
                              ring_ptr, tail_ptr, stride_kv, stride_sc, n_ring, RATIO, D, C, CODE, INTERP)
        row = ring_ptr + dest[:, None] * 2 * C + c0 + d[None, :]
        tl.store(row, kv, mask=ok[:, None])
        tl.store(row + C, sc, mask=ok[:, None])


def _check(kv: torch.Tensor, ring: torch.Tensor, entries: torch.Tensor, overlap: bool) -> tuple[int, int]:
    c, d = kv.shape[1], entries.shape[-1]
    if c != (2 if overlap else 1) * d or d != next_pow2(d) or ring.shape[-1] != c:
        raise ValueError(f"compressor_prefill: kv width {c}, entry width {d} and ring width {ring.shape[-1]} "
                         f"disagree (overlap={overlap}), or d is not a power of two")
    return c, d


def compressor_prefill(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
                       ring: torch.Tensor, entries: torch.Tensor, tail: torch.Tensor | None,
                       norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor, ratio: int, overlap: bool,
                       win_src: torch.Tensor, win_dest: torch.Tensor, win_pos: torch.Tensor,
                       tail_src: torch.Tensor, tail_dest: torch.Tensor, ring_src: torch.Tensor,
                       ring_dest: torch.Tensor) -> None:
    """In-place prefill update of one compressor (see the module doc).

    kv, score [T, C] (``wkv(x)``, ``wgate(x)``, row-strided views allowed); ape [ratio, C]
    f32; positions [T]; ring [slots, L, 2, C] f32; entries [blocks, per_block, d]; tail
    [blocks, ratio, 2, d] f32 (overlap) or None; win_src [Nw, NWIN] codes, win_dest [Nw]
    flat entry rows, win_pos [Nw] RoPE positions; tail_src [Nt, ratio] codes, tail_dest
    [Nt] tail blocks; ring_src [Nk] codes, ring_dest [Nk] flat ring rows (int32/int64)."""
    check_device(kv)
    c, d = _check(kv, ring, entries, overlap)
    assert kv.stride(1) == 1 and score.stride(1) == 1 and ring.is_contiguous() and entries.is_contiguous()
    n_win, n_tail, n_keep = win_src.shape[0], tail_src.shape[0], ring_src.shape[0]
    nwin = 2 * ratio if overlap else ratio
    common = dict(RATIO=ratio, D=d, C=c, CODE=dtype_code(kv.dtype), INTERP=interpreting())
    ape32 = ape.float().contiguous()
    tail_arg = tail if tail is not None else ring
    n_ring = ring.shape[0] * ring.shape[1]
    if n_win + n_tail:
        _windows_and_tails_kernel[(n_win + n_tail,)](
            win_src, win_dest, win_pos, tail_src, tail_dest, n_win, kv, score, ape32, positions, ring, tail_arg,
            entries, norm_weight.float().contiguous(), inv_freq.to(device=kv.device, dtype=torch.float32).contiguous(),
            kv.stride(0), score.stride(0), n_ring, float(eps), NWIN=nwin, OWN=d if overlap else 0,
            ROPE_HALF=inv_freq.numel(), BLOCK_R=min(16, next_pow2(nwin)), num_warps=4 if d <= 128 else 8, **common)
    if n_keep:
        block = 16
        _ring_write_kernel[(triton.cdiv(n_keep, block),)](
            ring_src, ring_dest, n_keep, kv, score, ape32, positions, ring, tail_arg, kv.stride(0), score.stride(0),
            n_ring, BLOCK_R=block, num_warps=4, **common)


def compressor_prefill_ref(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
                           ring: torch.Tensor, entries: torch.Tensor, tail: torch.Tensor | None,
                           norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor, ratio: int, overlap: bool,
                           win_src: torch.Tensor, win_dest: torch.Tensor, win_pos: torch.Tensor,
                           tail_src: torch.Tensor, tail_dest: torch.Tensor, ring_src: torch.Tensor,
                           ring_dest: torch.Tensor) -> None:
    """Torch reference with the signature of :func:`compressor_prefill`: every source row in
    one table [step rows ; ring rows ; tail rows ; no row], gathered by code, pooled with the
    model's ``RMSNorm`` / ``Rotary.cos_sin`` / ``apply_rope``."""
    from types import SimpleNamespace

    from deepinfer.models.norm import RMSNorm
    from deepinfer.models.rope import Rotary, apply_rope

    c, d = _check(kv, ring, entries, overlap)
    r, dev, inf = ratio, kv.device, float("-inf")
    n_step, n_ring = kv.shape[0], ring.shape[0] * ring.shape[1]
    flat = ring.view(n_ring, 2, c)
    kv_rows = [kv.float(), flat[:, 0]]
    sc_rows = [score.float() + ape.float()[positions.long() % r], flat[:, 1]]
    if tail is not None:
        t = tail.view(-1, 2, d)
        kv_rows.append(torch.cat([t[:, 0], t.new_zeros(t.shape[0], c - d)], dim=1))
        sc_rows.append(torch.cat([t[:, 1], t.new_full((t.shape[0], c - d), inf)], dim=1))
    kv_rows.append(kv.new_zeros(1, c, dtype=torch.float32))
    sc_rows.append(kv.new_full((1, c), inf, dtype=torch.float32))
    kv_all = torch.cat(kv_rows).to(kv.dtype)  # rounded through the activation dtype, as the reference's cat
    sc_all = torch.cat(sc_rows)
    none = kv_all.shape[0] - 1

    def index(codes: torch.Tensor) -> torch.Tensor:
        codes = codes.long()
        return torch.where(codes >= 0, codes, torch.where(codes == -1, none, n_step - 2 - codes))

    if win_src.shape[0]:
        idx = index(win_src)
        first = idx[:, :idx.shape[1] - r]
        own = idx[:, idx.shape[1] - r:]
        off = d if overlap else 0
        kv_win = torch.cat([kv_all[first][..., :d], kv_all[own][..., off:off + d]], dim=1)
        sc_win = torch.cat([sc_all[first][..., :d], sc_all[own][..., off:off + d]], dim=1)
        weights = sc_win.softmax(dim=1, dtype=torch.float32).to(kv_win.dtype)
        pooled = RMSNorm.forward(SimpleNamespace(weight=norm_weight, eps=eps), (kv_win * weights).sum(dim=1))
        cos, sin = Rotary.cos_sin(SimpleNamespace(inv_freq=inv_freq), win_pos.long(), pooled.dtype)
        entries.view(-1, d)[win_dest.long()] = apply_rope(pooled, cos, sin).to(entries.dtype)
    if tail is not None and tail_src.shape[0]:
        idx = index(tail_src)
        tail[tail_dest.long()] = torch.stack([kv_all[idx][..., :d].float(), sc_all[idx][..., :d]], dim=2)
    if ring_src.shape[0]:
        idx = index(ring_src)
        flat[ring_dest.long()] = torch.stack([kv_all[idx].float(), sc_all[idx]], dim=1)
