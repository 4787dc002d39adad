"""One decode token per request through a KV compressor (CSA overlapping / HCA disjoint
windows), in one launch: ring write, pooled window softmax, RMSNorm, RoPE, and the
conditional entry and overlap-tail writes.

Math of ``deepinfer.models.v4.compressor.Compressor.forward`` for ``seq.length == 1``
(request at position p, state slot s, ratio r, entry width d, C = coff * d columns):

* ``sc = float(wgate(x)) + ape[p % r]``; ring[s, p % L] = (kv, sc) in float32;
* when the window closes (``(p + 1) % r == 0``), window w = p // r pools its rows
  (CSA: the previous window's first halves ``[:d]`` (none when w = 0) then its own
  second halves ``[d:]``; HCA: its own rows): per channel ``a = round(softmax(sc))``,
  ``pooled = round(sum_k round(kv_k * a_k))``, then ``RMSNorm`` and RoPE at position w * r
  (cos/sin rounded through the activation dtype) -> entry w of the paged pool;
* CSA at a block end (``(p + 1) % block_size == 0``): the window's first halves (kv, sc)
  are saved as the block's tail (prefix-cache hits resume from it).

The current token's row is taken from registers, never re-read from the ring, so the
launch needs no barrier. Every write is idempotent (a graph warm-up may run a step twice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, next_pow2, pooled_entry, round_to


@triton.jit
def _compress_row(r, kv_ptr, sc_ptr, ape_ptr, pos_ptr, slot_ptr, ring_ptr, ent_ptr, tab_ptr, tail_ptr,
                  norm_w_ptr, freq_ptr, stride_kv, stride_sc, stride_tab, L, EPB, BS, eps,
                  RATIO: tl.constexpr, OVERLAP: tl.constexpr, HAS_TAIL: tl.constexpr,
                  D: tl.constexpr, C: tl.constexpr, OWN: tl.constexpr, NWIN: tl.constexpr,
                  ROPE_HALF: tl.constexpr, CODE: tl.constexpr, INTERP: tl.constexpr, BLOCK_R: tl.constexpr):
    """One token (row r) through the compressor.
    C = coff * D columns per ring row; OWN = column offset of a token's own-window half
    (D for overlapping windows); NWIN = rows pooled per window (2 * RATIO when overlapping)."""
    p = tl.load(pos_ptr + r).to(tl.int32)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    d = tl.arange(0, D)
    ring = ring_ptr + slot * L * 2 * C  # [L, 2, C] float32
    # ring write: all C columns of this token
    for c0 in tl.static_range(0, C, D):
        kv_c = tl.load(kv_ptr + r * stride_kv + c0 + d).to(tl.float32)
        sc_c = tl.load(sc_ptr + r * stride_sc + c0 + d).to(tl.float32) + tl.load(ape_ptr + (p % RATIO) * C + c0 + d)
        row = ring + (p % L) * 2 * C
        tl.store(row + c0 + d, kv_c)
        tl.store(row + C + c0 + d, sc_c)
    cur_kv_own = tl.load(kv_ptr + r * stride_kv + OWN + d).to(tl.float32)
    cur_sc_own = tl.load(sc_ptr + r * stride_sc + OWN + d).to(tl.float32) + tl.load(ape_ptr + (p % RATIO) * C + OWN + d)
    w = p // RATIO
    first = w * RATIO - (RATIO if OVERLAP else 0)  # position of window row 0
    if (p + 1) % RATIO == 0:
        # pass 1: per-channel max and sum of exp over the window rows
        mx = tl.full([D], float("-inf"), dtype=tl.float32)
        for k0 in range(0, NWIN, BLOCK_R):
            k = k0 + tl.arange(0, BLOCK_R)
            kpos = first + k
            ok = (k < NWIN) & (kpos >= 0)
            col = tl.where(k >= NWIN - RATIO, OWN, 0)
            sc_t = tl.load(ring + ((kpos + L) % L)[:, None] * 2 * C + C + col[:, None] + d[None, :],
                           mask=ok[:, None], other=float("-inf"))
            sc_t = tl.where((kpos == p)[:, None], cur_sc_own[None, :], sc_t)
            mx = tl.maximum(mx, tl.max(sc_t, axis=0))
        den = tl.zeros([D], dtype=tl.float32)
        for k0 in range(0, NWIN, BLOCK_R):
            k = k0 + tl.arange(0, BLOCK_R)
            kpos = first + k
            ok = (k < NWIN) & (kpos >= 0)
            col = tl.where(k >= NWIN - RATIO, OWN, 0)
            sc_t = tl.load(ring + ((kpos + L) % L)[:, None] * 2 * C + C + col[:, None] + d[None, :],
                           mask=ok[:, None], other=float("-inf"))
            sc_t = tl.where((kpos == p)[:, None], cur_sc_own[None, :], sc_t)
            den += tl.sum(tl.exp(sc_t - mx[None, :]), axis=0)
        # pass 2: rounded weights times rounded values, summed in float32, rounded once
        acc = tl.zeros([D], dtype=tl.float32)
        for k0 in range(0, NWIN, BLOCK_R):
            k = k0 + tl.arange(0, BLOCK_R)
            kpos = first + k
            ok = (k < NWIN) & (kpos >= 0)
            col = tl.where(k >= NWIN - RATIO, OWN, 0)
            base = ring + ((kpos + L) % L)[:, None] * 2 * C + col[:, None] + d[None, :]
            sc_t = tl.load(base + C, mask=ok[:, None], other=float("-inf"))
            kv_t = tl.load(base, mask=ok[:, None], other=0.0)
            cur = (kpos == p)[:, None]
            sc_t = tl.where(cur, cur_sc_own[None, :], sc_t)
            kv_t = tl.where(cur, cur_kv_own[None, :], kv_t)
            a = round_to(tl.exp(sc_t - mx[None, :]) / den[None, :], CODE, INTERP)
            acc += tl.sum(round_to(round_to(kv_t, CODE, INTERP) * a, CODE, INTERP), axis=0)
        y = pooled_entry(acc, w * RATIO, norm_w_ptr, freq_ptr, eps, D, ROPE_HALF, CODE, INTERP)
        blk = tl.load(tab_ptr + r * stride_tab + w // EPB).to(tl.int64)
        tl.store(ent_ptr + (blk * EPB + w % EPB) * D + d, y.to(ent_ptr.dtype.element_ty))
    if HAS_TAIL:
        if (p + 1) % BS == 0:  # the block ends: save the last window's first halves (kv, sc)
            cur_kv_a = tl.load(kv_ptr + r * stride_kv + d).to(tl.float32)
            cur_sc_a = tl.load(sc_ptr + r * stride_sc + d).to(tl.float32) + tl.load(ape_ptr + (p % RATIO) * C + d)
            tail_blk = tl.load(tab_ptr + r * stride_tab + p // BS).to(tl.int64)
            rows = tl.arange(0, RATIO)
            tpos = p - RATIO + 1 + rows
            src = ring + ((tpos + L) % L)[:, None] * 2 * C + d[None, :]
            is_cur = (tpos == p)[:, None]
            kv_a = tl.where(is_cur, cur_kv_a[None, :], tl.load(src))
            sc_a = tl.where(is_cur, cur_sc_a[None, :], tl.load(src + C))
            dst = tail_ptr + tail_blk * RATIO * 2 * D + rows[:, None] * 2 * D + d[None, :]
            tl.store(dst, kv_a)
            tl.store(dst + D, sc_a)


@triton.jit(do_not_specialize=["n_rows"])
def _compressor_decode_kernel(kv_ptr, sc_ptr, ape_ptr, pos_ptr, slot_ptr, ring_ptr, ent_ptr, tab_ptr, tail_ptr,
                              norm_w_ptr, freq_ptr, starts_ptr, n_rows, stride_kv, stride_sc, stride_tab, L, EPB,
                              BS, eps, GROUPED: tl.constexpr, RATIO: tl.constexpr, OVERLAP: tl.constexpr,
                              HAS_TAIL: tl.constexpr, D: tl.constexpr, C: tl.constexpr, OWN: tl.constexpr,
                              NWIN: tl.constexpr, ROPE_HALF: tl.constexpr, CODE: tl.constexpr,
                              INTERP: tl.constexpr, BLOCK_R: tl.constexpr):
    # one program per request; its rows (consecutive positions) in order, each after a
    # barrier so that the ring rows the previous one wrote are visible to every thread
    g = tl.program_id(0).to(tl.int64)
    if GROUPED:
        lo = tl.load(starts_ptr + g).to(tl.int64)
        hi = tl.minimum(tl.load(starts_ptr + g + 1).to(tl.int64), n_rows)
    else:
        lo = g
        hi = g + 1
    for row in range(lo, hi):
        tl.debug_barrier()
        _compress_row(row, kv_ptr, sc_ptr, ape_ptr, pos_ptr, slot_ptr, ring_ptr, ent_ptr, tab_ptr,
                      tail_ptr, norm_w_ptr, freq_ptr, stride_kv, stride_sc, stride_tab, L, EPB, BS, eps,
                      RATIO, OVERLAP, HAS_TAIL, D, C, OWN, NWIN, ROPE_HALF, CODE, INTERP, BLOCK_R)


def compressor_decode(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor, ring: torch.Tensor, entries: torch.Tensor, table: torch.Tensor,
                      tail: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor,
                      ratio: int, overlap: bool, block_size: int, row_starts: torch.Tensor | None = None) -> None:
    """In-place decode update of one compressor for T rows (see the module doc).

    kv, score: [T, C] projections ``wkv(x)``, ``wgate(x)`` (row-strided views allowed);
    ape [ratio, C] f32; positions, slots [T] int; ring [slots, L, 2, C] f32; entries
    [blocks, block_size // ratio, d]; table [T, W] int block ids of the entry group (per
    row); tail [blocks, ratio, 2, d] f32 (overlap only); norm_weight [d] f32; inv_freq
    [rope_dim / 2] f32 of the compressed rotary. ``row_starts`` [G + 1] int32: group g
    (one request's consecutive positions, e.g. a token and its drafts) is rows
    [row_starts[g], row_starts[g + 1]), processed in order; None = every row its own group."""
    check_device(kv)
    n, c = kv.shape
    d = entries.shape[-1]
    if c != (2 if overlap else 1) * d or d != next_pow2(d) or ring.shape[-1] != c:
        raise ValueError(f"compressor_decode: kv width {c}, entry width {d} and ring width {ring.shape[-1]} "
                         f"disagree (overlap={overlap}), or d is not a power of two")
    assert kv.stride(1) == 1 and score.stride(1) == 1 and ring.is_contiguous() and entries.is_contiguous()
    if n == 0:
        return
    half = inv_freq.numel()
    groups = n if row_starts is None else row_starts.numel() - 1
    _compressor_decode_kernel[(groups,)](
        kv, score, ape.float().contiguous(), positions, slots, ring, entries, table,
        tail if tail is not None else ring, norm_weight.float().contiguous(),
        inv_freq.to(device=kv.device, dtype=torch.float32).contiguous(),
        row_starts if row_starts is not None else positions, n,
        kv.stride(0), score.stride(0), table.stride(0), ring.shape[1], entries.shape[1], block_size, float(eps),
        GROUPED=row_starts is not None, RATIO=ratio, OVERLAP=overlap, HAS_TAIL=tail is not None, D=d, C=c, OWN=d if overlap else 0,
        NWIN=2 * ratio if overlap else ratio, ROPE_HALF=half, CODE=dtype_code(kv.dtype), INTERP=interpreting(),
        BLOCK_R=min(16, next_pow2(2 * ratio if overlap else ratio)), num_warps=4 if d <= 128 else 8)


def compressor_decode_ref(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
                          slots: torch.Tensor, ring: torch.Tensor, entries: torch.Tensor, table: torch.Tensor,
                          tail: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                          inv_freq: torch.Tensor, ratio: int, overlap: bool, block_size: int,
                          row_starts: torch.Tensor | None = None) -> None:
    """Torch reference with the signature of :func:`compressor_decode`: the j-th rows of
    every group together, j = 0, 1, ... in order (:func:`_rows_ref`)."""
    args = (ape, ring, entries, tail, norm_weight, eps, inv_freq, ratio, overlap, block_size)
    if row_starts is None:
        return _rows_ref(kv, score, positions, slots, table, *args)
    starts = row_starts.long().clamp(max=kv.shape[0])
    n_rows = starts[1:] - starts[:-1]
    for j in range(int(n_rows.max()) if n_rows.numel() else 0):
        rows = (starts[:-1] + j)[n_rows > j]
        _rows_ref(kv[rows], score[rows], positions[rows], slots[rows], table[rows], *args)


def _rows_ref(kv: torch.Tensor, score: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              table: torch.Tensor, ape: torch.Tensor, ring: torch.Tensor, entries: torch.Tensor,
              tail: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor,
              ratio: int, overlap: bool, block_size: int) -> None:
    """One token per request (distinct requests, or copies of one row), batched with the
    model's own pieces (``RMSNorm``, ``Rotary.cos_sin``, ``apply_rope``) and
    ``Compressor.forward``'s window layout; closing / block-end writes via torch.where."""
    from types import SimpleNamespace

    from deepinfer.models.norm import RMSNorm
    from deepinfer.models.rope import Rotary, apply_rope

    r, d, pos, slot, table = ratio, entries.shape[-1], positions.long(), slots.long(), table.long()
    sc = score + ape[pos % r]
    ring_len = ring.shape[1]
    ring[slot, pos % ring_len] = torch.stack([kv.float(), sc.float()], dim=1)
    w = pos // r
    own = w[:, None] * r + torch.arange(r, device=kv.device)[None, :]  # [R, r]
    rows = ring[slot[:, None], own % ring_len]  # [R, r, 2, C]
    if overlap:
        prev = ring[slot[:, None], (own - r) % ring_len]
        has_prev = (w >= 1)[:, None, None]
        kv_a = torch.where(has_prev, prev[:, :, 0, :d].to(kv.dtype), torch.zeros((), dtype=kv.dtype, device=kv.device))
        sc_a = torch.where(has_prev, prev[:, :, 1, :d], torch.full((), float("-inf"), device=kv.device))
        kv_win = torch.cat([kv_a, rows[:, :, 0, d:].to(kv.dtype)], dim=1)  # [R, 2r, d]
        sc_win = torch.cat([sc_a, rows[:, :, 1, d:]], dim=1)
    else:
        kv_win, sc_win = rows[:, :, 0].to(kv.dtype), rows[:, :, 1]
    weights = sc_win.softmax(dim=1, dtype=torch.float32).to(kv_win.dtype)
    pooled = RMSNorm.forward(SimpleNamespace(weight=norm_weight, eps=eps), (kv_win * weights).sum(dim=1))
    cos, sin = Rotary.cos_sin(SimpleNamespace(inv_freq=inv_freq), w * r, pooled.dtype)
    entry = apply_rope(pooled, cos, sin)
    per = entries.shape[1]
    blk, sub = table.gather(1, (w // per)[:, None])[:, 0], w % per
    closes = ((pos + 1) % r == 0)[:, None]
    entries[blk, sub] = torch.where(closes, entry.to(entries.dtype), entries[blk, sub])
    if tail is not None:
        last = ring[slot[:, None], (pos[:, None] - r + 1 + torch.arange(r, device=kv.device)[None, :]) % ring_len]
        tblk = table.gather(1, (pos // block_size)[:, None])[:, 0]
        ends = ((pos + 1) % block_size == 0)[:, None, None, None]
        tail[tblk] = torch.where(ends, last[..., :d], tail[tblk])
