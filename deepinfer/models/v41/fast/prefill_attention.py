"""Batched attention of DeepSeek-V4.1 for a prefill / mixed step on the compiled executor:
``Attention41.publish`` + ``Attention41.attend`` for every request of the step at once (no
Python loop over requests or rows in the layer).

Per layer, as the reference does per request:

* a KV source's compressor (:func:`publish_prefill`) over every row: ratio 1 projects
  each token, ratio 2 pools each aligned pair (the previous row of the pair is the
  step's previous row, or the request's ring when the chunk starts mid-pair), then
  ``norm`` and the shared entry / index key written by the row closing its group (FP4
  rounded when the checkpoint asks), one ``norm_rope`` launch each; the ring keeps the
  projections of each request's last ``ring_len`` positions;
* the window KV row of every row into the layer's own window pool (``swa`` or ``dec``);
* an index source scores the visible index keys of every row (``indexer_scores``, in
  row tiles to bound the [rows, entries] buffer), the candidate source keeps its top
  blocks, later index sources score only inside them, and the stable top-k goes to the
  later layers of the pass (:class:`V41PrefillStep`);
* ``prefill_attention`` over each row's window (from the request's replay ``floor`` in
  the decoder layers under bounded replay) and its selected shared entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.engine.transfer import aligned_starts

from ...fast.decode import _inv_freq, grouped_out
from ...fast.fused_weights import project
from ...fast.invariant import is_invariant
from ...fast.prefill_meta import PrefillMeta
from ..kv_cache import GROUP_SRC
from .decode import _linear_f32

#: Query rows whose indexer scores are materialised at once ([rows, entries] float32 and
#: the sort's copies): 4096 rows x 8192 entries = 128 MiB per buffer.
INDEX_ROWS = 4096
#: Heads x rows of one attention program (as V4's prefill: models/v4/fast/prefill_attention.py).
ATTN_HEADS, ATTN_ROWS = 64, 32


@dataclass
class V41PrefillStep:
    """What the layers of one pass over a prefill / mixed step share: the step's metadata,
    per-row request facts (device tensors [T]), the rotary frequencies, the replay floor
    of each request (None outside the decoder pass of a bounded replay) and the latest
    index source's picks."""

    meta: PrefillMeta
    cache: Any
    slots: torch.Tensor  # [T] int64 state slot of each row's request
    first: torch.Tensor  # [T] bool: the request's first row in this step
    ends: torch.Tensor  # [T] int64: the request's chunk end (its last position + 1)
    inv_main: torch.Tensor
    inv_comp: torch.Tensor
    floor: torch.Tensor | None = None  # [R] int32 per request: the lowest visible window key
    topk: torch.Tensor | None = None  # [T, index_topk] int32 entry ids (-1 = none)
    candidates: torch.Tensor | None = None  # [T, n_blocks] bool (the candidate source's pick)

    @classmethod
    def start(cls, model: Any, meta: PrefillMeta, cache: Any, floor: list[int] | None = None) -> "V41PrefillStep":
        dev = meta.device
        lens = [s.length for s in meta.seqs]
        rep = torch.tensor(lens, dtype=torch.long)
        slots = torch.repeat_interleave(torch.tensor([s.slot for s in meta.seqs], dtype=torch.long), rep)
        ends = torch.repeat_interleave(torch.tensor([s.start + s.length for s in meta.seqs], dtype=torch.long), rep)
        first = torch.zeros(int(rep.sum()), dtype=torch.bool)
        first[torch.tensor([s.offset for s in meta.seqs], dtype=torch.long)] = True
        n = first.shape[0]
        starts, total = aligned_starts([n, n, n])  # one host -> device copy, each view 16-byte aligned
        flat = torch.zeros(total, dtype=torch.long)
        for part, at in zip((slots, ends, first.long()), starts):
            flat[at:at + n] = part
        host = flat.to(dev)
        at_slots, at_ends, at_first = starts
        fl = torch.tensor(floor, dtype=torch.int32).to(dev) if floor is not None else None
        return cls(meta, cache, slots=host[at_slots:at_slots + n], first=host[at_first:at_first + n].bool(),
                   ends=host[at_ends:at_ends + n],
                   inv_main=_inv_freq(model.rotary_main, dev), inv_comp=_inv_freq(model.rotary_compress, dev), floor=fl)


def publish_prefill(attn: torch.nn.Module, x: torch.Tensor, step: V41PrefillStep) -> None:
    """A KV source's compressor over every row of the step (``Attention41.publish``)."""
    comp, meta, cache, ops, ix = attn.compressor, step.meta, step.cache, step.meta.ops, attn.indexer
    r, pos = comp.ratio, meta.positions
    if r == 1:
        pooled = comp.wkv(x)
    elif r == 2:
        kv, sc = _linear_f32(comp.wkv, x, ops), _linear_f32(comp.wgate, x, ops)
        ring = cache.ring[attn.layer]  # [slots, L, 2, d] float32: the projections at position % L
        n_ring = ring.shape[1]
        both = torch.stack([kv, sc], dim=1)
        # the pair's first row: this step's previous row, or (a chunk starting mid-pair) the ring
        prev = torch.where(step.first[:, None, None], ring[step.slots, (pos - 1) % n_ring], both.roll(1, dims=0))
        keep = torch.nonzero(pos >= step.ends - n_ring).squeeze(1)  # each request's last n_ring positions
        ring[step.slots[keep], pos[keep] % n_ring] = both[keep]
        kv_win = torch.stack([prev[:, 0], kv], dim=1)  # [T, 2, d]: positions p - 1, p
        sc_win = torch.stack([prev[:, 1], sc], dim=1)
        pooled = (kv_win * sc_win.softmax(dim=1)).sum(dim=1).to(x.dtype)  # used by the rows closing a pair
    else:
        raise NotImplementedError(f"V4.1 compressors pool ratio 1 or 2, got ratio {r} (layer {attn.layer})")
    latent = ops.rms_norm(pooled, comp.norm.weight, comp.norm.eps)
    table, inv = meta.row_tables(GROUP_SRC), step.inv_comp
    ops.norm_rope(ix.wk(latent), pos, inv, "weighted", ix.k_norm.weight, ix.k_norm.eps,
                  pool=cache.src_index[attn.layer], table=table, ratio=r, quant="fp4" if ix.sim else "none",
                  quant_block=32)
    ops.norm_rope(latent, pos, inv, "none", pool=cache.src_kv[attn.layer], table=table, ratio=r,
                  quant="fp4_e4m3" if attn.sim else "none", quant_block=16)


def select_prefill(attn: torch.nn.Module, x_weights: torch.Tensor, iq_raw: torch.Tensor,
                   step: V41PrefillStep) -> torch.Tensor:
    """An index source's top-k entry ids [T, index_topk] int32 (-1 = none), ``Indexer41.select``."""
    from deepinfer_kernels.indexer_topk import select_topk  # lazily, as kernel_ops imports the kernels

    ix, meta = attn.indexer, step.meta
    pos, ops = meta.positions, meta.ops
    q = ops.norm_rope(iq_raw.reshape(iq_raw.shape[0], ix.n_heads, ix.dim), pos, step.inv_comp,
                      quant="fp4" if ix.sim else "none", quant_block=32)
    n_cols = max(1, meta.n_entries_max(ix.ratio))
    pool, table = step.cache.src_index[attn.kv_source], meta.row_tables(GROUP_SRC)
    tops, cands = [], []
    for a in range(0, q.shape[0], INDEX_ROWS):
        b = min(a + INDEX_ROWS, q.shape[0])
        scores = ops.indexer_scores(q[a:b], x_weights[a:b], pos[a:b], pool, table[a:b], ix.ratio, n_cols,
                                    weight_scale=ix.n_heads ** -0.5)
        if ix.is_candidate_source:  # level one; columns past a row's entries are -inf, never kept
            cands.append(ix._candidate_blocks(scores, (pos[a:b] + 1) // ix.ratio))
        elif ix.uses_candidates and step.candidates is not None:
            allowed = step.candidates[a:b].repeat_interleave(ix.cand_block, dim=1)[:, :n_cols]
            scores = scores.masked_fill(~allowed, float("-inf"))
        tops.append(select_topk(scores, ix.topk))
    if ix.is_candidate_source:
        step.candidates = torch.cat(cands)
    return torch.cat(tops)


def attend_prefill(attn: torch.nn.Module, x: torch.Tensor, step: V41PrefillStep) -> torch.Tensor:
    """``Attention41.attend`` for every row of the step: x [T, hidden] (normed) -> [T, hidden]."""
    meta, cache, ops, pos, n = step.meta, step.cache, step.meta.ops, step.meta.positions, x.shape[0]
    ix = attn.indexer
    proj = project(attn, "x41", [attn.wq_a, attn.wkv] + ([ix.weights_proj] if ix is not None else []), x)
    q_res = ops.rms_norm(proj[0], attn.q_norm.weight, attn.q_norm.eps)
    q_side = project(attn, "q41", [attn.wq_b] + ([ix.wq_b] if ix is not None else []), q_res)
    inv = step.inv_comp if attn.ratio else step.inv_main
    q = ops.norm_rope(q_side[0].view(n, attn.n_heads, attn.head_dim), pos, inv, "none")
    pool, group = cache.window(attn.layer)
    ops.norm_rope(proj[1], pos, inv, "weighted", attn.kv_norm.weight, attn.kv_norm.eps, pool=pool,
                  table=meta.row_tables(group), quant="fp8" if attn.sim else "none", quant_block=32)
    extra: dict = {}
    block_h = max(16, min(ATTN_HEADS, 1 << (attn.n_heads - 1).bit_length()))
    block_t = max(1, ATTN_ROWS // block_h)
    if attn.ratio:
        if ix is not None:
            step.topk = select_prefill(attn, proj[2], q_side[1], step)
        extra = dict(comp_pool=cache.src_kv[attn.kv_source], comp_table=meta.tables32[GROUP_SRC], ratio=attn.ratio,
                     topk_idx=step.topk)
        block_t = 1  # every row has its own entry list: one row per program
    floor = step.floor if attn.is_decoder else None
    if is_invariant(ops):  # a decode row's attention (the mode's split merge), per row
        comp_pool = extra.get("comp_pool")
        o = ops.decode_attention(q, pos, pool, meta.row_tables(group), attn.window, attn.attn_sink, comp_pool,
                                 meta.row_tables(GROUP_SRC) if comp_pool is not None else None,
                                 attn.ratio if comp_pool is not None else 0, step.topk if attn.ratio else None,
                                 max_keys=attn.window + (step.topk.shape[1] if attn.ratio else 0),
                                 rope_inv_freq=inv, floor=floor[meta.row_req.long()] if floor is not None else None)
        return attn.wo_b(grouped_out(attn.wo_a, o.view(n, attn.cfg.o_groups, -1), ops))
    o = ops.prefill_attention(q, pos, meta.row_req, pool, meta.tables32[group], attn.window, attn.attn_sink,
                              **extra, tiles=meta.tiles(block_t) if block_t > 1 else None, block_t=block_t,
                              block_h=block_h, block_n=64 if block_h >= 64 else 32, floor=floor)
    o = ops.norm_rope(o, pos, inv, "none", inverse=True, out_dtype=x.dtype)
    return attn.wo_b(grouped_out(attn.wo_a, o.view(n, attn.cfg.o_groups, -1), ops))


def attention_prefill_v41(attn: torch.nn.Module, x: torch.Tensor, step: V41PrefillStep) -> torch.Tensor:
    """``Attention41.forward`` over every row of the step: a KV source publishes, then attends."""
    if attn.compressor is not None:
        publish_prefill(attn, x, step)
    return attend_prefill(attn, x, step)
