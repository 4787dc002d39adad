"""Linear layers, dense or backed by a checkpoint's FP8 / FP4 bytes.

A Linear holds a dense weight in the compute dtype, or (quantized checkpoints) the
checkpoint's raw bytes on ``quantized``, or both. FP8 e4m3 block-scaled weights are
multiplied by the block-scaled FP8 GEMM (``deepinfer_kernels.fp8_gemm``: activations
quantised per token and group, w8a8) on CUDA; elsewhere the weight is dequantized
(on the fly when no dense copy is kept) and the activations stay in the compute dtype,
the reference numerics. ``DEEPINFER_FP8_GEMM`` picks the FP8 computation:

* ``auto`` (default): the Triton kernel for CUDA inputs, the dequantized weight otherwise;
* ``triton``: the kernel for any input (CPU needs TRITON_INTERPRET=1: tests);
* ``ref``: the kernel's torch reference (same w8a8 numerics, any device);
* ``dequant``: the dequantized weight everywhere (no activation quantisation).

Batch-invariant mode always takes the dequantized weight through its fixed-tile GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer import batch_invariant, envs

from . import invariant_ops

FP8_MODES = ("auto", "triton", "ref", "dequant")  # DEEPINFER_FP8_GEMM (declared in deepinfer/envs.py)


@dataclass
class QuantizedWeight:
    """Raw checkpoint bytes of one quantized weight: format 'fp8' (e4m3 [out, in], E8M0
    block scales [ceil(out/B0), ceil(in/B1)]) or 'fp4' (packed e2m1 [out, in/2], one
    scale per 32 inputs)."""

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight [out, in] in ``dtype`` (decoded in float32, rounded once)."""
        from .quant import dequantize_fp4, dequantize_fp8_block

        if self.fmt == "fp8":
            return dequantize_fp8_block(self.data, self.scale, self.block, dtype=torch.float32).to(dtype)
        return dequantize_fp4(self.data, self.scale, self.block[1], dtype=torch.float32).to(dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale))


def fp8_mode() -> str:
    """DEEPINFER_FP8_GEMM, validated."""
    return envs.DEEPINFER_FP8_GEMM


def _fp8_kernels():
    from deepinfer_kernels import fp8_gemm

    return fp8_gemm


def fp8_compute(x: torch.Tensor, q: QuantizedWeight, groups: int = 1) -> torch.Tensor | None:
    """x @ W^T through the FP8 path the mode picks for ``x``, or None when the
    dequantized weight should be used instead."""
    if q.fmt != "fp8" or batch_invariant.enabled():
        return None
    mode = fp8_mode()
    if mode == "dequant" or (mode == "auto" and not x.is_cuda):
        return None
    ops = _fp8_kernels()
    fn = ops.fp8_linear_ref if mode == "ref" else ops.fp8_linear
    return fn(x, q.data, q.scale, q.block, groups)


class Linear(nn.Module):
    """y = x @ W^T without bias; W is [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features, self.compute_dtype = in_features, out_features, dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.quantized: QuantizedWeight | None = None

    def dense_weight(self) -> torch.Tensor:
        """The dense weight: the parameter, or the checkpoint bytes dequantized now."""
        w = self._parameters.get("weight")
        if w is not None:
            return w
        if self.quantized is None:
            raise RuntimeError(f"{self!r} has neither a dense weight nor quantized bytes")
        return self.quantized.dequantize(self.compute_dtype)

    def __getattr__(self, name: str):
        # A Linear that keeps only its checkpoint bytes still answers `.weight` (dequantized
        # on the fly) for code that reads dense weights (EP weight moves, expert stacks).
        if name == "weight" and self.__dict__.get("_parameters", {}).get("weight") is None \
                and self.__dict__.get("quantized") is not None:
            return self.dense_weight()
        return super().__getattr__(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None and (y := fp8_compute(x, self.quantized)) is not None:
            return y
        w = self.dense_weight()
        if batch_invariant.enabled():  # fixed-shape GEMMs (invariant_ops.linear)
            return invariant_ops.linear(x, w)
        return F.linear(x, w)

    def extra_repr(self) -> str:
        q = f", quantized={self.quantized.fmt}" if self.quantized is not None else ""
        return f"{self.in_features} -> {self.out_features}{q}"


class GroupedLinear(Linear):
    """Block-diagonal projection of the grouped low-rank attention output (`wo_a`):
    head group g ([T, in_per_group]) is projected by rows [g*rank, (g+1)*rank) of W."""

    def __init__(self, in_per_group: int, out_features: int, groups: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(in_per_group, out_features, dtype)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, groups, in_per_group] -> [T, groups * rank]."""
        if self.quantized is not None and (y := fp8_compute(x, self.quantized, self.groups)) is not None:
            return y
        w = self.dense_weight().view(self.groups, -1, self.in_features)  # [G, rank, in]
        if batch_invariant.enabled():
            return invariant_ops.grouped_linear(x, w)
        y = torch.bmm(x.transpose(0, 1), w.transpose(1, 2))  # [G, T, rank]
        return y.transpose(0, 1).reshape(x.shape[0], -1)
