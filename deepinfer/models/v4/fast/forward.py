"""DeepSeek-V4's whole model for a pure-decode step on the fast path: embedding -> layers ->
head, with mHC fused (``deepinfer_kernels.mhc``; the fused blocks are models/fast/forward.py).

Same math as ``DeepseekV4Model.forward`` + ``compute_logits``; the launch structure per
layer is:

    hc_pre/hc_post_pre (attn)  -> attention_decode -> hc_post_pre (ffn) -> moe_forward

where ``hc_post_pre`` applies the previous sublayer's ``hc_post`` and the next
sublayer's ``hc_pre`` + input RMSNorm in one pass (two launches), and the last layer's
``hc_post`` goes into ``hc_head`` + the final norm. Layer 0 reads the embedding broadcast
over the streams (a stride-0 view, no copy).
"""

from __future__ import annotations

from typing import Any

import torch

from ...fast.forward import head_logits, run_layers
from ...paged_batch import ForwardBatch
from ..kv_cache import KVCache
from .decode import attention_decode


def _layers(model: Any, batch: ForwardBatch, cache: KVCache, capture: dict | None) -> tuple:
    ctx = model.context(batch, cache)
    return run_layers(model, batch.input_ids, batch.decode.ops, lambda attn, x: attention_decode(attn, x, ctx), capture)


def _head(model: Any, ops: Any, streams: torch.Tensor, prev: tuple, return_streams: bool):
    cfg = model.cfg
    return ops.hc_head(streams, model.hc_head_fn, model.hc_head_base, model.hc_head_scale, cfg.hc_eps,
                       cfg.rms_norm_eps, (model.norm.weight, model.norm.eps), prev, return_streams=return_streams)


def decode_logits(model: Any, batch: ForwardBatch, cache: KVCache,
                  capture: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """Float32 logits [R, V] of every row of a decode batch (``batch.decode`` set).
    ``capture``: for every layer id among its keys, ``capture[i]`` is set to that layer's
    input streams [R, N, D], as ``DeepseekV4Model.forward`` does."""
    streams, prev = _layers(model, batch, cache, capture)
    return head_logits(model, batch.decode.ops, _head(model, batch.decode.ops, streams, prev, False))


def decode_verify(model: Any, batch: ForwardBatch, cache: KVCache,
                  capture: dict[int, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(final streams [R, N, D], float32 logits [R, V]) of every row from one pass: the
    verify graphs' greedy lane, whose logits are then those of a decode step's graph."""
    streams, prev = _layers(model, batch, cache, capture)
    hidden, out = _head(model, batch.decode.ops, streams, prev, True)
    return out, head_logits(model, batch.decode.ops, hidden)


def decode_streams(model: Any, batch: ForwardBatch, cache: KVCache,
                   capture: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """The final streams [R, N, D] of every row (what ``DeepseekV4Model.forward`` returns:
    speculative verify computes its own logits from them and hands them to the drafter)."""
    streams, prev = _layers(model, batch, cache, capture)
    return _head(model, batch.decode.ops, streams, prev, True)[1]
