#!/usr/bin/env python
"""Does a bf16 GEMM at a token count M no earlier call used cost more the first time?

    PYTHONPATH=. python3 profiling/gemm_first_use.py [--tiny] [--out DIR]

first_generate_profile.py found the first prefill step slower in torch linear than the
same step later, at a token count M no start-up step had run. The suspected
cause is cuBLAS choosing another kernel for that M band and CUDA loading its module on
first launch (lazy loading). This times ``F.linear`` over the distinct 2-D weight shapes
of the `mini` model, one fresh process, in three phases: (1) a first call at each M of a
probe list before anything else ran there, against its second call; (2) the prefill
warm-up's token ladder (engine/prefill_warmup.py) run once; (3) first calls at Ms between
the ladder's rungs, against their second calls. If (3)'s first-call excess is small
where (1)'s is large, the ladder loads the kernels unseen Ms need; run it again under
``CUDA_MODULE_LOADING=EAGER`` (recorded) to tell module loads from per-shape setup. Each first
call also records the cudaMallocs it made (fresh allocator segments for a new M's outputs), and
``--blas cublas|cublaslt`` picks torch's BLAS library, to tell the allocator and cuBLAS's
per-shape setup apart. The JSON goes to ``--out`` as ``gemm_first_use_<hardware>_<commit>[_<blas>].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from fastpath_bench import build, commit, sync  # noqa: E402

from deepinfer.engine.prefill_warmup import LADDER_TOKENS  # noqa: E402
from deepinfer.models.tiny import mini_config, tiny_config  # noqa: E402


def weight_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """Distinct (out, in) shapes of the model's 2-D floating-point weights."""
    return sorted({(int(p.shape[0]), int(p.shape[1])) for p in model.parameters() if p.dim() == 2 and p.is_floating_point()})


def _device_mallocs() -> int:
    """cudaMalloc calls the caching allocator made so far (0 on CPU)."""
    return torch.cuda.memory_stats().get("num_device_alloc", 0) if torch.cuda.is_available() else 0


def linear_ms(weights: list[torch.Tensor], m: int) -> tuple[float, int]:
    """Wall ms of one F.linear per weight at M = m tokens (synchronised), and the cudaMallocs
    in it (a new M's outputs may need fresh allocator segments: one cause to tell apart)."""
    x = {w.shape[1]: torch.randn(m, w.shape[1], device=w.device, dtype=w.dtype) for w in weights}
    sync()
    mallocs = _device_mallocs()
    t = time.perf_counter()
    for w in weights:
        F.linear(x[w.shape[1]], w)
    sync()
    return (time.perf_counter() - t) * 1e3, _device_mallocs() - mallocs


def first_and_second(weights: list[torch.Tensor], ms: list[int]) -> list[dict]:
    """Per M: the first call's ms, the second's, the excess and the first call's cudaMallocs."""
    rows = []
    for m in ms:
        (first, mallocs), (second, _) = linear_ms(weights, m), linear_ms(weights, m)
        rows.append({"m": m, "first_ms": round(first, 3), "second_ms": round(second, 3),
                     "excess_ms": round(first - second, 3), "first_mallocs": mallocs})
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU stand-in (tests of this script)")
    ap.add_argument("--out", default=os.environ.get("OUT", "artifacts"))
    ap.add_argument("--cold", default="800,1000,3000", help="Ms timed before anything else ran")
    ap.add_argument("--between", default="112,176,300,700,900,1200,1800,2300,3500,4500,7000",
                    help="Ms between the ladder's rungs, timed after it ran")
    ap.add_argument("--ladder-max", type=int, default=8192, help="the step budget the ladder stops at")
    ap.add_argument("--blas", choices=("default", "cublas", "cublaslt"), default="default",
                    help="torch.backends.cuda.preferred_blas_library for every GEMM (CUDA only)")
    args = ap.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    cfg = tiny_config(vocab_size=512) if args.tiny else mini_config()
    model = build(cfg, device)
    shapes = weight_shapes(model)
    weights = [torch.randn(*s, device=device, dtype=torch.bfloat16) for s in shapes]
    del model
    linear_ms(weights[:1], 1)  # the CUDA context and cuBLAS handle, outside every timed call
    cold = first_and_second(weights, [int(m) for m in args.cold.split(",")])
    ladder = [m for m in LADDER_TOKENS if m <= args.ladder_max]
    t = time.perf_counter()
    for m in ladder:
        linear_ms(weights, m)
    ladder_s = time.perf_counter() - t
    between = first_and_second(weights, [int(m) for m in args.between.split(",")])
    record = {"commit": commit(), "hardware": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
              "torch": torch.__version__, "blas": args.blas, "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING", "(default)"),
              "weight_shapes": [list(s) for s in shapes], "cold": cold, "ladder": ladder, "ladder_s": round(ladder_s, 3),
              "between": between,
              "cold_excess_ms": round(sum(r["excess_ms"] for r in cold), 3),
              "between_excess_ms": round(sum(r["excess_ms"] for r in between), 3)}
    os.makedirs(args.out, exist_ok=True)
    tag = record["hardware"].replace(" ", "_").lower()
    suffix = "" if args.blas == "default" else f"_{args.blas}"
    path = os.path.join(args.out, f"gemm_first_use_{tag}_{record['commit'][:7]}{suffix}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"{len(shapes)} weight shapes; CUDA_MODULE_LOADING={record['cuda_module_loading']}; blas {args.blas}")
    for name in ("cold", "between"):
        print(f"{name}: " + "  ".join(f"M={r['m']} {r['first_ms']}/{r['second_ms']} ({r['first_mallocs']} mallocs)"
                                      for r in record[name])
              + f"   excess {record[name + '_excess_ms']} ms")
    print(f"ladder {ladder[0]}..{ladder[-1]} ({len(ladder)} rungs) in {record['ladder_s']} s")
    print(path)
    return record


if __name__ == "__main__":
    main()
