"""DeepSeek-V4.1 prefill / mixed steps (prompt chunks and decode rows in one step) on the
compiled executor: ``DeepseekV41Model.forward`` over the flattened batch, every layer
batched over every request (v41_prefill_attention.py), with the decode path's kernels
for what is per row (shifted mHC ``hc_shifted``, Engram hashing and gate, float32
router logits, fused MoE, ``hc_collapse_norm``) and V4's ``prefill_attention`` kernel.

SWA bounded replay (bounded_replay.py), as the reference runs it:

* ``off``: every row runs every layer;
* ``mask``: every row runs every layer; the decoder layers' window attention starts at
  the request's cut (the kernel's per-request ``floor``);
* ``compact``: the replay-start layer (the last KV source) publishes the shared KV of
  every row, then only each request's rows at positions >= its cut go on through the
  decoder layers (a sub-step of their own), with the same narrowed windows. Rows a
  compact replay dropped have no hidden state (NaN, as the reference returns).

Selection (``PrefillPathV41.create``): as V4's ``PrefillPath`` (``DEEPINFER_FAST_PREFILL``
auto / triton / ref / 0; auto: bf16 / fp16 on CUDA). Batch-invariant mode keeps these
steps on the reference path for now (:meth:`PrefillPathV41.prepare` returns None).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from deepinfer import envs

from ..bounded_replay import batch_cuts
from ..kv_cache import ForwardBatch, SeqMeta
from ..kv_cache_v41 import GROUP_SWA
from ..moe import MoE
from .invariant import is_invariant
from .moe import moe_forward
from .moe import supported as moe_supported
from .prefill import prefill_ops
from .prefill_meta import PrefillMeta, build_prefill_meta
from .v41_forward import _first_pre, _route_logits, _site
from .v41_prefill_attention import V41PrefillStep, attend_prefill, attention_prefill_v41, publish_prefill


class PrefillPathV41:
    """Runs V4.1 prefill / mixed steps of one model replica on the compiled executor."""

    unavailable: str | None = None  # why the kernels did not import, if they did not
    #: the runner may send steps under an active bounded replay (mask / compact) here
    bounded_replay = True

    def __init__(self, model: Any, cache: Any, ops: Any) -> None:
        self.model, self.cache, self.ops = model, cache, ops
        self.groups = list(cache.num_blocks)  # swa / dec / src
        self.stats = {"prefill_steps": 0, "prefill_rows": 0, "replayed_rows": 0}

    @classmethod
    def create(cls, model: Any, cache: Any) -> "PrefillPathV41 | None":
        mode = envs.DEEPINFER_FAST_PREFILL
        if mode == "0":
            return None
        n = model.cfg.hc_mult
        if n < 4 or n & (n - 1):  # the fused mHC kernels hold N x N in registers
            cls.unavailable = f"hc_mult={n} (fused mHC needs a power of two >= 4)"
            return None
        if mode in ("triton", "ref"):
            return cls(model, cache, prefill_ops(mode))
        fastpath = envs.DEEPINFER_FASTPATH
        if cache.swa[0].device.type != "cuda" or fastpath in ("0", "off", "false", "no", "ref"):
            return None
        if fastpath != "1" and getattr(model, "dtype", None) not in (torch.bfloat16, torch.float16):
            return None
        try:
            ops = prefill_ops("triton")
        except Exception as exc:  # no triton / kernels: reference path
            cls.unavailable = repr(exc)
            return None
        return cls(model, cache, ops)

    def prepare(self, batch: ForwardBatch) -> PrefillMeta | None:
        """Metadata of a prefill / mixed step, or None when this path does not run it
        (batch-invariant mode, EP or load-counting MoE layers)."""
        if not batch.seqs or is_invariant(self.ops) or not all(
                isinstance(layer.ffn, MoE) and moe_supported(layer.ffn) for layer in self.model.layers):
            return None
        meta = self._meta(batch.seqs, batch.positions)
        self.stats["prefill_steps"] += 1
        self.stats["prefill_rows"] += batch.num_tokens
        return meta

    def _meta(self, seqs: list[SeqMeta], positions: torch.Tensor) -> PrefillMeta:
        return build_prefill_meta(seqs, positions, self.groups, self.cache.block_size, self.ops)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, meta: PrefillMeta, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The collapsed final hidden [T, hidden] of every row (``DeepseekV41Model.forward``'s
        contract: NaN on rows a compact replay dropped), or of ``rows`` only [R, hidden]."""
        model, cache, ops, cfg = self.model, self.cache, self.ops, self.model.cfg
        iters, hc_eps, eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        ids = batch.input_ids
        step = V41PrefillStep.start(model, meta, cache)
        streams = model.embed(ids).unsqueeze(1).expand(-1, cfg.hc_mult, -1)
        pre = _first_pre(streams)
        hash_rows = None
        if model.hasher is not None:  # every row's token into the paged store, its look-back read
            hash_rows = ops.engram_hash(model.hasher, ids, meta.positions, step.slots, meta.row_tables(GROUP_SWA),
                                        cache.tokens)
        cuts = batch_cuts(batch)
        replay = getattr(batch, "replay", None)
        start, kept = cfg.replay_start_layer, None  # kept: the rows a compact replay keeps
        prev = None  # (sublayer output, post, comb) whose expansion is still to apply
        for i, layer in enumerate(model.layers):
            if layer.engram_index is not None:  # the pending expansion inside the gate's launch
                kv = layer.engram.project(hash_rows[:, layer.engram_index])
                streams, prev = ops.engram_gate(layer.engram, streams, kv, prev), None
            new, a_pre, a_post, a_comb, x = ops.hc_shifted(streams, *_site(layer, "attn"), iters, hc_eps, eps, pre,
                                                           (layer.attn_norm.weight, layer.attn_norm.eps), prev)
            streams = streams if new is None else new
            if i == start:  # entering the decoder layers (bounded replay): see the module doc
                if layer.attn.compressor is not None:  # the last KV source publishes for every row
                    publish_prefill(layer.attn, x, step)
                narrow = replay is not None and replay.active
                if narrow and replay.mode == "compact":
                    kept, sub = self._kept(batch, cuts)
                if kept is not None and not kept.numel():  # every row lies before its cut
                    full = torch.full((batch.num_tokens, cfg.hidden_size), float("nan"), dtype=streams.dtype,
                                      device=streams.device)
                    return full if rows is None else full[rows]
                if kept is not None:
                    floor = [c for s, c in zip(batch.seqs, cuts) if s.start + s.length > c]
                    step = V41PrefillStep.start(model, self._meta(sub, meta.positions[kept]), cache, floor)
                    streams, a_pre, a_post, a_comb, x = (t[kept] for t in (streams, a_pre, a_post, a_comb, x))
                    ids = ids[kept]
                    if hash_rows is not None:
                        hash_rows = hash_rows[kept]
                    self.stats["replayed_rows"] += int(kept.numel())
                else:  # the reference's fresh pass context: no picks carried into the decoder layers
                    step = V41PrefillStep.start(model, meta, cache, cuts if narrow else None)
                out = attend_prefill(layer.attn, x, step)
            else:
                out = attention_prefill_v41(layer.attn, x, step)
            streams, pre, f_post, f_comb, x = ops.hc_shifted(streams, *_site(layer, "ffn"), iters, hc_eps, eps,
                                                             a_pre, (layer.ffn_norm.weight, layer.ffn_norm.eps),
                                                             (out, a_post, a_comb))
            ffn = layer.ffn
            prev = (moe_forward(ffn, x, ids, ops, logits=_route_logits(ffn.gate, x, ops)), f_post, f_comb)
        return self._hidden(streams, pre, prev, kept, batch.num_tokens, rows)

    def _kept(self, batch: ForwardBatch, cuts: list[int]) -> tuple[torch.Tensor | None, list[SeqMeta]]:
        """(flattened rows at positions >= their cut or None when every row is kept, the
        sub-step's sequences: the requests with kept rows, in order, offsets in the kept rows)."""
        if not any(c > s.start for c, s in zip(cuts, batch.seqs)):
            return None, batch.seqs
        parts, seqs, offset = [], [], 0
        for seq, cut in zip(batch.seqs, cuts):
            s, e = max(seq.start, cut), seq.start + seq.length
            if e <= s:
                continue
            parts.append(np.arange(seq.offset + s - seq.start, seq.offset + seq.length))
            seqs.append(SeqMeta(s, e - s, offset, seq.block_table, seq.slot, False, getattr(seq, "prompt_len", 0)))
            offset += e - s
        rows = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return torch.from_numpy(rows.astype(np.int64)).to(batch.input_ids.device), seqs

    def _hidden(self, streams: torch.Tensor, pre: torch.Tensor, prev: tuple, kept: torch.Tensor | None,
                num_tokens: int, rows: torch.Tensor | None) -> torch.Tensor:
        """The last expansion + the final collapse of ``rows`` (every row when None), NaN on
        rows a compact replay dropped."""
        out, post, comb = prev
        if kept is None:
            if rows is not None:
                streams, pre, out, post, comb = (t[rows] for t in (streams, pre, out, post, comb))
            return self.ops.hc_collapse_norm(streams, pre, None, (out, post, comb))
        local = torch.full((num_tokens,), -1, dtype=torch.long, device=kept.device)
        local[kept] = torch.arange(kept.numel(), device=kept.device)
        want = local if rows is None else local[rows]
        pick = want.clamp(min=0)
        hidden = self.ops.hc_collapse_norm(streams[pick], pre[pick], None, (out[pick], post[pick], comb[pick]))
        return hidden.masked_fill((want < 0)[:, None], float("nan"))
