"""Batch-invariant attention of one request (the "attention" op of batch-invariant mode).

Same contract as ``deepinfer.models.invariant_attention.attend`` (its torch reference,
``attend_reference``): queries [L, H, D] at positions ``pos`` over one shared KV
vector per key (K = V), a sliding window of W keys, optional compressed entries with
a per-query visibility mask, a per-head sink logit (denominator only).

One program per (query, block of heads) walks that query's keys in one order that is
a function of its own position only:

* the W window slots, slot j = position p - W + 1 + j (slots before position 0
  masked), in blocks of BLOCK_KEYS from slot 0;
* the compressed entries in blocks of BLOCK_KEYS from entry id 0; a block the query
  sees none of is skipped (it would add exact zeros), so how many entries exist
  beyond the visible ones (which depends on where the chunk ends) changes nothing.

The softmax runs online in float32 starting from the sink (max = sink, sum = 1), with
every block's logits from a fixed-shape dot. So a query's output does not depend on
its chunk, on the other queries of the call or on the other requests of the step.
Output in q's dtype; differs from the reference (two-pass softmax, float32 P @ V)
within the dtype's tolerance: here P is rounded to the operand dtype for the P @ V
tensor-core dot, as flash attention does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, next_pow2, round_to
from .batch_invariant_common import bi_dot

__all__ = ["attention", "BLOCK_KEYS"]

BLOCK_KEYS = 32  # keys per block: fixed, never derived from the step
BLOCK_H = 16  # heads per program on a GPU (the MMA's M; fewer heads are masked)


@triton.jit(do_not_specialize=["k_lo", "n_keys", "n_entries"])
def _attention_kernel(q_ptr, pos_ptr, keys_ptr, ent_ptr, mask_ptr, sink_ptr, out_ptr,
                      k_lo, n_keys, n_entries, H, D, W, scale,
                      stride_ql, stride_qh, stride_k, stride_e, stride_ml, stride_ol, stride_oh,
                      CODE: tl.constexpr, INTERP: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_KEYS: tl.constexpr):
    i, hb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + i * stride_ql + heads[:, None] * stride_qh + d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    p = tl.load(pos_ptr + i).to(tl.int32)
    m = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32)
    l = tl.full([BLOCK_H], 1.0, dtype=tl.float32)  # exp(sink - max) with max = sink
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    j = tl.arange(0, BLOCK_KEYS)
    n_win = tl.cdiv(W, BLOCK_KEYS)
    # One loop over the query's key blocks: the window's slots first (slot order), then
    # the compressed entries (id order). A block without a visible key would add exact
    # zeros and is skipped.
    for b in range(0, n_win + tl.cdiv(n_entries, BLOCK_KEYS)):
        if b < n_win:
            slot = b * BLOCK_KEYS + j
            kpos = p - W + 1 + slot
            # kpos >= k_lo (>= 0) is the contract's window start; also keeps every read inside keys
            ok = (slot < W) & (kpos >= k_lo) & (kpos >= 0) & (kpos - k_lo < n_keys)
            rows = keys_ptr + tl.where(ok, kpos - k_lo, 0).to(tl.int64) * stride_k
        else:
            e = (b - n_win) * BLOCK_KEYS + j
            ok = tl.load(mask_ptr + i * stride_ml + e, mask=e < n_entries, other=0) != 0
            rows = ent_ptr + e.to(tl.int64) * stride_e
        if tl.max(ok.to(tl.int32), axis=0) > 0:
            k = tl.load(rows[:, None] + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
            s = bi_dot(q, tl.trans(k), tl.zeros([BLOCK_H, BLOCK_KEYS], dtype=tl.float32), CODE == 0, INTERP)
            s = tl.where(ok[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: m starts at the sink
            alpha = tl.exp(m - m_new)
            pr = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(pr, axis=1)
            if CODE != 0:
                pr = round_to(pr, CODE, INTERP)  # what the cast below does on a GPU (the interpreter truncates)
            acc = bi_dot(pr.to(k.dtype), k, acc * alpha[:, None], CODE == 0, INTERP)
            m = m_new
    out = acc / l[:, None]
    if CODE != 0:
        out = round_to(out, CODE, INTERP)
    tl.store(out_ptr + i * stride_ol + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & d_ok[None, :])


def attention(q: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor, k_lo: int, window: int,
              entries: torch.Tensor | None, entry_mask: torch.Tensor | None, sink: torch.Tensor,
              scale: float) -> torch.Tensor:
    """See ``deepinfer.models.invariant_attention.attend`` for the arguments; returns
    [L, H, D] in q's dtype (float32, bf16 or fp16)."""
    check_device(q, keys)
    n_q, heads, dim = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    keys = keys.to(q.dtype)
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    out = torch.empty_like(q)
    if n_q == 0:
        return out
    has_entries = entries is not None and entries.shape[0] > 0
    if has_entries:
        if entry_mask is None or tuple(entry_mask.shape) != (n_q, entries.shape[0]):
            raise ValueError(f"entry_mask must be [L, n] = [{n_q}, {entries.shape[0]}], got "
                             f"{None if entry_mask is None else tuple(entry_mask.shape)}")
        ent = entries.to(q.dtype).contiguous()
        mask = entry_mask.to(torch.bool).contiguous().view(torch.uint8)
        n_entries = ent.shape[0]
    else:
        ent, mask, n_entries = keys, torch.zeros(1, 1, dtype=torch.uint8, device=q.device), 0
    block_d = next_pow2(dim)
    interp = interpreting()
    block_h = next_pow2(heads) if interp else BLOCK_H  # the interpreter has no MMA shape limits
    warps = 1 if interp else (8 if block_d >= 256 else 4)
    _attention_kernel[(n_q, triton.cdiv(heads, block_h))](
        q, pos.contiguous(), keys, ent, mask, sink.float().contiguous(), out,
        int(k_lo), keys.shape[0], n_entries, heads, dim, int(window), float(scale),
        q.stride(0), q.stride(1), keys.stride(0), ent.stride(0), mask.stride(0), out.stride(0), out.stride(1),
        CODE=dtype_code(q.dtype), INTERP=interp,
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_KEYS=BLOCK_KEYS, num_warps=warps, num_stages=1)
    return out
