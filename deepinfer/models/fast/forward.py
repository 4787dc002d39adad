"""The fused-mHC blocks of the fast path: a layer, an MTP or a DSpark stage with the
standard hyper-connections (models/mhc.py) as ``deepinfer_kernels.mhc`` launches around its
attention sublayer and the fused MoE, the stages' own head, the LM head and whether a set of
blocks fits the fused MoE. The per-layer launch structure is:

    hc_pre/hc_post_pre (attn)  -> attention(block.attn, x) -> hc_post_pre (ffn) -> moe_forward

where ``hc_post_pre`` applies the previous sublayer's ``hc_post`` and the next
sublayer's ``hc_pre`` + input RMSNorm in one pass (two launches). The attention sublayer
is passed in (V4's decode / prefill attention, a DSpark stage's block attention), so the
V4 family's whole-model forwards (models/v4/fast/) and the MTP drafter (deepinfer/spec/)
share these; V4.1's shifted hyper-connections have their own (models/v41/fast/forward.py)
and take only :func:`head_logits` from here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

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


def mtp_stage_streams(model: Any, mtp: Any, ops: Any, ids: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """An MTP stage's input streams [R, N, D]: ``h_proj(hnorm(prev)) + e_proj(enorm(embed(ids)))``
    per stream (``models.v4.model.MTPStage``), its two norms on the RMSNorm kernel (as torch
    ops they are eight launches each)."""
    e = mtp.e_proj(ops.rms_norm(model.embed(ids), mtp.enorm.weight, mtp.enorm.eps))
    return mtp.h_proj(ops.rms_norm(prev, mtp.hnorm.weight, mtp.hnorm.eps)) + e.unsqueeze(1)


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


#: Decode steps with at most this many rows take the skinny GEMM for a dense LM head
#: (as fast as cuBLAS or faster up to 16 rows on an H200, slower at 64: deepinfer_kernels/skinny_gemm.py,
#: docs/measurements.md).
SKINNY_HEAD_MAX_ROWS = 16


def head_logits(model: Any, ops: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head over normed hidden rows [R, D] -> float32 logits [R, V] (a dense head
    and a small step take the skinny GEMM, which writes float32 without a cast; batch-invariant
    mode keeps the module, whose GEMM tiling does not follow the row count)."""
    w = model.head._parameters.get("weight")
    if (w is not None and not is_invariant(ops) and model.head.quantized is None
            and hidden.shape[0] <= SKINNY_HEAD_MAX_ROWS):
        return ops.skinny_linear(hidden, w, out_dtype=torch.float32)
    return model.head(hidden).float()
