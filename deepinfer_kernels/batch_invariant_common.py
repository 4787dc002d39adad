"""What the batch-invariant kernels share: the dot product helper and the rule they keep.

The rule: a kernel's launch configuration (tile sizes, K step, warps, stages) may
depend on the model's fixed widths (K, D, head count) and the dtype, never on the
number of rows of the step. A row's result then comes from the same instructions in
the same order whatever else is in the batch: rows of a tile never interact inside a
tensor-core MMA, and the reduction over K walks the same BLOCK_K steps. No split-K, no
autotuning, no atomics.

Integer arguments that vary with the batch (row counts) are excluded from Triton's
value specialisation (``do_not_specialize``) so one compiled variant serves every
batch size.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def bi_dot(a, b, acc, FP32: tl.constexpr, INTERP: tl.constexpr):
    """acc + a @ b with float32 accumulation. float32 operands use exact IEEE products
    (not TF32: a float32 model keeps float32 accuracy); bf16/fp16 use tensor cores.

    The interpreter's ``tl.dot`` is numpy's BLAS matmul, whose micro-kernels give a row
    different last bits depending on its place in the tile (OpenBLAS, measured), and
    whose bf16 dot multiplies raw bits; there the product is an explicit float32
    multiply and a sum over K, which numpy adds in K order for every (row, column)."""
    if INTERP:
        acc = acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif FP32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc
