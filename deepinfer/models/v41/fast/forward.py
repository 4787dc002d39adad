"""The whole DeepSeek-V4.1 model for a decode-like step on the fast path: embedding ->
layers -> final collapse, norm and head; same math as ``DeepseekV41Model.forward`` +
``compute_logits`` for rows that continue their requests.

Per layer: (Engram) -> shifted mHC site (the previous sublayer's expansion, this site's
mixes, the input collapsed with the previous site's ``pre`` and normed: one fused launch
pair, ``deepinfer_kernels.mhc.hc_shifted``) -> attention (``decode``) -> the ffn
site -> fused MoE (router logits in float32: ``deepinfer_kernels.linear_f32``). An Engram
layer adds its memory to the expanded streams, so the previous expansion runs inside its
gate's launch (``deepinfer_kernels.engram``). The head: the last expansion, the collapse
and the final norm in one launch (``deepinfer_kernels.hc_collapse``), then the LM head.
"""
from __future__ import annotations

from typing import Any

import torch

from ...fast.forward import head_logits
from ...fast.moe import moe_forward
from ...paged_batch import ForwardBatch
from ...v4.kv_cache import KVCache
from ..layers import hc_expand
from .decode import V41DecodeStep, _float_weight, attention_decode_v41, engram_hash_rows, linear_f32


def _site(block: torch.nn.Module, which: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return getattr(block, f"hc_{which}_fn"), getattr(block, f"hc_{which}_base"), getattr(block, f"hc_{which}_scale")


def _route_logits(gate: torch.nn.Module, x: torch.Tensor, ops: Any) -> torch.Tensor:
    """``Gate41``'s float32 router logits / gate_temp (scores come from them in the router)."""
    return linear_f32(ops, x, _float_weight(gate), gate.temp)


def _first_pre(streams: torch.Tensor) -> torch.Tensor:
    """The first site collapses stream 0: a one-hot pre [R, N]."""
    pre = torch.zeros(streams.shape[:2], dtype=torch.float32, device=streams.device)
    pre[:, 0].fill_(1.0)
    return pre


def decode_layers_v41(model: Any, batch: ForwardBatch, cache: KVCache,
                      capture: dict[int, torch.Tensor] | None = None) -> tuple:
    """Every layer for the rows of ``batch.decode``: (streams, the head's pre, the last
    MoE's pending expansion (out, post, comb)). ``capture``: for every layer id among its
    keys, that layer's input streams [R, N, D]."""
    meta = batch.decode
    ops, cfg, ids = meta.ops, model.cfg, batch.input_ids
    step = V41DecodeStep.start(model, meta, cache)
    iters, hc_eps, eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
    streams = model.embed(ids).unsqueeze(1).expand(-1, cfg.hc_mult, -1)
    pre = _first_pre(streams)
    hash_rows = engram_hash_rows(model, ids, step) if model.hasher is not None else None
    prev = None  # (sublayer output, post, comb) whose expansion is still to apply
    for i, layer in enumerate(model.layers):
        if capture is not None and i in capture:
            if prev is not None:
                streams, prev = hc_expand(prev[0], streams, prev[1], prev[2]), None
            capture[i] = streams
        if layer.engram_index is not None:  # the pending expansion inside the gate's launch
            kv = layer.engram.project(hash_rows[:, layer.engram_index])
            streams, prev = ops.engram_gate(layer.engram, streams, kv, prev), None
        new, a_pre, a_post, a_comb, x = ops.hc_shifted(streams, *_site(layer, "attn"), iters, hc_eps, eps, pre,
                                                       (layer.attn_norm.weight, layer.attn_norm.eps), prev)
        streams = streams if new is None else new
        out = attention_decode_v41(layer.attn, x, step)
        streams, pre, f_post, f_comb, x = ops.hc_shifted(streams, *_site(layer, "ffn"), iters, hc_eps, eps, a_pre,
                                                         (layer.ffn_norm.weight, layer.ffn_norm.eps),
                                                         (out, a_post, a_comb))
        ffn = layer.ffn
        prev = (moe_forward(ffn, x, ids, ops, logits=_route_logits(ffn.gate, x, ops)), f_post, f_comb)
    return streams, pre, prev


def decode_hidden_v41(model: Any, batch: ForwardBatch, cache: KVCache,
                      capture: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """The collapsed final hidden [R, hidden] (``DeepseekV41Model.forward``'s contract: a
    verify step's spec runner takes its logits and drafts from it)."""
    streams, pre, prev = decode_layers_v41(model, batch, cache, capture)
    return batch.decode.ops.hc_collapse_norm(streams, pre, None, prev)


def decode_verify_v41(model: Any, batch: ForwardBatch, cache: KVCache,
                      capture: dict[int, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(collapsed final hidden [R, hidden], float32 logits [R, V]) of every row from one pass:
    the verify graphs' greedy lane, whose logits are then those of a decode step's graph."""
    streams, pre, prev = decode_layers_v41(model, batch, cache, capture)
    ops = batch.decode.ops
    hidden = ops.hc_collapse_norm(streams, pre, None, prev)
    return hidden, head_logits(model, ops, ops.hc_collapse_norm(streams, pre, (model.norm.weight, model.norm.eps),
                                                                prev))


def decode_logits_v41(model: Any, batch: ForwardBatch, cache: KVCache,
                      capture: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """Float32 logits [R, V] of every row of a decode batch."""
    streams, pre, prev = decode_layers_v41(model, batch, cache, capture)
    ops = batch.decode.ops
    return head_logits(model, ops, ops.hc_collapse_norm(streams, pre, (model.norm.weight, model.norm.eps), prev))
