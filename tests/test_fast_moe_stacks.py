"""The fused MoE's expert stacks (deepinfer/models/fast/moe.py) are built once, also for
experts that keep only their checkpoint bytes (the trained default's FP4 experts): their
`.weight` dequantizes on every read, and a read inside a CUDA graph capture copies the FP4
table from the host, which the capture refuses (batch-invariant verify graphs hit it)."""

from __future__ import annotations

import torch

from deepinfer.models.fast.moe import stacked_experts
from deepinfer.models.loader import load_model


def test_quantized_experts_are_stacked_once(monkeypatch):
    model = load_model("datasets/models/deepinfer-tiny", dtype="float32", device="cpu")
    moe = next(m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "shared_experts"))
    lin = moe.experts[0].w1
    assert lin._parameters.get("weight") is None and lin.quantized is not None  # bytes only
    first = stacked_experts(moe)
    want = torch.stack([ex.w1.weight for ex in list(moe.experts)[: first[0].shape[0]]])
    assert torch.equal(first[0][: want.shape[0]], want)
    calls = []
    original = type(lin.quantized).dequantize
    monkeypatch.setattr(type(lin.quantized), "dequantize", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    again = stacked_experts(moe)
    assert again is first and not calls  # no dequantize (no host copy) on the second call
