"""Section ``moe_quant`` of benchmarks/kernel_bench.py: the routed-expert MoE on quantized
weights (``fused_moe_fp8`` w8a16, ``fused_moe_fp4`` w4a16) against the bf16 ``fused_moe``,
each checked against its torch reference, and the quantized ones also against the bf16
kernel on the dequantized weights (``bf16_kernel_equal_frac``: decoding in the kernel is
exact, so this should be ~1).

    python benchmarks/kernel_bench.py --only moe_quant [--widths flash,mini]   (--smoke: CPU)

Widths: E routed experts + the shared one stacked as expert E (every token's last slot,
weight 1), as the fast path runs it; k = top-k + 1. GB/s counts the weight bytes of the
experts the batch touches (data + scales) plus activations in / out; TFLOP/s 2 * T * k * 3 * I * H.
The bf16 kernel runs on the FP8 weights dequantized. On an H200 fp8 beats bf16 at decode
sizes and loses at 8192 tokens; fp4's nibble decode is ALU-bound (the recorded run:
profiling/results/kernel_bench_moe_quant_h200.json, summarised in docs/measurements.md).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch

# kernel_bench (whose sections these are) is a benchmark: importable when this file is loaded alone too
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import kernel_bench as kb  # noqa: E402
from deepinfer.models.quant import dequantize_fp4, dequantize_fp8_block, quantize_fp4, quantize_fp8_block  # noqa: E402
from deepinfer_kernels.fused_moe import fused_moe, fused_moe_ref  # noqa: E402
from deepinfer_kernels.fused_moe_quant import fused_moe_fp4, fused_moe_fp4_ref, fused_moe_fp8, fused_moe_fp8_ref  # noqa: E402

BF = torch.bfloat16
DEV = "cuda"  # kernel_bench.main sets it ("cpu" for --smoke)
MOE_T = (1, 64, 256, 8192)
SMOKE_MOE_T = (3, 17)
FP8_BLOCK, FP4_GROUP = (128, 128), 32
#: extra tile configs timed at some token counts (the default _config is always timed)
ALT: dict[int, list[dict[str, int]]] = {
    1: [dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3)],
    64: [dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)],
    8192: [dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)],
}


def _experts(e: int, inter: int, h: int) -> dict[str, Any]:
    """Random experts quantized one at a time (FP8 block-scaled and FP4), with the bf16
    dequantization of each (the bf16 kernel's weights and the equality baselines)."""
    out: dict[str, list] = {k: [] for k in ("q8", "s8", "d8", "q4", "s4", "d4")}
    for shape, scale in (((inter, h), h ** -0.5), ((inter, h), h ** -0.5), ((h, inter), inter ** -0.5)):
        per: dict[str, list] = {k: [] for k in out}
        for _ in range(e):
            w = torch.randn(*shape, device=DEV) * scale
            q8, s8 = quantize_fp8_block(w, FP8_BLOCK)
            q4, s4 = quantize_fp4(w, FP4_GROUP)
            for name, t in (("q8", q8), ("s8", s8), ("q4", q4), ("s4", s4),
                            ("d8", dequantize_fp8_block(q8, s8, FP8_BLOCK, dtype=BF)),
                            ("d4", dequantize_fp4(q4, s4, FP4_GROUP, dtype=BF))):
                per[name].append(t)
        for k in out:
            out[k].append(torch.stack(per[k]))
    return out


def _check(base: torch.Tensor | None) -> Callable[[torch.Tensor, torch.Tensor], dict[str, Any]]:
    close = kb.close()

    def check(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
        row = close(out, ref)
        if base is not None:
            row["bf16_kernel_equal_frac"] = float((out == base).float().mean())
        return row
    return check


def bench_moe_quant(rec: kb.Recorder, wname: str, w: dict[str, int]) -> None:
    h, inter, e, k = w["hidden"], w["inter"], w["experts"] + 1, w["topk"] + 1
    wt = _experts(e, inter, h)
    q8, s8, d8, q4, s4, d4 = (wt[n] for n in ("q8", "s8", "d8", "q4", "s4", "d4"))
    per_expert = {"bf16": 3 * inter * h * 2,
                  "fp8": sum(t[0].numel() + s[0].numel() for t, s in zip(q8, s8)),
                  "fp4": sum(t[0].numel() + s[0].numel() for t, s in zip(q4, s4))}
    for t in (SMOKE_MOE_T if DEV == "cpu" else MOE_T):
        x = torch.randn(t, h, device=DEV).to(BF)
        routed = torch.rand(t, e - 1, device=DEV).topk(k - 1, dim=-1).indices
        ids = torch.cat([routed, torch.full((t, 1), e - 1, device=DEV)], 1).to(torch.int32)
        tw = torch.cat([torch.rand(t, k - 1, device=DEV) * 0.5, torch.ones(t, 1, device=DEV)], 1).to(BF)
        n_active = int(torch.unique(ids).numel())
        act_bytes = t * h * 2 * 2
        fl = 2.0 * t * k * 3 * inter * h
        shape = f"T={t} E={e} I={inter} k={k}"
        reps = 10 if t >= 4096 else 30
        for cfg in [None] + (ALT.get(t, []) if DEV == "cuda" else []):
            tag = cfg or {"default": True}
            base8 = fused_moe(x, *d8, tw, ids, 10.0, config=cfg)
            rec.case("fused_moe bf16", wname, shape, lambda: fused_moe(x, *d8, tw, ids, 10.0, config=cfg),
                     lambda: fused_moe_ref(x, *d8, tw, ids, 10.0), _check(None),
                     n_active * per_expert["bf16"] + act_bytes, fl, reps=reps, ref_reps=1 if cfg is None else 0,
                     config=tag)
            rec.case("fused_moe_fp8 w8a16", wname, shape + f" b={FP8_BLOCK[0]}",
                     lambda: fused_moe_fp8(x, *q8, *s8, FP8_BLOCK, tw, ids, 10.0, config=cfg),
                     lambda: fused_moe_fp8_ref(x, *q8, *s8, FP8_BLOCK, tw, ids, 10.0), _check(base8),
                     n_active * per_expert["fp8"] + act_bytes, fl, reps=reps, ref_reps=1 if cfg is None else 0,
                     config=tag)
            base4 = fused_moe(x, *d4, tw, ids, 10.0, config=cfg)
            rec.case("fused_moe_fp4 w4a16", wname, shape + f" g={FP4_GROUP}",
                     lambda: fused_moe_fp4(x, *q4, *s4, tw, ids, 10.0, group=FP4_GROUP, config=cfg),
                     lambda: fused_moe_fp4_ref(x, *q4, *s4, tw, ids, 10.0, group=FP4_GROUP), _check(base4),
                     n_active * per_expert["fp4"] + act_bytes, fl, reps=reps, ref_reps=1 if cfg is None else 0,
                     config=tag)
            del base8, base4
    del wt, q8, s8, d8, q4, s4, d4
    if DEV == "cuda":
        torch.cuda.empty_cache()


SECTIONS = {"moe_quant": bench_moe_quant}
