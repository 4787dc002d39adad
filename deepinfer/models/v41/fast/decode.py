"""Batched decode attention of DeepSeek-V4.1 on the fast path: a few rows per request
(a decode token, or a token and its drafts), every request at once, no host read and no
Python loop over requests (CUDA-graph safe).

Mirrors ``Attention41.forward`` (publish + attend) and ``Indexer41.select`` for rows that
continue a request (``seq.length <= MAX_ROWS``, not newly admitted):

* the window KV row (``kv_norm(wkv(x))``, RoPE, FP8 rounding when the checkpoint asks)
  goes into the layer's own window pool (``swa`` or ``dec`` group) at its position;
* a KV source's compressor writes the projections of every row into the request's ring
  (ratio 2) and, for the rows that close a group, the pooled latent's entry (RoPE'd, FP4
  rounded) and its index key (``k_norm(wk(latent))``, RoPE'd) into the shared pools;
* an index source scores every visible entry of its source's index keys (Triton
  ``indexer_scores``), the candidate source publishes its top blocks, later index sources
  score only inside them, and the top-k goes to every later layer of the pass;
* attention is ``decode_attention`` over the window and the selected shared entries.

Every write is idempotent (same inputs, same values), so a step may run twice (the
warm-up before a graph capture); padded graph rows repeat row 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ... import invariant_ops
from ...fast.decode import DecodeMeta, _inv_freq, grouped_out
from ...fast.fused_weights import project
from ...fast.invariant import is_invariant
from ..kv_cache import GROUP_SRC


@dataclass
class RowGroups:
    """Where each row sits in its request's consecutive rows (device tensors [R])."""

    first: torch.Tensor  # bool: the request's first row of this step

    @classmethod
    def of(cls, meta: DecodeMeta) -> "RowGroups":
        n = meta.positions.shape[0]
        if meta.starts is None:
            return cls(torch.ones(n, dtype=torch.bool, device=meta.positions.device))
        # a scatter, not torch.isin (which may sync with the host inside a graph capture);
        # groups past the batch start at row n, the extra slot
        first = torch.zeros(n + 1, dtype=torch.bool, device=meta.positions.device)
        first.index_fill_(0, meta.starts[:-1].long(), True)  # (an index_put of True copies a host scalar)
        return cls(first[:n])


@dataclass
class V41DecodeStep:
    """What every layer of one V4.1 decode pass shares: the step's inputs, the cache, the
    rotary frequencies on the device, and the latest index source's picks."""

    meta: DecodeMeta
    cache: Any
    inv_main: torch.Tensor
    inv_comp: torch.Tensor
    groups: RowGroups
    topk: torch.Tensor | None = None  # [R, index_topk] int32 entry ids (-1 = none)
    candidates: torch.Tensor | None = None  # [R, n_blocks] bool (the candidate source's pick)
    extra: dict = field(default_factory=dict)

    @classmethod
    def start(cls, model: Any, meta: DecodeMeta, cache: Any) -> "V41DecodeStep":
        dev = meta.positions.device
        return cls(meta, cache, _inv_freq(model.rotary_main, dev), _inv_freq(model.rotary_compress, dev),
                   RowGroups.of(meta))


def _float_weight(lin: torch.nn.Module) -> torch.Tensor:
    """A float32 copy of a dense Linear's weight, kept on the module until the weight moves
    (the compressor and router project in float32, as the reference does)."""
    w = lin.weight
    hit = lin.__dict__.get("_fast_w32")
    if hit is None or hit[0] != (w.data_ptr(), w._version):
        hit = lin.__dict__["_fast_w32"] = ((w.data_ptr(), w._version), w.detach().float())
    return hit[1]


def _linear_f32(lin: torch.nn.Module, x: torch.Tensor, ops: Any) -> torch.Tensor:
    if lin.quantized is not None or lin._parameters.get("weight") is None:
        return lin(x).float()  # quantized checkpoint bytes: their own GEMM
    return linear_f32(ops, x, _float_weight(lin))


def linear_f32(ops: Any, x: torch.Tensor, w: torch.Tensor, div: float = 1.0) -> torch.Tensor:
    """Float32 ``x @ w.T / div`` (w float32): the kernel of a few rows / cuBLAS, or in
    batch-invariant mode the mode's fixed-tile GEMM (``linear_f32`` switches kernels at
    16 rows: a row's bits would follow its step's size), as the reference's bi mode."""
    if is_invariant(ops):
        y = invariant_ops.linear(x.float(), w)
        return y if div == 1.0 else y / div
    return ops.linear_f32(x, w, div)


def publish(attn: torch.nn.Module, x: torch.Tensor, step: V41DecodeStep) -> None:
    """A KV source's compressor for this step's rows (``Attention41.publish``): the pooled
    latent's entry and index key are normed, RoPE'd at the group's first position, rounded
    to their cache formats and written by the row closing the group, one launch each."""
    comp, meta, cache, ops, ix = attn.compressor, step.meta, step.cache, step.meta.ops, attn.indexer
    r, pos = comp.ratio, meta.positions.long()
    if r == 1:
        pooled = comp.wkv(x)
    else:
        kv, sc = _linear_f32(comp.wkv, x, ops), _linear_f32(comp.wgate, x, ops)
        ring = cache.ring[attn.layer]  # [slots, L, 2, d] f32: the projections at position % L
        n_ring, slot = ring.shape[1], meta.slots.long()
        # the previous row of the group: this step's previous row, or the ring
        prev = torch.where(step.groups.first[:, None, None], ring[slot, (pos - 1) % n_ring],
                           torch.stack([kv, sc], dim=1).roll(1, dims=0))
        ring[slot, pos % n_ring] = torch.stack([kv, sc], dim=1)
        if r != 2:
            raise NotImplementedError(f"V4.1 fast decode pools ratio 1 or 2, got ratio {r}")
        kv_win = torch.stack([prev[:, 0], kv], dim=1)  # [R, 2, d] positions p - 1, p
        sc_win = torch.stack([prev[:, 1], sc], dim=1)
        pooled = (kv_win * sc_win.softmax(dim=1)).sum(dim=1).to(x.dtype)
    latent = ops.rms_norm(pooled, comp.norm.weight, comp.norm.eps)
    table, inv = meta.tables32[GROUP_SRC], step.inv_comp
    ops.norm_rope(ix.wk(latent), pos, inv, "weighted", ix.k_norm.weight, ix.k_norm.eps, pool=cache.src_index[attn.layer],
                  table=table, ratio=r, quant="fp4" if ix.sim else "none", quant_block=32)
    ops.norm_rope(latent, pos, inv, "none", pool=cache.src_kv[attn.layer], table=table, ratio=r,
                  quant="fp4_e4m3" if attn.sim else "none", quant_block=16)


def select(attn: torch.nn.Module, x_weights: torch.Tensor, iq_raw: torch.Tensor, step: V41DecodeStep,
           n_cols: int) -> torch.Tensor:
    """An index source's top-k entry ids [R, index_topk] int32 (-1 = none), ``Indexer41.select``."""
    ix, meta = attn.indexer, step.meta
    pos = meta.positions
    q = meta.ops.norm_rope(iq_raw.reshape(iq_raw.shape[0], ix.n_heads, ix.dim), pos, step.inv_comp,
                           quant="fp4" if ix.sim else "none", quant_block=32)
    src = attn.kv_source
    scores = meta.ops.indexer_scores(q, x_weights, pos, step.cache.src_index[src], meta.tables32[GROUP_SRC],
                                     ix.ratio, n_cols, weight_scale=ix.n_heads ** -0.5)
    if ix.is_candidate_source:
        # the reference's level one (graph-safe); padded columns past a row's entries are
        # -inf, so their blocks are never kept, as in the reference
        step.candidates = ix._candidate_blocks(scores, (pos.long() + 1) // ix.ratio)
    elif ix.uses_candidates and step.candidates is not None:
        allowed = step.candidates.repeat_interleave(ix.cand_block, dim=1)[:, :n_cols]
        scores = scores.masked_fill(~allowed, float("-inf"))
    from deepinfer_kernels.indexer_topk import select_topk  # lazily, as kernel_ops imports the kernels

    return select_topk(scores, ix.topk)


def attention_decode_v41(attn: torch.nn.Module, x: torch.Tensor, step: V41DecodeStep) -> torch.Tensor:
    """``Attention41.forward`` for decode-like rows: x [R, hidden] (normed) -> [R, hidden]."""
    meta, cache = step.meta, step.cache
    ops, pos, n = meta.ops, meta.positions, x.shape[0]
    comp, ix = attn.compressor, attn.indexer
    x_side = [attn.wq_a, attn.wkv] + ([ix.weights_proj] if ix is not None else [])
    proj = project(attn, "x41", x_side, x)
    if comp is not None:
        publish(attn, x, step)
    q_res = ops.rms_norm(proj[0], attn.q_norm.weight, attn.q_norm.eps)
    q_side = project(attn, "q41", [attn.wq_b] + ([ix.wq_b] if ix is not None else []), q_res)
    inv = step.inv_comp if attn.ratio else step.inv_main
    q = ops.norm_rope(q_side[0].view(n, attn.n_heads, attn.head_dim), pos, inv, "none")
    pool, group = cache.window(attn.layer)
    table = meta.tables32[group]
    ops.norm_rope(proj[1], pos, inv, "weighted", attn.kv_norm.weight, attn.kv_norm.eps, pool=pool, table=table,
                  quant="fp8" if attn.sim else "none", quant_block=32)  # FP8 window KV: rounded as stored
    comp_pool = comp_table = None
    max_keys = attn.window
    if attn.ratio:
        n_cols = meta.width * cache.block_size // attn.ratio
        if ix is not None:
            step.topk = select(attn, proj[2], q_side[1], step, n_cols)
        comp_pool, comp_table = cache.src_kv[attn.kv_source], meta.tables32[GROUP_SRC]
        max_keys += step.topk.shape[1]
    o = ops.decode_attention(q, pos, pool, table, attn.window, attn.attn_sink, comp_pool, comp_table,
                             attn.ratio if comp_pool is not None else 0, step.topk if attn.ratio else None,
                             max_keys=max_keys, rope_inv_freq=inv)
    return attn.wo_b(grouped_out(attn.wo_a, o.view(n, attn.cfg.o_groups, -1), ops))


def engram_hash_rows(model: Any, input_ids: torch.Tensor, step: V41DecodeStep) -> torch.Tensor:
    """Hash rows [R, engram layers, cols] of this step's rows (one launch): each row's token
    goes into the paged token store, its look-back is read back (``_engram_rows``)."""
    meta = step.meta
    return meta.ops.engram_hash(model.hasher, input_ids, meta.positions, meta.slots, meta.tables32["swa"],
                                step.cache.tokens)
