"""The whole model for a pure-decode step on the fast path: embedding -> layers -> head,
with mHC fused (``deepinfer_kernels.mhc``).

Same math as ``DeepseekV4Model.forward`` + ``compute_logits``; the launch structure per
layer is:

    hc_pre/hc_post_pre (attn)  -> attention_decode -> hc_post_pre (ffn) -> moe_forward

where ``hc_post_pre`` applies the previous sublayer's ``hc_post`` and the next
sublayer's ``hc_pre`` + input RMSNorm in one pass (two launches), and the last layer's
``hc_post`` goes into ``hc_head`` + the final norm. Layer 0 reads the embedding broadcast
over the streams (a stride-0 view, no copy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..paged_batch import ForwardBatch
from ..v4.kv_cache import KVCache
from .decode import attention_decode
from .invariant import is_invariant
from .moe import moe_forward
from .moe import supported as moe_supported


def _mhc_args(layer: torch.nn.Module, which: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return getattr(layer, f"hc_{which}_fn"), getattr(layer, f"hc_{which}_base"), getattr(layer, f"hc_{which}_scale")


def run_block(block: torch.nn.Module, streams: torch.Tensor, prev: tuple | None, input_ids: torch.Tensor, ops: Any,
              attention: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor], capture: dict | None = None,
              index: int = -1) -> tuple:
    """One block (a layer, an MTP or DSpark stage) with fused mHC: the previous block's
    ``hc_post`` (``prev``) + this block's ``hc_pre`` and attn_norm, ``attention(block.attn,
    x)``, ``hc_post_pre`` + ffn_norm, the fused MoE. Returns (streams, prev) with this
    block's ``hc_post`` still to apply (the next block or the head fuses it)."""
    cfg = block.cfg
    iters, hc_eps, eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
    norm = (block.attn_norm.weight, block.attn_norm.eps)
    if prev is None:
        post, comb, x = ops.hc_pre(streams, *_mhc_args(block, "attn"), iters, hc_eps, eps, norm)
    else:
        out, post, comb = prev
        streams, post, comb, x = ops.hc_post_pre(out, streams, post, comb, *_mhc_args(block, "attn"), iters,
                                                 hc_eps, eps, norm)
    if capture is not None and index in capture:
        capture[index] = streams
    out = attention(block.attn, x)
    norm = (block.ffn_norm.weight, block.ffn_norm.eps)
    streams, post, comb, x = ops.hc_post_pre(out, streams, post, comb, *_mhc_args(block, "ffn"), iters,
                                             hc_eps, eps, norm)
    return streams, (moe_forward(block.ffn, x, input_ids, ops), post, comb)


def run_layers(model: Any, input_ids: torch.Tensor, ops: Any, attention: Callable[[torch.nn.Module, torch.Tensor],
               torch.Tensor], capture: dict | None = None) -> tuple:
    """Every layer through :func:`run_block` with ``attention`` (decode or prefill); returns
    (streams, (last sublayer output, post, comb)) with the last ``hc_post`` still to apply
    (the decode path fuses it into the head)."""
    streams = model.embed(input_ids).unsqueeze(1).expand(-1, model.cfg.hc_mult, -1)
    prev = None  # (sublayer output, post, comb) whose hc_post is still to apply
    for i, layer in enumerate(model.layers):
        streams, prev = run_block(layer, streams, prev, input_ids, ops, attention, capture, i)
    return streams, prev


def blocks_supported(blocks: Any) -> bool:
    """Every block's FFN runs on the fused MoE kernel."""
    return all(moe_supported(b.ffn) for b in blocks)


def head_hidden(block: Any, ops: Any, streams: torch.Tensor, prev: tuple, return_streams: bool = False):
    """The last ``hc_post`` + a stage's own ``hc_head`` and output norm (its ``hc_head_*`` and
    ``norm``): the normed hidden [T, D] its logits come from (``return_streams``: and the
    stage's output streams, which an MTP stage feeds its next draft)."""
    cfg = block.cfg
    return ops.hc_head(streams, block.hc_head_fn, block.hc_head_base, block.hc_head_scale, cfg.hc_eps,
                       cfg.rms_norm_eps, (block.norm.weight, block.norm.eps), prev, return_streams=return_streams)


def _layers(model: Any, batch: ForwardBatch, cache: KVCache, capture: dict | None) -> tuple:
    ctx = model.context(batch, cache)
    return run_layers(model, batch.input_ids, batch.decode.ops, lambda attn, x: attention_decode(attn, x, ctx), capture)


def _head(model: Any, ops: Any, streams: torch.Tensor, prev: tuple, return_streams: bool):
    cfg = model.cfg
    return ops.hc_head(streams, model.hc_head_fn, model.hc_head_base, model.hc_head_scale, cfg.hc_eps,
                       cfg.rms_norm_eps, (model.norm.weight, model.norm.eps), prev, return_streams=return_streams)


#: Decode steps with at most this many rows take the skinny GEMM for a dense LM head
#: (as fast as cuBLAS or faster up to 16 rows on an H200, slower at 64: deepinfer_kernels/skinny_gemm.py,
#: docs/measurements.md).
SKINNY_HEAD_MAX_ROWS = 16


def decode_logits(model: Any, batch: ForwardBatch, cache: KVCache,
                  capture: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """Float32 logits [R, V] of every row of a decode batch (``batch.decode`` set).
    ``capture``: for every layer id among its keys, ``capture[i]`` is set to that layer's
    input streams [R, N, D], as ``DeepseekV4Model.forward`` does."""
    streams, prev = _layers(model, batch, cache, capture)
    return head_logits(model, batch.decode.ops, _head(model, batch.decode.ops, streams, prev, False))


def head_logits(model: Any, ops: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head over normed hidden rows [R, D] -> float32 logits [R, V] (a dense head
    and a small step take the skinny GEMM, which writes float32 without a cast; batch-invariant
    mode keeps the module, whose GEMM tiling does not follow the row count)."""
    w = model.head._parameters.get("weight")
    if (w is not None and not is_invariant(ops) and model.head.quantized is None
            and hidden.shape[0] <= SKINNY_HEAD_MAX_ROWS):
        return ops.skinny_linear(hidden, w, out_dtype=torch.float32)
    return model.head(hidden).float()


def decode_streams(model: Any, batch: ForwardBatch, cache: KVCache,
                   capture: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """The final streams [R, N, D] of every row (what ``DeepseekV4Model.forward`` returns:
    speculative verify computes its own logits from them and hands them to the drafter)."""
    streams, prev = _layers(model, batch, cache, capture)
    return _head(model, batch.decode.ops, streams, prev, True)[1]
