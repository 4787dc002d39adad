"""DeepSeek-V4's fast path of prefill / mixed steps (every step that is not pure decode): the whole model
over the flattened batch with batched attention, compressors and indexer
(:mod:`prefill_attention`), fused mHC and fused MoE, on the Triton kernels of
``deepinfer_kernels`` (or their torch references).

Selection (``PrefillPath.create``): a plain ``DeepseekV4Model`` (V4.1 has its own path,
models/v41/fast/prefill.py) with the ops ``select_prefill_ops`` picks (models/fast/prefill.py:
``DEEPINFER_FAST_PREFILL``, ``DEEPINFER_FASTPATH``, the cache's device, the model's dtype).

The runner asks :meth:`PrefillPath.prepare` for a step's metadata (None when the path
does not apply: pure-decode steps go to the decode fast path, EP or load-counting MoE
layers stay on the reference path) and runs :meth:`PrefillPath.forward`, which returns the
final streams like ``DeepseekV4Model.forward``.
"""

from __future__ import annotations

from typing import Any

import torch

from ...fast.forward import run_layers
from ...fast.moe import supported as moe_supported
from ...fast.prefill import select_prefill_ops
from ...fast.prefill_meta import PrefillMeta, build_prefill_meta
from ...fast.verify_graphs import SpecForward
from ...mhc import hc_post
from ...moe import MoE
from ...paged_batch import ForwardBatch
from ..kv_cache import KVCache
from .prefill_attention import attention_prefill
from .verify_prefill import SpecPrefill


class PrefillPath:
    """Runs prefill / mixed steps of one model replica on the fast path."""

    unavailable: str | None = None  # why the kernels did not import, if they did not

    def __init__(self, model: Any, cache: KVCache, ops: Any) -> None:
        self.model, self.cache, self.ops = model, cache, ops
        self.groups = [g for g in ("swa", "csa", "hca") if g in cache.num_blocks]
        self.stats = {"prefill_steps": 0, "prefill_rows": 0}
        self.spec = SpecPrefill(self)  # speculative steps on this path (spec_forward)

    @classmethod
    def create(cls, model: Any, cache: KVCache) -> PrefillPath | None:
        from ..model import DeepseekV4Model

        if type(model) is not DeepseekV4Model:  # V4.1 has its own (v41/fast/prefill.py)
            return None
        ops = select_prefill_ops(cls, model, cache)
        return None if ops is None else cls(model, cache, ops)

    def prepare(self, batch: ForwardBatch) -> PrefillMeta | None:
        """Metadata of a prefill / mixed step, or None when this path does not run it."""
        if not batch.seqs or not all(isinstance(layer.ffn, MoE) and moe_supported(layer.ffn)
                                     for layer in self.model.layers):
            return None
        meta = build_prefill_meta(batch.seqs, batch.positions, self.groups, self.cache.block_size, self.ops)
        self.stats["prefill_steps"] += 1
        self.stats["prefill_rows"] += batch.num_tokens
        return meta

    def invariant_logits(self, batch: ForwardBatch, meta: PrefillMeta, rows: torch.Tensor) -> torch.Tensor:
        """Float32 logits [R, V] of ``rows`` in batch-invariant mode: the decode step's head
        for those rows (v4/fast/invariant_prefill.py)."""
        from .invariant_prefill import prefill_logits

        return prefill_logits(self.model, self.cache, batch.input_ids, meta, rows)

    def spec_forward(self, batch: ForwardBatch, layers: tuple[int, ...], invariant: bool) -> SpecForward | None:
        """A speculative step's prompt / mixed chunk, or any speculative step in batch-invariant
        mode (v4/fast/verify_prefill.py), with the drafter's ``layers`` captured; None when this
        path does not run it (the reference path does). A bounded-replay batch is left to the
        reference path: this path computes every row (the engine admits no replay for V4)."""
        if batch.replay is not None:
            return None
        return self.spec.forward(batch, layers, invariant)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, meta: PrefillMeta, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final streams [T, N, D] of every row (``DeepseekV4Model.forward``'s contract), or
        of ``rows`` only [R, N, D] (the rows that sample: the last ``hc_post`` over every row
        of an 8k-token prefill is milliseconds on an H200, for one row that needs logits;
        docs/measurements.md)."""
        model = self.model
        streams, prev = run_layers(model, batch.input_ids, self.ops, lambda attn, x: attention_prefill(
            attn, x, meta, self.cache, model.rotary_main, model.rotary_compress))
        out, post, comb = prev
        if rows is not None:
            out, streams, post, comb = out[rows], streams[rows], post[rows], comb[rows]
        return hc_post(out, streams, post, comb)
