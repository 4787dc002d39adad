"""DeepSeek-V4.1's Engram memory on the decode path, two launches per step and layer
instead of a few dozen torch ops (``deepinfer.models.v41.engram`` is the reference):

* :func:`engram_hash` - one launch per step for every Engram layer: each row's token goes
  into the paged token store, its look-back ``p - 1 .. p - N + 1`` comes from the same
  step's earlier rows of its request (rows of a request are consecutive) or from the store,
  and the n-gram hashes (``NgramHasher.hash_window``: compressed ids, XOR of
  ``id * multiplier``, Python-style modulo a prime per head, plus the head's offset) come
  out as table rows [R, layers, cols];
* :func:`engram_gate` - the gated value added to every stream
  (``Engram.forward`` after its ``wkv`` projection), with the previous sublayer's mHC
  expansion (``hc_expand``) of the streams first when it is still pending.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, next_pow2, round_to
from .hc_collapse import streams_tile


@triton.jit
def _hash_kernel(ids_ptr, pos_ptr, slot_ptr, tab_ptr, store_ptr, map_ptr, mult_ptr, prime_ptr, off_ptr, out_ptr,
                 stride_tab, BS, pad,
                 L: tl.constexpr, N: tl.constexpr, H: tl.constexpr, LP: tl.constexpr, HP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + r).to(tl.int64)
    token = tl.load(ids_ptr + r).to(tl.int64)
    # the token store: written here, read below only for positions before this step's rows
    tl.store(store_ptr + tl.load(tab_ptr + r * stride_tab + p // BS).to(tl.int64) * BS + p % BS, token)
    slot = tl.load(slot_ptr + r)
    ls = tl.arange(0, LP)
    hs = tl.arange(0, HP)
    lmask = ls < L
    omask = lmask[:, None] & (hs[None, :] < H)
    rolling = tl.zeros([LP], dtype=tl.int64)
    for k in tl.static_range(N):
        q = p - k
        if k == 0:
            raw = token
        else:
            # the same request's row k back in this step holds position q, else the store has it
            same = (r >= k) & (q >= 0)
            back = tl.maximum(r - k, 0)
            same = same & (tl.load(pos_ptr + back).to(tl.int64) == q) & (tl.load(slot_ptr + back) == slot)
            qc = tl.maximum(q, 0)
            stored = tl.load(store_ptr + tl.load(tab_ptr + r * stride_tab + qc // BS).to(tl.int64) * BS + qc % BS)
            raw = tl.where(same, tl.load(ids_ptr + back).to(tl.int64), stored)
        value = tl.where(q < 0, pad, tl.load(map_ptr + tl.maximum(raw, 0)))
        rolling = rolling ^ (value * tl.load(mult_ptr + ls * N + k, mask=lmask, other=0))
        if k > 0:
            col = (k - 1) * H + hs[None, :]
            prime = tl.load(prime_ptr + (ls[:, None] * (N - 1) + k - 1) * H + hs[None, :], mask=omask, other=1)
            h = rolling[:, None] % prime
            h = tl.where(h < 0, h + prime, h)  # Python's modulo (torch's), not C's
            h = h + tl.load(off_ptr + ls[:, None] * ((N - 1) * H) + col, mask=omask, other=0)
            tl.store(out_ptr + (r * L + ls[:, None]) * ((N - 1) * H) + col, h, mask=omask)


def engram_hash(hasher, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, table: torch.Tensor,
                store: torch.Tensor) -> torch.Tensor:
    """Row ids [R, layers, cols] int64 of every Engram layer for this step's rows.

    ids / positions / slots [R] (slots tell requests apart), table [R, W] int32 block ids
    of the token store ``store`` [blocks, block_size] int64 (written at each row's position)."""
    check_device(ids, store)
    hasher._to(ids.device)
    n_layers, n = hasher.multipliers.shape[0], hasher.max_ngram
    heads = hasher.n_heads
    out = torch.empty(ids.shape[0], n_layers, (n - 1) * heads, dtype=torch.int64, device=ids.device)
    if ids.shape[0]:
        _hash_kernel[(ids.shape[0],)](
            ids, positions, slots, table, store, hasher.token_map, hasher.multipliers.contiguous(),
            hasher.primes.contiguous(), hasher.offsets.contiguous(), out, table.stride(0), store.shape[1],
            hasher.pad_compressed, L=n_layers, N=n, H=heads, LP=next_pow2(n_layers),
            HP=next_pow2(heads), num_warps=1)
    return out


def engram_hash_ref(hasher, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, table: torch.Tensor,
                    store: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`engram_hash`: the store write, its look-back read and
    ``NgramHasher.hash_window``."""
    pos, per = positions.long(), store.shape[1]
    blk = table.long().gather(1, (pos // per)[:, None])[:, 0]
    store[blk, pos % per] = ids.long()
    back = pos[:, None] - torch.arange(hasher.max_ngram, device=pos.device)[None, :]  # [R, N]: p, p-1, ...
    blk = table.long().gather(1, back.clamp(min=0) // per)
    window = torch.where(back >= 0, store[blk, back.clamp(min=0) % per], -1)
    return hasher.hash_window(window, pos)


@triton.jit
def _gate_kernel(s_ptr, kv_ptr, w_ptr, out_ptr, o_ptr, post_ptr, comb_ptr, eps, scale,
                 HC: tl.constexpr, D: tl.constexpr, EXPAND: tl.constexpr, CODE: tl.constexpr,
                 INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, HC)
    d = tl.arange(0, D)
    s = streams_tile(s_ptr, o_ptr, post_ptr, comb_ptr, t, HC, D, EXPAND, CODE, INTERP)  # [HC, D]
    key = tl.load(kv_ptr + t * (HC + 1) * D + ks[:, None] * D + d[None, :]).to(tl.float32)
    value = tl.load(kv_ptr + t * (HC + 1) * D + HC * D + d).to(tl.float32)
    w = tl.load(w_ptr + ks[:, None] * D + d[None, :])
    rstd = tl.rsqrt(tl.sum(s * s, axis=1) / D + eps) * tl.rsqrt(tl.sum(key * key, axis=1) / D + eps)
    dot = tl.sum(s * w * key, axis=1) * rstd * scale
    mag = tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
    gate = 1.0 / (1.0 + tl.exp(-tl.where(dot < 0, -mag, mag)))
    y = round_to(s + gate[:, None] * value[None, :], CODE, INTERP)
    tl.store(out_ptr + (t * HC + ks[:, None]) * D + d[None, :], y.to(out_ptr.dtype.element_ty))


def _gate_weight(engram: torch.nn.Module) -> torch.Tensor:
    """q_weight * k_weight in float32 (only ever used as a product), kept until they change."""
    q, k = engram.q_weight, engram.k_weight
    key = (q.data_ptr(), q._version, k.data_ptr(), k._version)
    hit = engram.__dict__.get("_fast_gate_w")
    if hit is None or hit[0] != key:
        hit = engram.__dict__["_fast_gate_w"] = (key, (q.float() * k.float()).contiguous())
    return hit[1]


def engram_gate(engram: torch.nn.Module, streams: torch.Tensor, kv: torch.Tensor,
                pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """streams [T, hc, D] (bf16/fp32), kv = ``engram.wkv(emb)`` [T, (hc + 1) * D] -> the new
    streams; ``pending`` = (out [T, D], post [T, hc], comb [T, hc, hc]) expands the streams first."""
    check_device(streams, kv)
    t, hc, d = streams.shape
    if hc != next_pow2(hc) or d != next_pow2(d):
        raise ValueError(f"engram_gate: streams {hc} x {d} must be powers of two")
    s = streams.contiguous()
    out = torch.empty_like(s)
    o, post, comb = pending if pending is not None else (s, s, s)
    if t:
        _gate_kernel[(t,)](s, kv.contiguous(), _gate_weight(engram), out, o.contiguous(), post.float().contiguous(),
                           comb.float().contiguous(), float(engram.eps), engram.hidden ** -0.5, HC=hc, D=d,
                           EXPAND=pending is not None, CODE=dtype_code(streams.dtype), INTERP=interpreting(),
                           num_warps=4)
    return out


def engram_gate_ref(engram: torch.nn.Module, streams: torch.Tensor, kv: torch.Tensor,
                    pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Torch reference of :func:`engram_gate`: ``hc_expand`` and ``Engram.gate``."""
    from deepinfer.models.v41.layers import hc_expand

    if pending is not None:
        streams = hc_expand(pending[0], streams, pending[1], pending[2])
    return engram.gate(streams, kv)
