"""Paged decode attention for DeepSeek-V4's shared-KV MQA (one query token per request).

Per request r at position p, with H query heads of width D and ONE shared KV vector per
key (keys = values):

* window keys: the raw KV rows at positions [max(0, p - W + 1), p] of the paged
  sliding-window pool ``swa_pool`` [blocks, block_size, D] via ``swa_table`` [R, *];
* compressed keys (ratio > 0): entries of the paged pool ``comp_pool``
  [blocks, block_size / ratio, D] via ``comp_table``: HCA (``topk_idx`` None) reads
  all entries j < (p + 1) // ratio; CSA reads the entry ids in ``topk_idx`` [R, k]
  (-1 = no entry);
* ``o_h = sum_k softmax_k(s_hk) v_k`` with ``s = round(round(q_h . k) * D^-0.5)`` (the
  reference's bf16 logits) and the per-head sink logit added to the denominator only.

This is ``Attention._attend_one`` for one query row. Output [R, H, D] float32 (the
reference rounds its output to bf16). Keys are cut into splits of ``kv_chunk`` (a fixed
size, never derived from the batch); splits are merged in index order by a second
kernel, so a request's output does not depend on the other requests in the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, mma, next_pow2, rope_tile, round_to

LOG2E = 1.4426950408889634


@triton.jit
def _update(q, k, valid, m, l, acc, scale, CODE: tl.constexpr, INTERP: tl.constexpr):
    """One block of keys into the running (max, denominator, accumulator)."""
    s = mma(q, tl.trans(k), tl.zeros([q.shape[0], k.shape[0]], dtype=tl.float32), INTERP)
    s = round_to(round_to(s, CODE, INTERP) * scale, CODE, INTERP)
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2((m - m_safe) * 1.4426950408889634)
    p = tl.exp2((s - m_safe[:, None]) * 1.4426950408889634)
    l = l * alpha + tl.sum(p, axis=1)
    if INTERP:
        p = round_to(p, CODE, INTERP)  # the interpreter's own cast truncates
    acc = mma(p.to(k.dtype), k, acc * alpha[:, None], INTERP)
    return m_new, l, acc


@triton.jit(do_not_specialize=["n_splits", "stride_swt", "stride_ct", "stride_tk"])
def _decode_kernel(q_ptr, pos_ptr, swa_ptr, swa_tab_ptr, comp_ptr, comp_tab_ptr, topk_ptr, sink_ptr,
                   out_ptr, m_ptr, l_ptr, freq_ptr, floor_ptr, H, W, BS, EPB, RATIO, TOPK, n_splits, scale,
                   stride_qr, stride_qh, stride_swt, stride_ct, stride_tk, stride_or, stride_oh,
                   HAS_COMP: tl.constexpr, CSA: tl.constexpr, FINAL: tl.constexpr, HAS_FLOOR: tl.constexpr,
                   CHUNK: tl.constexpr,
                   CODE: tl.constexpr, INTERP: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_N: tl.constexpr, ROPE_OUT: tl.constexpr, HALF: tl.constexpr):
    r, hb, c = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, D)
    q = tl.load(q_ptr + r * stride_qr + heads[:, None] * stride_qh + d[None, :], mask=hmask[:, None], other=0.0)
    p = tl.load(pos_ptr + r).to(tl.int32)
    lo = tl.maximum(p - W + 1, 0)
    n_win = p - lo + 1
    fl = 0
    if HAS_FLOOR:  # window keys below the row's floor are masked, not skipped: the slots keep their splits
        fl = tl.load(floor_ptr + r).to(tl.int32)
    n_comp = 0
    if HAS_COMP:
        if CSA:
            n_comp = TOPK
        else:
            n_comp = (p + 1) // RATIO
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, n_win + n_comp)
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    for kb in range(start, tl.minimum(end, n_win), BLOCK_N):
        idx = kb + tl.arange(0, BLOCK_N)
        kpos = lo + idx
        valid = (idx < tl.minimum(end, n_win)) & (kpos >= fl)
        blk = tl.load(swa_tab_ptr + r * stride_swt + kpos // BS, mask=valid, other=0).to(tl.int64)
        rows = blk * BS + kpos % BS
        k = tl.load(swa_ptr + rows[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        m, l, acc = _update(q, k, valid, m, l, acc, scale, CODE, INTERP)
    if HAS_COMP:
        for kb in range(tl.maximum(start, n_win), end, BLOCK_N):
            idx = kb + tl.arange(0, BLOCK_N)
            valid = idx < end
            ent = idx - n_win
            if CSA:
                ent = tl.load(topk_ptr + r * stride_tk + ent, mask=valid, other=-1)
                valid = valid & (ent >= 0)
                ent = tl.where(valid, ent, 0)
            blk = tl.load(comp_tab_ptr + r * stride_ct + ent // EPB, mask=valid, other=0).to(tl.int64)
            rows = blk * EPB + ent % EPB
            k = tl.load(comp_ptr + rows[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
            m, l, acc = _update(q, k, valid, m, l, acc, scale, CODE, INTERP)
    if FINAL:
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
        big = tl.maximum(m, sink)
        a = tl.exp2((m - big) * 1.4426950408889634)
        den = l * a
        den = den + tl.exp2((sink - big) * 1.4426950408889634)
        o = (acc * a[:, None]) / den[:, None]
        if ROPE_OUT:  # the output's rope slice rotated back (rounded to the activation dtype first)
            o = rope_tile(round_to(o, CODE, INTERP), p, freq_ptr, BLOCK_H, D, HALF, True, CODE, INTERP)
        tl.store(out_ptr + r * stride_or + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    else:
        part = (r * n_splits + c) * H + heads
        tl.store(m_ptr + part, m, mask=hmask)
        tl.store(l_ptr + part, l, mask=hmask)
        tl.store(out_ptr + part[:, None].to(tl.int64) * D + d[None, :], acc, mask=hmask[:, None])


@triton.jit(do_not_specialize=["n_splits"])
def _merge_kernel(acc_ptr, m_ptr, l_ptr, sink_ptr, out_ptr, pos_ptr, freq_ptr, H, n_splits, stride_or, stride_oh,
                  D: tl.constexpr, BLOCK_H: tl.constexpr, ROPE_OUT: tl.constexpr, HALF: tl.constexpr,
                  CODE: tl.constexpr, INTERP: tl.constexpr):
    r, hb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, D)
    big = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
    for c in range(0, n_splits):
        big = tl.maximum(big, tl.load(m_ptr + (r * n_splits + c) * H + heads, mask=hmask, other=float("-inf")))
    den = tl.zeros([BLOCK_H], dtype=tl.float32)
    num = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    for c in range(0, n_splits):
        part = (r * n_splits + c) * H + heads
        a = tl.exp2((tl.load(m_ptr + part, mask=hmask, other=float("-inf")) - big) * 1.4426950408889634)
        den = den + tl.load(l_ptr + part, mask=hmask, other=0.0) * a
        acc = tl.load(acc_ptr + part[:, None].to(tl.int64) * D + d[None, :], mask=hmask[:, None], other=0.0)
        num = num + acc * a[:, None]
    sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
    den = den + tl.exp2((sink - big) * 1.4426950408889634)
    o = num / den[:, None]
    if ROPE_OUT:
        p = tl.load(pos_ptr + r)
        o = rope_tile(round_to(o, CODE, INTERP), p, freq_ptr, BLOCK_H, D, HALF, True, CODE, INTERP)
    tl.store(out_ptr + r * stride_or + heads[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=hmask[:, None])


def decode_attention(q: torch.Tensor, positions: torch.Tensor, swa_pool: torch.Tensor, swa_table: torch.Tensor,
                     window: int, sink: torch.Tensor, comp_pool: torch.Tensor | None = None,
                     comp_table: torch.Tensor | None = None, ratio: int = 0, topk_idx: torch.Tensor | None = None,
                     kv_chunk: int = 256, max_keys: int | None = None, block_h: int = 16,
                     block_n: int = 32, num_warps: int = 4, rope_inv_freq: torch.Tensor | None = None,
                     floor: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention; see the module doc. ``floor`` [R] int32 (optional): window keys
    below each row's floor are masked (DeepSeek-V4.1's bounded replay: a decoder layer's
    window starts at the request's cut). q [R, H, D] (D a power of two), positions
    [R] int, tables int32. `max_keys` (an upper bound on window + compressed keys per
    request) sizes the split grid without a host read; graph capture must pass it.
    Returns float32 [R, H, D]; with ``rope_inv_freq`` (f32 [rope_dim / 2]) the output in
    q's dtype with its trailing rope channels rotated back by the query position (the
    attention epilogue: ``apply_rope(o.to(dtype), cos, -sin)``). The defaults (16 heads x
    32 keys a block, 4 warps, splits of 256 keys) were best or near it on an H200 for CSA /
    HCA at batch 8-64."""
    check_device(q)
    n_req, n_heads, d = q.shape
    assert d == next_pow2(d) and q.stride(2) == 1 and swa_pool.is_contiguous()
    has_comp = ratio > 0 and comp_pool is not None
    csa = has_comp and topk_idx is not None
    if max_keys is None:
        n_comp = 0
        if csa:
            n_comp = topk_idx.shape[1]
        elif has_comp and n_req:
            n_comp = (int(positions.max()) + 1) // ratio  # host read: pass max_keys in graphs
        max_keys = window + n_comp
    n_splits = max(1, triton.cdiv(max_keys, kv_chunk))
    rope_out = rope_inv_freq is not None
    out = torch.empty(n_req, n_heads, d, dtype=q.dtype if rope_out else torch.float32, device=q.device)
    freq = rope_inv_freq.float().contiguous() if rope_out else sink
    final = n_splits == 1
    if final:
        acc = m = l = out
    else:
        acc = torch.empty(n_req, n_splits, n_heads, d, dtype=torch.float32, device=q.device)
        m = torch.empty(n_req, n_splits, n_heads, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
    comp = comp_pool if has_comp else swa_pool
    ctab = comp_table if has_comp else swa_table
    tk = topk_idx.to(torch.int32) if csa else swa_table
    sink = sink.float().contiguous()
    opts = {} if interpreting() else {"enable_fp_fusion": False}
    bh = max(16, min(block_h, next_pow2(n_heads)))
    if n_req == 0:
        return out
    half = rope_inv_freq.numel() if rope_out else 1
    _decode_kernel[(n_req, triton.cdiv(n_heads, bh), n_splits)](
        q, positions, swa_pool, swa_table, comp, ctab, tk, sink, acc, m, l, freq,
        floor if floor is not None else positions,
        n_heads, window, swa_pool.shape[1], comp.shape[1], max(ratio, 1), tk.shape[1] if csa else 0, n_splits,
        float(d ** -0.5), q.stride(0), q.stride(1), swa_table.stride(0), ctab.stride(0), tk.stride(0),
        out.stride(0), out.stride(1),
        HAS_COMP=has_comp, CSA=csa, FINAL=final, HAS_FLOOR=floor is not None, CHUNK=kv_chunk,
        CODE=dtype_code(q.dtype), INTERP=interpreting(),
        D=d, BLOCK_H=bh, BLOCK_N=block_n, ROPE_OUT=rope_out, HALF=half, num_warps=num_warps, num_stages=2, **opts)
    if not final:
        _merge_kernel[(n_req, triton.cdiv(n_heads, bh))](
            acc, m, l, sink, out, positions, freq, n_heads, n_splits, out.stride(0), out.stride(1), D=d, BLOCK_H=bh,
            ROPE_OUT=rope_out, HALF=half, CODE=dtype_code(q.dtype), INTERP=interpreting(), num_warps=4, **opts)
    return out


def decode_attention_ref(q: torch.Tensor, positions: torch.Tensor, swa_pool: torch.Tensor,
                         swa_table: torch.Tensor, window: int, sink: torch.Tensor,
                         comp_pool: torch.Tensor | None = None, comp_table: torch.Tensor | None = None,
                         ratio: int = 0, topk_idx: torch.Tensor | None = None, kv_chunk: int = 256,
                         max_keys: int | None = None, block_h: int = 16, block_n: int = 32,
                         num_warps: int = 4, rope_inv_freq: torch.Tensor | None = None,
                         floor: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference with the signature of :func:`decode_attention`: per request the
    key gathering, masks and softmax of ``Attention._attend_one`` for one query row
    (``gather_rows`` / ``read_entries`` layout), then (``rope_inv_freq``) the output's
    inverse RoPE of ``Attention.forward``. Returns q's dtype, like the model."""
    from types import SimpleNamespace

    from deepinfer.models.rope import Rotary, apply_rope

    out = _attend_ref(q, positions, swa_pool, swa_table, window, sink, comp_pool, comp_table, ratio, topk_idx, floor)
    if rope_inv_freq is None:
        return out
    cos, sin = Rotary.cos_sin(SimpleNamespace(inv_freq=rope_inv_freq), positions, q.dtype)
    return apply_rope(out, cos, -sin)


def _attend_ref(q: torch.Tensor, positions: torch.Tensor, swa_pool: torch.Tensor, swa_table: torch.Tensor,
                window: int, sink: torch.Tensor, comp_pool: torch.Tensor | None, comp_table: torch.Tensor | None,
                ratio: int, topk_idx: torch.Tensor | None, floor: torch.Tensor | None = None) -> torch.Tensor:
    from deepinfer.models.paged_batch import gather_rows

    outs = []
    for r in range(q.shape[0]):
        p = int(positions[r])
        # keys below a floor are never read (bounded replay never wrote them: any bits, NaN too)
        k_lo = min(max(0, p - window + 1, int(floor[r]) if floor is not None else 0), p + 1)
        parts = [gather_rows(swa_pool, swa_table[r].tolist(), k_lo, p + 1)]
        masks = [torch.ones(1, p + 1 - k_lo, dtype=torch.bool, device=q.device)]
        n_entries = (p + 1) // ratio if ratio else 0
        if comp_pool is not None and n_entries:
            parts.append(gather_rows(comp_pool, comp_table[r].tolist(), 0, n_entries))
            if topk_idx is not None:  # CSA: the indexer's picks (-1 = none)
                top = topk_idx[r:r + 1].long()
                chosen = torch.zeros(1, n_entries + 1, dtype=torch.bool, device=q.device)
                chosen.scatter_(1, torch.where(top >= 0, top, n_entries), True)
                masks.append(chosen[:, :n_entries])
            else:
                masks.append(torch.ones(1, n_entries, dtype=torch.bool, device=q.device))
        kv_all, mask, qr = torch.cat(parts), torch.cat(masks, dim=1), q[r:r + 1]
        # --- the final lines of Attention._attend_one ---
        logits = torch.einsum("lhd,kd->lhk", qr, kv_all) * q.shape[-1] ** -0.5
        logits = logits.float().masked_fill(~mask[:, None, :], float("-inf"))
        snk = sink.float()[None, :, None].expand(logits.shape[0], -1, 1)
        combined = torch.cat([logits, snk], dim=-1)
        probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        outs.append(torch.einsum("lhk,kd->lhd", probs.to(kv_all.dtype), kv_all))
    return torch.cat(outs) if outs else q.new_empty(q.shape)
