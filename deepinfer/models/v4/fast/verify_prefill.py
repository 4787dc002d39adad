"""Speculative steps on the compiled prefill path: prompt / mixed chunks, and every step
in batch-invariant mode.

With speculation on, every step goes through the spec runner (deepinfer/spec/runner.py), which
reaches this module through ``PrefillPath.spec_forward`` (v4/fast/prefill.py):
a verify step's rows need the drafter's captured layer inputs and the final streams
besides the logits. Decode-like steps (each request a token and its drafts) replay the
verify graphs (models/fast/verify_graphs.py); this module runs the others on the prefill path
(``PrefillPath``: batched attention, compressors and indexer, fused mHC / MoE), with the
drafter's layers captured.

Batch-invariant mode: a token's bits must not depend on the step it lands in, and the
non-speculative engine computes decode tokens in its invariant decode graphs. So every
speculative step (verify rows included) runs the mode's prefill rows
(``invariant_prefill.attention_prefill_invariant``: the decode step's per-row pieces,
batched over the step) and its logits come from the decode step's fused head (the last
``hc_post`` folded into ``hc_head``), exactly as ``invariant_prefill.prefill_logits``
computes them: a verify row then scores its position with the bits a decode step gives
it, so speculative greedy output equals non-speculative greedy output bitwise.
"""

from __future__ import annotations

from typing import Any

import torch

from ...fast.forward import head_hidden, head_logits, run_layers
from ...fast.verify_graphs import SpecForward
from ...mhc import hc_post
from ...paged_batch import ForwardBatch
from .invariant_prefill import attention_prefill_invariant
from .prefill_attention import attention_prefill

class SpecPrefill:
    """The speculative steps a ``PrefillPath`` runs (see the module docstring)."""

    def __init__(self, path: Any) -> None:
        self.path = path
        self.counts = {"steps": 0, "invariant_steps": 0}

    def forward(self, batch: ForwardBatch, layers: tuple[int, ...], invariant: bool) -> SpecForward | None:
        """The step on the prefill path (None when it does not apply: the reference path runs
        it). ``invariant``: the mode's rows and the decode head (``path.ops`` must be the
        mode's ops then: ``ModelRunner.batch_invariant`` switches them)."""
        path = self.path
        meta = path.prepare(batch)
        if meta is None:
            return None
        model, cache, ops = path.model, path.cache, meta.ops
        attention = attention_prefill_invariant if invariant else attention_prefill
        capture = dict.fromkeys(layers) if layers else None
        streams, (out, post, comb) = run_layers(model, batch.input_ids, ops, lambda attn, x: attention(
            attn, x, meta, cache, model.rotary_main, model.rotary_compress), capture)
        final = hc_post(out, streams, post, comb)  # the drafters read the final streams
        self.counts["steps"] += 1
        if invariant:
            self.counts["invariant_steps"] += 1

            def logits(rows: torch.Tensor) -> torch.Tensor:
                hidden = head_hidden(model, ops, streams[rows], (out[rows], post[rows], comb[rows]))
                return head_logits(model, ops, hidden)
        else:
            def logits(rows: torch.Tensor) -> torch.Tensor:
                return model.compute_logits(final[rows])
        return final, capture or {}, logits


__all__ = ["SpecPrefill"]
