"""Op selection of the compiled prefill / mixed step, shared by the families' prefill
executors (V4: models/v4/fast/prefill.py, V4.1: models/v41/fast/prefill.py): the decode
fast path's ops plus the prefill kernels (:func:`prefill_ops`), and which of them a step
runs with (:func:`select_prefill_ops`, ``DEEPINFER_FAST_PREFILL``):

* ``auto`` (default): a bf16 / fp16 model whose cache is on a CUDA device, the kernels
  import, and ``DEEPINFER_FASTPATH`` is not off (``DEEPINFER_FASTPATH=1`` also admits
  float32 models);
* ``triton`` / ``ref``: forced on any device with the (interpreted) kernels / their torch
  references (CPU tests); ``0``: off.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from deepinfer import envs

from .decode import kernel_ops

MODES = ("auto", "0", "triton", "ref")  # DEEPINFER_FAST_PREFILL (declared in deepinfer/envs.py)


def prefill_ops(kind: str) -> SimpleNamespace:
    """The decode fast path's ops (mHC, router, fused MoE) plus the prefill kernels."""
    ops = kernel_ops(kind)
    from deepinfer_kernels import compressor_prefill as cp
    from deepinfer_kernels import prefill_attention as pa
    from deepinfer_kernels import prefill_indexer as pi

    sfx = "" if kind == "triton" else "_ref"
    ops.prefill_attention = getattr(pa, "prefill_attention" + sfx)
    ops.prefill_indexer_topk = getattr(pi, "prefill_indexer_topk" + sfx)
    ops.compressor_prefill = getattr(cp, "compressor_prefill" + sfx)
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
