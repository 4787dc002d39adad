"""Shared pieces of the batched decode step (the V4 family's decode attention is in
models/v4/fast/decode.py, V4.1's in models/v41/fast/decode.py): the op namespace of the
fast path (:func:`kernel_ops`: the Triton kernels of ``deepinfer_kernels`` or their torch
references), the device inputs of a pure-decode step (:class:`DecodeMeta`), the rope
frequencies kept on the device (a graph capture forbids the per-call host copy) and the
attention output projection on the grouped skinny GEMM (:func:`grouped_out`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from ..rope import Rotary
from .invariant import is_invariant


def kernel_ops(kind: str) -> SimpleNamespace:
    """The batched ops: ``"triton"`` (deepinfer_kernels) or ``"ref"`` (their torch
    references: per-request loops with host reads, for CPU tests only)."""
    from deepinfer_kernels import argmax_lse as am
    from deepinfer_kernels import compressor_decode as cd
    from deepinfer_kernels import decode_attention as da
    from deepinfer_kernels import draft_block_attention as dba
    from deepinfer_kernels import dspark_tail as dt
    from deepinfer_kernels import engram as eg
    from deepinfer_kernels import hc_collapse as hcc
    from deepinfer_kernels import fused_moe as fm
    from deepinfer_kernels import fused_moe_w8a8 as w8
    from deepinfer_kernels import indexer_topk as it
    from deepinfer_kernels import mhc
    from deepinfer_kernels import norm_rope as nr
    from deepinfer_kernels import rms_norm as rn
    from deepinfer_kernels import router as rt
    from deepinfer_kernels import linear_f32 as lf
    from deepinfer_kernels import markov_draws as mkd
    from deepinfer_kernels import skinny_gemm as sg
    from deepinfer_kernels import spec_lane as sl

    if kind not in ("triton", "ref"):
        raise ValueError(f"unknown fast-path op kind {kind!r}")
    sfx = "" if kind == "triton" else "_ref"
    mods = {"decode_attention": da, "indexer_topk": it, "router": rt, "fused_moe": fm, "hc_pre": mhc,
            "hc_post_pre": mhc, "hc_head": mhc, "compressor_decode": cd, "norm_rope": nr, "rms_norm": rn,
            "fused_moe_w8a8": w8, "skinny_linear": sg, "skinny_grouped_linear": sg, "argmax_logsumexp": am,
            "hc_shifted": mhc, "indexer_scores": it, "engram_hash": eg,
            "engram_gate": eg, "linear_f32": lf,
            "hc_collapse_norm": hcc, "draft_block_attention": dba, "dspark_tail_stage": dt,
            "markov_greedy_draws": mkd, "feed_placeholders": sl, "greedy_verify": sl, "mtp_tail_record": sl}
    return SimpleNamespace(kind=kind, **{name: getattr(mod, name + sfx) for name, mod in mods.items()})


@dataclass
class DecodeMeta:
    """Device inputs of a pure-decode step (views of the runner's :class:`StepInputs`).

    ids, positions, slots (compressor ring slots): [R] int32 per row; tables: group ->
    [R, width] int32 physical block ids (padding = 0, never read for a visible row);
    starts [R + 1]: each request's rows (consecutive positions; None = one row each);
    ``graphed``: the step replays a CUDA graph (R is then its padded bucket); ``n_rows``:
    the real rows."""

    positions: torch.Tensor
    slots: torch.Tensor
    tables32: dict[str, torch.Tensor]
    width: int
    ops: Any
    ids: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    graphed: bool = False
    n_rows: int = 0


def _inv_freq(rotary: Rotary, device: torch.device) -> torch.Tensor:
    """``rotary.inv_freq`` kept on the device (Rotary moves it from the host per call,
    which a graph capture forbids)."""
    inv = getattr(rotary, "_inv_freq_dev", None)
    if inv is None or inv.device != device:
        inv = rotary._inv_freq_dev = rotary.inv_freq.to(device)
    return inv


#: Decode steps with at most this many rows run the attention's dense ``wo_a`` on the
#: grouped skinny GEMM (deepinfer_kernels/skinny_gemm.py) instead of cuBLAS's batched GEMM, when its
#: weight is at most SKINNY_GROUPED_MAX_BYTES: at batch 1 on an H200 it beat cuBLAS on
#: `mini`'s 4 MB weights and lost on `flash4`'s 64 MB ones, which cuBLAS already streams near
#: the copy ceiling (fastpath_bench_h200_dfcd675.json vs fastpath_bench_h200_044b4fc.json;
#: numbers in docs/measurements.md).
SKINNY_GROUPED_MAX_ROWS = 16
SKINNY_GROUPED_MAX_BYTES = 16 << 20


def grouped_out(wo_a: torch.nn.Module, x: torch.Tensor, ops: Any) -> torch.Tensor:
    """``wo_a(x)`` for x [T, groups, in]: a small dense weight of x's dtype and a small step
    take one grouped skinny GEMM launch, anything else the module (cuBLAS bmm, FP8 GEMM; in
    batch-invariant mode its fixed-tile GEMMs)."""
    w = wo_a._parameters.get("weight")
    if (w is not None and not is_invariant(ops) and wo_a.quantized is None and x.shape[0] <= SKINNY_GROUPED_MAX_ROWS and w.dtype == x.dtype
            and w.numel() * w.element_size() <= SKINNY_GROUPED_MAX_BYTES and (w.shape[0] // wo_a.groups) % 16 == 0):
        return ops.skinny_grouped_linear(x, w)
    return wo_a(x)


__all__ = ["DecodeMeta", "grouped_out", "kernel_ops"]
