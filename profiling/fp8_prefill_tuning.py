"""FP8 at prefill sizes on one GPU: which kernel and tiles make FP8 checkpoints prefill faster
than bf16, checked before timed.

    python profiling/fp8_prefill_tuning.py [--tokens 8192,2048,256] [--moe-tokens 8192,2048,512,256] [--out DIR]
    python profiling/fp8_prefill_tuning.py --smoke      # CPU, tiny shapes, Triton interpreter (tests)

* dense: flash4's FP8 linears at each ``--tokens`` row count (wq_a, wq_b, wkv, wo_b, the
  shared expert, e/h_proj shapes): cuBLAS bf16 on the dequantized weight (the bf16
  model's cost), the Triton w8a8 GEMM (``fp8_gemm``) at its default (and other tiles at
  the first count), cuBLAS's block-scaled FP8 GEMM (``fp8_gemm_cublas``: 1x128
  activation x 128x128 weight scales) and ``fp8_linear`` as the engine dispatches it;
  each checked against ``fp8_gemm_ref``;
* moe: the routed experts at flash widths (256 x 2048, top-6): bf16 ``fused_moe``,
  weight-only ``fused_moe_fp8`` and ``fused_moe_w8a8`` (other tiles at the first two
  counts), each checked against its torch reference.

Prints TFLOP/s against 800 (the measured bf16 ceiling) and the ratio to bf16 of the same
shape; writes ``fp8_prefill_tuning_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))  # kernel_bench is a benchmark
if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernel_bench as kb  # noqa: E402  (also makes deepinfer_kernels importable)
from deepinfer.models.quant import dequantize_fp8_block, quantize_fp8_block  # noqa: E402
from deepinfer_kernels.fp8_act_quant import act_quant  # noqa: E402
from deepinfer_kernels.fp8_gemm import fp8_gemm, fp8_gemm_cublas, fp8_gemm_ref, fp8_linear  # noqa: E402
from deepinfer_kernels.fused_moe import fused_moe  # noqa: E402
from deepinfer_kernels.fused_moe_quant import fused_moe_fp8, fused_moe_fp8_ref  # noqa: E402
from deepinfer_kernels.fused_moe_w8a8 import fused_moe_w8a8, fused_moe_w8a8_ref  # noqa: E402

BF = torch.bfloat16
#: (name, N, K) of flash4's FP8 linears
DENSE = [("wq_a", 1024, 4096), ("wq_b", 32768, 1024), ("wkv", 512, 4096), ("wo_b", 4096, 8192),
         ("shared_w1", 2048, 4096), ("shared_w2", 4096, 2048), ("proj", 4096, 4096)]
GEMM_TILES = [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),  # the earlier default (K steps of 64)
              dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4),
              dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)]
MOE_TILES = [dict(BLOCK_M=64, BLOCK_K=128, DOWN_N=256, num_warps=8, num_stages=4),
             dict(BLOCK_M=64, BLOCK_K=128, DOWN_N=128, num_warps=8, num_stages=3),
             dict(BLOCK_M=32, BLOCK_K=128, DOWN_N=128, num_warps=4, num_stages=4),
             dict(BLOCK_M=128, BLOCK_K=128, DOWN_N=128, num_warps=8, num_stages=4)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def scaled_mm(a_q, a_s_col, w_q, w_s) -> torch.Tensor:
    """cuBLAS block-scaled FP8 through torch (the layout fp8_linear uses; row-major
    activation scales or a contiguous [K/128, N/128] weight-scale copy are rejected:
    'Invalid scaling configuration': fp8_prefill_tuning_h200_3eecacf_layouts.json)."""
    return fp8_gemm_cublas(a_q, a_s_col, w_q, w_s, BF)


def run_case(rows: list, name: str, shape: str, fn: Callable[[], torch.Tensor], ref: torch.Tensor | None,
             flops: float, base_ms: float | None, tol: float, reps: int, **extra: Any) -> float | None:
    row: dict[str, Any] = {"kernel": name, "shape": shape, **extra}
    try:
        out = fn()
        row["rel_err"] = rel(out, ref) if ref is not None else None
        row["ok"] = row["rel_err"] is None or row["rel_err"] <= tol
        ms = kb.timeit(fn, reps=reps)
        row.update(ms=round(ms, 4), tflop_s=round(flops / ms / 1e9, 1), peak_frac=round(flops / ms / 1e9 / 800, 3),
                   x_bf16=round(base_ms / ms, 3) if base_ms else None)
    except Exception as exc:  # a rejected layout / config is a result, not a crash
        row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        ms = None
    rows.append(row)
    err = "-" if row.get("rel_err") is None else f"{row['rel_err']:.1e}"
    timing = f"{row['ms']:8.3f} ms {row['tflop_s']:7.1f} TF/s x{row['x_bf16'] or 0:.2f} err={err}" if ms else ""
    print(f"{name:42s} {shape:28s} {timing or row['error'][:120]}", flush=True)
    return ms if row.get("ok") else None


def bench_dense(rows: list, m: int, smoke: bool, tiles: bool) -> None:
    dev = kb.DEV
    shapes = [("tiny", 64, 128)] if smoke else DENSE
    for name, n, k in shapes:
        w = torch.randn(n, k, device=dev) * k ** -0.5
        w_q, w_s = quantize_fp8_block(w, (128, 128))
        w_d = dequantize_fp8_block(w_q, w_s, (128, 128), dtype=BF)
        x = torch.randn(m, k, device=dev).to(BF)
        a_q, a_s = act_quant(x, 128)
        ref = fp8_gemm_ref(a_q, a_s, w_q, w_s, (128, 128), BF)
        flops = 2.0 * m * n * k
        shape = f"M={m} N={n} K={k}"
        reps = 3 if smoke else 20
        base = run_case(rows, "cublas bf16 (dequantized W)", shape, lambda: F.linear(x, w_d), ref, flops, None,
                        0.05, reps, section="dense")
        run_case(rows, "act_quant", shape, lambda: act_quant(x, 128), None, 0.0, None, 1.0, reps, section="dense")
        run_case(rows, "fp8_gemm default", shape, lambda: fp8_gemm(a_q, a_s, w_q, w_s, (128, 128), BF), ref, flops,
                 base, 1e-2, reps, section="dense")
        for cfg in GEMM_TILES if tiles and not smoke else []:
            run_case(rows, "fp8_gemm", shape, lambda: fp8_gemm(a_q, a_s, w_q, w_s, (128, 128), BF, config=cfg), ref,
                     flops, base, 1e-2, reps, section="dense", config=cfg)
        if dev == "cuda":
            a_s_col = a_s.t().contiguous().t()
            run_case(rows, "scaled_mm (cuBLAS block-scaled)", shape, lambda: scaled_mm(a_q, a_s_col, w_q, w_s), ref,
                     flops, base, 1e-2, reps, section="dense")
        # what the engine runs: act_quant + the GEMM fp8_linear picks
        run_case(rows, "fp8_linear (engine dispatch)", shape, lambda: fp8_linear(x, w_q, w_s, (128, 128)), ref,
                 flops, base, 1e-2, reps, section="dense")
        del w, w_q, w_s, w_d, x, a_q, a_s, ref


#: (hidden, intermediate, experts, top-k) of the MoE widths
MOE_WIDTHS = {"flash": (4096, 2048, 256, 6), "mini": (1024, 512, 64, 6)}


def bench_moe(rows: list, t: int, smoke: bool, tiles: bool, widths: str = "flash") -> None:
    dev = kb.DEV
    h, inter, e, k = (64, 64, 8, 2) if smoke else MOE_WIDTHS[widths]
    block = (32, 32) if smoke else (128, 128)
    q = {n: [] for n in ("w1", "w3", "w2", "s1", "s3", "s2", "d1", "d3", "d2")}
    for wn, shape in (("1", (inter, h)), ("3", (inter, h)), ("2", (h, inter))):
        for _ in range(e):
            w = torch.randn(*shape, device=dev) * shape[1] ** -0.5
            wq, ws = quantize_fp8_block(w, block)
            q["w" + wn].append(wq)
            q["s" + wn].append(ws)
            q["d" + wn].append(dequantize_fp8_block(wq, ws, block, dtype=BF))
    st = {n: torch.stack(v) for n, v in q.items()}
    del q
    quant = [st[n] for n in ("w1", "w3", "w2", "s1", "s3", "s2")]
    dense = [st[n] for n in ("d1", "d3", "d2")]
    x = torch.randn(t, h, device=dev).to(BF)
    ids = torch.rand(t, e, device=dev).topk(k, dim=-1).indices.to(torch.int32)
    tw = (torch.rand(t, k, device=dev) * 0.5).to(BF)
    flops = 2.0 * t * k * 3 * inter * h
    shape = f"T={t} E={e} I={inter} k={k}"
    reps = 2 if smoke else 10
    ref8 = fused_moe_w8a8_ref(x, *quant, block, tw, ids, 10.0)
    ref16 = fused_moe_fp8_ref(x, *quant, block, tw, ids, 10.0)
    base = run_case(rows, "fused_moe bf16 (dequantized)", shape, lambda: fused_moe(x, *dense, tw, ids, 10.0), ref16,
                    flops, None, 2e-2, reps, section="moe")
    run_case(rows, "fused_moe_fp8 w8a16", shape, lambda: fused_moe_fp8(x, *quant, block, tw, ids, 10.0), ref16,
             flops, base, 2e-2, reps, section="moe")
    run_case(rows, "fused_moe_w8a8 default", shape, lambda: fused_moe_w8a8(x, *quant, block, tw, ids, 10.0), ref8,
             flops, base, 2e-2, reps, section="moe", err_vs_w8a16_ref=None)
    rows[-1]["err_vs_w8a16_ref"] = rel(fused_moe_w8a8(x, *quant, block, tw, ids, 10.0), ref16)
    for cfg in MOE_TILES if tiles and not smoke else []:
        run_case(rows, "fused_moe_w8a8", shape, lambda: fused_moe_w8a8(x, *quant, block, tw, ids, 10.0, config=cfg),
                 ref8, flops, base, 2e-2, reps, section="moe", config=cfg)


def main(argv: list[str] | None = None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="8192,2048,256", help="dense rows (tiles swept at the first)")
    ap.add_argument("--moe-tokens", default="8192,2048,512,256", help="MoE tokens (tiles swept at the first two)")
    ap.add_argument("--moe-widths", default="flash", choices=sorted(MOE_WIDTHS))
    ap.add_argument("--skip-dense", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(HERE, "results")))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Triton interpreter")
    args = ap.parse_args(argv)
    if args.smoke:
        kb.DEV = "cpu"
    rows: list = []
    dense_m = [] if args.skip_dense else [40] if args.smoke else [int(v) for v in args.tokens.split(",")]
    moe_t = [9] if args.smoke else [int(v) for v in args.moe_tokens.split(",")]
    for section, fn in (*((f"dense_{m}", (lambda m=m, i=i: bench_dense(rows, m, args.smoke, i == 0)))
                          for i, m in enumerate(dense_m)),
                        *((f"moe_{t}", (lambda t=t, i=i: bench_moe(rows, t, args.smoke, i < 2, args.moe_widths)))
                          for i, t in enumerate(moe_t))):
        try:
            fn()
        except Exception:
            rows.append({"section": section, "error": traceback.format_exc()[-1500:]})
            print(rows[-1]["error"], flush=True)
        if kb.DEV == "cuda":
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    dev = "cpu" if args.smoke else torch.cuda.get_device_name(0).replace(" ", "_").lower()
    path = os.path.join(args.out, f"fp8_prefill_tuning_{dev}{'' if args.moe_widths == 'flash' else '_' + args.moe_widths}.json")
    with open(path, "w") as f:
        json.dump({"commit": os.environ.get("DEEPINFER_COMMIT", "unknown"), "torch": torch.__version__,
                   "rows": rows}, f, indent=1)
    print(f"results: {path}")
    return rows


if __name__ == "__main__":
    main()
