"""Quantize a dense model in memory to the official V4 storage: what loading a quantized
checkpoint leaves on the device, without writing one (a 27B-parameter bf16 model would
need ~55 GB on disk first).

Every Linear the official layout stores quantized (``checkpoint_layout.storage_format``:
attention / shared-expert / MTP projections in FP8 e4m3 with E8M0 block scales, routed
experts in FP4 or FP8) gets the same bytes ``deepinfer.models.tiny.official_state_dict``
would write for it, held as a :class:`QuantizedWeight`; its dense weight is dropped, as
the loader drops it. Used by the GPU benchmarks (``benchmarks/fastpath_bench.py --quantize``).
"""

from __future__ import annotations

import torch

from .checkpoint_layout import storage_format
from .linear import Linear, QuantizedWeight
from .quant import quantize_fp4, quantize_fp8_block

__all__ = ["quantize_linears"]


@torch.no_grad()
def quantize_linears(model: torch.nn.Module, expert_dtype: str = "fp4", block: tuple[int, int] = (128, 128)) -> int:
    """Quantize ``model``'s dense Linears in place (``expert_dtype``: 'fp4' or 'fp8' for the
    routed experts; ``block``: the FP8 scale block). Returns how many were quantized."""
    if expert_dtype not in ("fp4", "fp8"):
        raise ValueError(f"expert_dtype must be 'fp4' or 'fp8', got {expert_dtype!r}")
    count = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, Linear) or mod._parameters.get("weight") is None:
            continue
        fmt = storage_format(f"{name}.weight", expert_dtype)
        if fmt == "dense" or name.endswith("engram.embed"):
            continue
        w = mod.weight.float()
        if fmt == "fp8":
            data, scale = quantize_fp8_block(w, block)
            mod.quantized = QuantizedWeight("fp8", data, scale, block)
        else:
            data, scale = quantize_fp4(w, 32)
            mod.quantized = QuantizedWeight("fp4", data, scale, (1, 32))
        mod.weight = None
        count += 1
    return count
