"""Variable-length prefill attention for DeepSeek-V4's shared-KV MQA (many query rows per
request, several requests per call).

Rows are a flattened batch: row t belongs to request ``row_req[t]`` and sits at position
``positions[t]``; a request's rows are consecutive with consecutive positions (a chunk).
Every row at position p, with H query heads of width D and ONE shared KV vector per key
(keys = values), attends to

* window keys: the raw KV rows at positions [max(0, p - W + 1), p] of the paged pool
  ``swa_pool`` [blocks, block_size, D] via its request's ``swa_table`` row;
* compressed keys (ratio > 0): entries of ``comp_pool`` [blocks, block_size / ratio, D]
  via ``comp_table``: HCA (``topk_idx`` None) every entry j < (p + 1) // ratio; CSA the
  entry ids of its own ``topk_idx`` row (-1 = none);
* ``floor`` (optional, [R] int32 per request): window keys below it are never visible
  (DeepSeek-V4.1's bounded replay narrows its decoder layers' windows at the request's
  cut: keys in [max(p - W + 1, floor), p]);
* ``o_h = sum_k softmax_k(s_hk) v_k`` with ``s = round(round(q_h . k) * D^-0.5)`` (the
  reference's rounding points) and the per-head sink logit added to the denominator only.

This is ``Attention._attend_one`` of the reference path, for every row of every request
at once. The caller writes the chunk's window KV and compressed entries into the pools
first, so the keys of a row are all in the pools.

Programs: window / HCA layers take ``BLOCK_T`` consecutive rows of one request (a query
tile, see :func:`query_tiles`) times ``BLOCK_H`` heads as the rows of one MMA, so the tile
shares each key block load; CSA rows have their own entry lists, so one row per program.
Each program walks its keys in a fixed order (window, then entries) in blocks aligned to
absolute key positions, so a row's result does not depend on how the rows were tiled or
batched (a block of keys masked for a row adds exact zeros). Output: q's dtype.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, next_pow2, round_to

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, acc, CODE: tl.constexpr, INTERP: tl.constexpr):
    if INTERP:  # the interpreter multiplies bf16 bit patterns: upcast (exact products)
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    elif CODE == 0:  # float32 models: no tf32
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _attend(q, k, vis, m, l, acc, scale, CODE: tl.constexpr, INTERP: tl.constexpr):
    """One block of keys into the running (max, denominator, accumulator) of every row."""
    s = _dot(q, tl.trans(k), tl.zeros([q.shape[0], k.shape[0]], dtype=tl.float32), CODE, INTERP)
    s = round_to(round_to(s, CODE, INTERP) * scale, CODE, INTERP)
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2((m - m_safe) * 1.4426950408889634)
    p = tl.exp2((s - m_safe[:, None]) * 1.4426950408889634)
    l = l * alpha + tl.sum(p, axis=1)
    if INTERP:
        p = round_to(p, CODE, INTERP)  # the interpreter's own cast truncates
    acc = _dot(p.to(k.dtype), k, acc * alpha[:, None], CODE, INTERP)
    return m_new, l, acc


@triton.jit(do_not_specialize=["stride_swt", "stride_ct"])  # table widths vary with the context
def _prefill_attention_kernel(q_ptr, pos_ptr, req_ptr, tile_ptr, swa_ptr, swa_tab_ptr, comp_ptr, comp_tab_ptr,
                              topk_ptr, sink_ptr, out_ptr, floor_ptr, H, W, BS, EPB, RATIO, TOPK, scale,
                              stride_qt, stride_qh, stride_swt, stride_ct, stride_tk, stride_ot, stride_oh,
                              HAS_COMP: tl.constexpr, CSA: tl.constexpr, TILED: tl.constexpr, HAS_FLOOR: tl.constexpr,
                              CODE: tl.constexpr,
                              INTERP: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_N: tl.constexpr):
    tile, hb = tl.program_id(0), tl.program_id(1)
    if TILED:
        row0 = tl.load(tile_ptr + 2 * tile).to(tl.int64)
        nrows = tl.load(tile_ptr + 2 * tile + 1)
    else:
        row0 = tile.to(tl.int64)
        nrows = 1
    req = tl.load(req_ptr + row0).to(tl.int64)
    p0 = tl.load(pos_ptr + row0).to(tl.int32)
    mm = tl.arange(0, BLOCK_T * BLOCK_H)
    t = mm // BLOCK_H
    h = hb * BLOCK_H + mm % BLOCK_H
    row_ok = (t < nrows) & (h < H)
    prow = p0 + t
    rows = row0 + t.to(tl.int64)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :], mask=row_ok[:, None],
                other=0.0)
    p_last = p0 + nrows - 1
    lo = tl.maximum(p0 - W + 1, 0)
    if HAS_FLOOR:  # bounded replay: nothing below the request's cut (same floor for every row of a tile)
        lo = tl.maximum(lo, tl.load(floor_ptr + req).to(tl.int32))
    m = tl.full([BLOCK_T * BLOCK_H], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_T * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_T * BLOCK_H, D], dtype=tl.float32)
    for kb in range((lo // BLOCK_N) * BLOCK_N, p_last + 1, BLOCK_N):
        kpos = kb + tl.arange(0, BLOCK_N)
        kval = (kpos >= lo) & (kpos <= p_last)  # lo includes the floor: rows of a tile share it
        blk = tl.load(swa_tab_ptr + req * stride_swt + kpos // BS, mask=kval, other=0).to(tl.int64)
        k = tl.load(swa_ptr + (blk * BS + kpos % BS)[:, None] * D + d[None, :], mask=kval[:, None], other=0.0)
        vis = kval[None, :] & (kpos[None, :] <= prow[:, None]) & (kpos[None, :] > prow[:, None] - W)
        m, l, acc = _attend(q, k, vis, m, l, acc, scale, CODE, INTERP)
    if HAS_COMP:
        if CSA:
            for kb in range(0, TOPK, BLOCK_N):
                slot = kb + tl.arange(0, BLOCK_N)
                ent = tl.load(topk_ptr + row0 * stride_tk + slot, mask=slot < TOPK, other=-1)
                kval = ent >= 0
                ent = tl.where(kval, ent, 0)
                blk = tl.load(comp_tab_ptr + req * stride_ct + ent // EPB, mask=kval, other=0).to(tl.int64)
                k = tl.load(comp_ptr + (blk * EPB + ent % EPB)[:, None] * D + d[None, :], mask=kval[:, None],
                            other=0.0)
                vis = kval[None, :] & (mm >= 0)[:, None]
                m, l, acc = _attend(q, k, vis, m, l, acc, scale, CODE, INTERP)
        else:
            n_ent = (p_last + 1) // RATIO
            for kb in range(0, n_ent, BLOCK_N):
                ent = kb + tl.arange(0, BLOCK_N)
                kval = ent < n_ent
                blk = tl.load(comp_tab_ptr + req * stride_ct + ent // EPB, mask=kval, other=0).to(tl.int64)
                k = tl.load(comp_ptr + (blk * EPB + ent % EPB)[:, None] * D + d[None, :], mask=kval[:, None],
                            other=0.0)
                vis = kval[None, :] & (ent[None, :] < ((prow + 1) // RATIO)[:, None])
                m, l, acc = _attend(q, k, vis, m, l, acc, scale, CODE, INTERP)
    sink = tl.load(sink_ptr + h, mask=h < H, other=0.0)
    big = tl.maximum(m, sink)
    a = tl.exp2((m - big) * 1.4426950408889634)
    den = l * a + tl.exp2((sink - big) * 1.4426950408889634)
    o = round_to((acc * a[:, None]) / den[:, None], CODE, INTERP)
    tl.store(out_ptr + rows[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def query_tiles(starts: list[int], lengths: list[int], offsets: list[int], block_t: int,
                device: torch.device | str) -> torch.Tensor:
    """Query tiles [n_tiles, 2] int32 (first row, rows) of a flattened batch: each request's
    rows cut at absolute positions that are multiples of ``block_t`` (so a row lands in the
    same tile shape whatever chunk it arrives in)."""
    parts = []
    for s, n, off in zip(starts, lengths, offsets):
        first = np.arange((s // block_t) * block_t, s + n, block_t)
        lo, hi = np.maximum(first, s), np.minimum(first + block_t, s + n)
        parts.append(np.stack([off + lo - s, hi - lo], axis=1))
    tiles = np.concatenate(parts) if parts else np.zeros((0, 2), dtype=np.int64)
    return torch.from_numpy(tiles.astype(np.int32)).to(device)


def prefill_attention(q: torch.Tensor, positions: torch.Tensor, row_req: torch.Tensor, swa_pool: torch.Tensor,
                      swa_table: torch.Tensor, window: int, sink: torch.Tensor, comp_pool: torch.Tensor | None = None,
                      comp_table: torch.Tensor | None = None, ratio: int = 0, topk_idx: torch.Tensor | None = None,
                      tiles: torch.Tensor | None = None, block_t: int = 1, block_h: int = 16, block_n: int = 32,
                      num_warps: int | None = None, num_stages: int = 2,
                      floor: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill attention; see the module doc. q [T, H, D] (D a power of two), positions
    [T] int, row_req [T] int32 (request of each row: the row of swa_table / comp_table),
    tables [R, width] int32, topk_idx [T, k] int32 (CSA). ``tiles`` (from
    :func:`query_tiles` with ``block_t``) groups rows for window / HCA layers; without it,
    or for CSA, every row is its own program. ``floor`` [R] int32: the lowest visible
    window key position of each request (None: 0). Returns [T, H, D] in q's dtype."""
    check_device(q)
    n_rows, n_heads, d = q.shape
    assert d == next_pow2(d) and q.stride(2) == 1 and swa_pool.is_contiguous()
    out = torch.empty(n_rows, n_heads, d, dtype=q.dtype, device=q.device)
    has_comp = ratio > 0 and comp_pool is not None
    csa = has_comp and topk_idx is not None
    tiled = tiles is not None and not csa and block_t > 1
    bh = max(16, min(block_h, next_pow2(n_heads)))
    bt = block_t if tiled else 1
    n_prog = tiles.shape[0] if tiled else n_rows
    if n_prog == 0:
        return out
    comp = comp_pool if has_comp else swa_pool
    ctab = comp_table if has_comp else swa_table
    tk = topk_idx if csa else swa_table
    tile_arg = tiles if tiled else row_req
    opts = {} if interpreting() else {"enable_fp_fusion": False}
    if num_warps is None:  # sm_90, D = 512: 32-row programs spill registers with 4 warps, not with 8
        num_warps = 8 if bt * bh >= 32 else 4
    _prefill_attention_kernel[(n_prog, triton.cdiv(n_heads, bh))](
        q, positions, row_req, tile_arg, swa_pool, swa_table, comp, ctab, tk, sink.float().contiguous(), out,
        floor if floor is not None else row_req,
        n_heads, window, swa_pool.shape[1], comp.shape[1], max(ratio, 1), tk.shape[1] if csa else 0,
        float(d ** -0.5), q.stride(0), q.stride(1), swa_table.stride(0), ctab.stride(0), tk.stride(0),
        out.stride(0), out.stride(1),
        HAS_COMP=has_comp, CSA=csa, TILED=tiled, HAS_FLOOR=floor is not None, CODE=dtype_code(q.dtype),
        INTERP=interpreting(), D=d,
        BLOCK_T=bt, BLOCK_H=bh, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, **opts)
    return out


def _request_rows(row_req: torch.Tensor) -> list[tuple[int, int, int]]:
    """(request, first row, rows) of each request's consecutive rows."""
    reqs, counts = torch.unique_consecutive(row_req.cpu(), return_counts=True)
    out, first = [], 0
    for r, n in zip(reqs.tolist(), counts.tolist()):
        out.append((r, first, n))
        first += n
    return out


def prefill_attention_ref(q: torch.Tensor, positions: torch.Tensor, row_req: torch.Tensor, swa_pool: torch.Tensor,
                          swa_table: torch.Tensor, window: int, sink: torch.Tensor,
                          comp_pool: torch.Tensor | None = None, comp_table: torch.Tensor | None = None,
                          ratio: int = 0, topk_idx: torch.Tensor | None = None, tiles: torch.Tensor | None = None,
                          block_t: int = 1, block_h: int = 16, block_n: int = 32,
                          num_warps: int | None = None, floor: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference with the signature of :func:`prefill_attention`: per request, the key
    gathering, masks and softmax of ``Attention._attend_one`` (``gather_rows`` layout)."""
    from deepinfer.models.paged_batch import gather_rows

    out = torch.empty_like(q)
    for r, first, n in _request_rows(row_req):
        rows = slice(first, first + n)
        pos = positions[rows]
        s, e = int(pos[0]), int(pos[-1]) + 1
        fl = int(floor[r]) if floor is not None else 0
        k_lo = min(max(0, s - window + 1, fl), e)
        keys = gather_rows(swa_pool, swa_table[r].tolist(), k_lo, e)
        key_pos = torch.arange(k_lo, e, device=q.device)
        visible = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - window)
        parts, masks = [keys], [visible]
        n_entries = e // ratio if ratio and comp_pool is not None else 0
        if n_entries:
            parts.append(gather_rows(comp_pool, comp_table[r].tolist(), 0, n_entries))
            if topk_idx is not None:
                top = topk_idx[rows].long()
                chosen = torch.zeros(n, n_entries + 1, dtype=torch.bool, device=q.device)
                chosen.scatter_(1, torch.where(top >= 0, top, n_entries), True)
                masks.append(chosen[:, :n_entries])
            else:
                masks.append(torch.arange(n_entries, device=q.device)[None, :] < ((pos + 1) // ratio)[:, None])
        kv_all, mask = torch.cat(parts), torch.cat(masks, dim=1)
        # --- the final lines of Attention._attend_one ---
        logits = torch.einsum("lhd,kd->lhk", q[rows], kv_all) * q.shape[-1] ** -0.5
        logits = logits.float().masked_fill(~mask[:, None, :], float("-inf"))
        snk = sink.float()[None, :, None].expand(logits.shape[0], -1, 1)
        combined = torch.cat([logits, snk], dim=-1)
        probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        out[rows] = torch.einsum("lhk,kd->lhd", probs.to(kv_all.dtype), kv_all)
    return out
