"""Fast path of prefill / mixed steps (every step that is not pure decode): the whole model
over the flattened batch with batched attention, compressors and indexer
(:mod:`prefill_attention`), fused mHC and fused MoE, on the Triton kernels of
``deepinfer_kernels`` (or their torch references).

Selection (``PrefillPath.create``), ``DEEPINFER_FAST_PREFILL``:

* ``auto`` (default): a plain ``DeepseekV4Model`` (not V4.1) in bf16 / fp16 whose cache is
  on a CUDA device, the kernels import, and ``DEEPINFER_FASTPATH`` is not off
  (``DEEPINFER_FASTPATH=1`` also admits float32 models);
* ``triton`` / ``ref``: forced on any device with the (interpreted) kernels / their torch
  references (CPU tests); ``0``: off.

The runner asks :meth:`PrefillPath.prepare` for a step's metadata (None when the path
does not apply: pure-decode steps go to the decode fast path, EP or load-counting MoE
layers stay on the reference path) and runs :meth:`PrefillPath.forward`, which returns the
final streams like ``DeepseekV4Model.forward``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from deepinfer import envs

from ..mhc import hc_post
from ..moe import MoE
from ..paged_batch import ForwardBatch
from ..v4.kv_cache import KVCache
from .decode import kernel_ops
from .forward import run_layers
from .moe import supported as moe_supported
from .prefill_attention import attention_prefill
from .prefill_meta import PrefillMeta, build_prefill_meta

MODES = ("auto", "0", "triton", "ref")  # DEEPINFER_FAST_PREFILL (declared in deepinfer/envs.py)


def prefill_ops(kind: str) -> SimpleNamespace:
    """The decode fast path's ops (mHC, router, fused MoE) plus the prefill kernels."""
    ops = kernel_ops(kind)
    from deepinfer_kernels import prefill_attention as pa
    from deepinfer_kernels import prefill_indexer as pi

    sfx = "" if kind == "triton" else "_ref"
    ops.prefill_attention = getattr(pa, "prefill_attention" + sfx)
    ops.prefill_indexer_topk = getattr(pi, "prefill_indexer_topk" + sfx)
    return ops


def select_prefill_ops(path_cls: Any, model: Any, cache: Any) -> Any:
    """The prefill ops a family's prefill path runs with, or None for the reference path:
    ``DEEPINFER_FAST_PREFILL`` forces triton / ref (tests, CPU), else the Triton kernels on
    CUDA for a half-precision model unless ``DEEPINFER_FASTPATH`` turns the fast path off
    (``=1`` also takes float32). Why the kernels did not import lands in ``path_cls.unavailable``."""
    mode = envs.DEEPINFER_FAST_PREFILL
    if mode == "0":
        return None
    if mode in ("triton", "ref"):
        return prefill_ops(mode)
    fastpath = envs.DEEPINFER_FASTPATH
    if cache.swa[0].device.type != "cuda" or fastpath in ("0", "off", "false", "no", "ref"):
        return None
    if fastpath != "1" and getattr(model, "dtype", None) not in (torch.bfloat16, torch.float16):
        return None
    try:
        return prefill_ops("triton")
    except Exception as exc:  # no triton / kernels: reference path
        path_cls.unavailable = repr(exc)
        return None


class PrefillPath:
    """Runs prefill / mixed steps of one model replica on the fast path."""

    unavailable: str | None = None  # why the kernels did not import, if they did not

    def __init__(self, model: Any, cache: KVCache, ops: Any) -> None:
        self.model, self.cache, self.ops = model, cache, ops
        self.groups = [g for g in ("swa", "csa", "hca") if g in cache.num_blocks]
        self.stats = {"prefill_steps": 0, "prefill_rows": 0}

    @classmethod
    def create(cls, model: Any, cache: KVCache) -> PrefillPath | None:
        from ..v4.model import DeepseekV4Model

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
        for those rows (fast/invariant_prefill.py)."""
        from .invariant_prefill import prefill_logits

        return prefill_logits(self.model, self.cache, batch.input_ids, meta, rows)

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
