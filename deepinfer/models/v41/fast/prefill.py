"""DeepSeek-V4.1 prefill / mixed steps (prompt chunks and decode rows in one step) on the
compiled executor: ``DeepseekV41Model.forward`` over the flattened batch, every layer
batched over every request (prefill_attention.py), with the decode path's kernels
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
auto / triton / ref / 0; auto: bf16 / fp16 on CUDA).

Batch-invariant mode (the executor's ops from ``invariant.invariant_ops``): every row runs
the decode step's per-row pieces (``decode_attention`` over its own block tables with the
split merge, the same indexer scores + stable top-k, float32 projections through the
mode's fixed-tile GEMM) and the rows that sample take the decode step's head
(:meth:`PrefillPathV41.invariant_logits`), so a token has the same bits in a prefill,
mixed or decode step of any size; under bounded replay the decoder layers' window keys
below the cut are masked by ``decode_attention``'s per-row floor.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from deepinfer import envs

from ...bounded_replay import batch_cuts
from ...fast.forward import head_logits
from ...fast.moe import moe_forward
from ...fast.moe import supported as moe_supported
from ...fast.prefill import select_prefill_ops
from ...fast.prefill_meta import PrefillMeta, build_prefill_meta
from ...moe import MoE
from ...paged_batch import ForwardBatch, SeqMeta
from ..kv_cache import GROUP_SWA
from ..layers import hc_expand
from .forward import _first_pre, _route_logits, _site
from .prefill_attention import V41PrefillStep, attend_prefill, attention_prefill_v41, publish_prefill


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
        ops = select_prefill_ops(cls, model, cache)
        return None if ops is None else cls(model, cache, ops)

    def prepare(self, batch: ForwardBatch) -> PrefillMeta | None:
        """Metadata of a prefill / mixed step, or None when this path does not run it (EP
        or load-counting MoE layers)."""
        if not batch.seqs or not all(isinstance(layer.ffn, MoE) and moe_supported(layer.ffn)
                                     for layer in self.model.layers):
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
        done = self._layers(batch, meta)
        if done is None:  # every row lay before its cut
            n = batch.num_tokens if rows is None else rows.shape[0]
            return torch.full((n, self.model.cfg.hidden_size), float("nan"), dtype=self.model.dtype,
                              device=batch.input_ids.device)
        streams, pre, prev, kept = done
        pick, dropped = self._pick(kept, batch.num_tokens, rows)
        streams, pre, prev = self._at(pick, streams, pre, prev)
        hidden = self.ops.hc_collapse_norm(streams, pre, None, prev)
        return hidden if dropped is None else hidden.masked_fill(dropped[:, None], float("nan"))

    @torch.no_grad()
    def invariant_logits(self, batch: ForwardBatch, meta: PrefillMeta, rows: torch.Tensor) -> torch.Tensor:
        """Float32 logits [R, V] of ``rows`` in batch-invariant mode: the decode step's head
        (the last expansion, collapse and final norm in one ``hc_collapse_norm``, then
        ``head_logits``), so a row has the bits it would get in a decode step."""
        model = self.model
        done = self._layers(batch, meta)
        if rows.numel() == 0 or done is None:  # prompt chunks only: the layers wrote the cache
            return torch.full((rows.numel(), model.cfg.vocab_size), float("nan") if rows.numel() else 0.0,
                              dtype=torch.float32, device=batch.input_ids.device)
        streams, pre, prev, kept = done
        pick, dropped = self._pick(kept, batch.num_tokens, rows)
        streams, pre, prev = self._at(pick, streams, pre, prev)
        logits = head_logits(model, self.ops, self.ops.hc_collapse_norm(streams, pre, (model.norm.weight,
                                                                                       model.norm.eps), prev))
        return logits if dropped is None else logits.masked_fill(dropped[:, None], float("nan"))

    @staticmethod
    def _at(pick: torch.Tensor | None, streams: torch.Tensor, pre: torch.Tensor, prev: tuple) -> tuple:
        """(streams, pre, pending expansion) of the rows ``pick`` (all when None)."""
        if pick is None:
            return streams, pre, prev
        return streams[pick], pre[pick], tuple(t[pick] for t in prev)

    @staticmethod
    def _pick(kept: torch.Tensor | None, num_tokens: int, rows: torch.Tensor | None
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(indices into the layers' last rows of the batch rows ``rows`` (None: every row),
        the rows a compact replay dropped among them (None: none))."""
        if kept is None:
            return rows, None
        local = torch.full((num_tokens,), -1, dtype=torch.long, device=kept.device)
        local[kept] = torch.arange(kept.numel(), device=kept.device)
        want = local if rows is None else local[rows]
        return want.clamp(min=0), want < 0

    @torch.no_grad()
    def spec_forward(self, batch: ForwardBatch, layers: tuple[int, ...], invariant: bool) -> tuple | None:
        """A speculative step's prompt / mixed chunk (models/fast/verify_graphs.py's ``SpecForward``):
        (the collapsed final hidden [T, hidden] of every row, what V4.1's forward returns and
        its drafter reads; the inputs of ``layers`` [T, N, D] as ``DeepseekV41Model.forward``
        captures them; rows -> float32 logits, in batch-invariant mode from the decode
        step's head), or None when this path does not run the step."""
        meta = self.prepare(batch)
        if meta is None:
            return None
        model, n = self.model, batch.num_tokens
        capture = dict.fromkeys(layers) if layers else None
        done = self._layers(batch, meta, capture)
        if done is None:  # every row lay before its cut: no hidden state (the reference's NaN)
            hidden = torch.full((n, model.cfg.hidden_size), float("nan"), dtype=model.dtype,
                                device=batch.input_ids.device)
            return hidden, capture or {}, lambda rows: model.compute_logits(hidden[rows])
        streams, pre, prev, kept = done
        hidden = self.ops.hc_collapse_norm(streams, pre, None, prev)
        if kept is not None:
            hidden = _full_rows(hidden, kept, n)
        if invariant:
            def logits(rows: torch.Tensor) -> torch.Tensor:
                pick, dropped = self._pick(kept, n, rows)
                s, p, pv = self._at(pick, streams, pre, prev)
                out = head_logits(model, self.ops, self.ops.hc_collapse_norm(s, p, (model.norm.weight,
                                                                                    model.norm.eps), pv))
                return out if dropped is None else out.masked_fill(dropped[:, None], float("nan"))
        else:
            def logits(rows: torch.Tensor) -> torch.Tensor:
                return model.compute_logits(hidden[rows])
        return hidden, capture or {}, logits

    def _layers(self, batch: ForwardBatch, meta: PrefillMeta, capture: dict | None = None) -> tuple | None:
        """Every layer over the step: (streams, the head's pre, the last MoE's pending
        expansion (out, post, comb), the kept rows of a compact replay or None), or None
        when a compact replay kept no row (the last KV source has published). ``capture``:
        for every layer id among its keys, that layer's input streams [T, N, D] (before its
        Engram; NaN on rows a compact replay dropped), as ``DeepseekV41Model.forward``."""
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
            if capture is not None and i in capture:  # the layer's input: the pending expansion first
                if prev is not None:
                    streams, prev = hc_expand(prev[0], streams, prev[1], prev[2]), None
                capture[i] = streams if kept is None else _full_rows(streams, kept, batch.num_tokens)
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
                    for j in capture or ():
                        if j > i:  # inputs of the decoder layers these rows skip
                            capture[j] = torch.full_like(streams, float("nan"))
                    return None
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
        return streams, pre, prev, kept

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


def _full_rows(t: torch.Tensor, kept: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Rows of a compact replay's kept subset back at their batch rows (NaN elsewhere)."""
    full = t.new_full((num_tokens, *t.shape[1:]), float("nan"))
    full[kept] = t
    return full
