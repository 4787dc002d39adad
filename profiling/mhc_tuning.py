"""Sweep the launch shape of the fused mHC kernels (kernels/mhc.py) on a GPU.

    PYTHONPATH=. python3 profiling/mhc_tuning.py [--out DIR] [--baseline build/mhc_old.py]
    PYTHONPATH=. python3 profiling/mhc_tuning.py --large     # prefill sizes: the tensor-core mix kernel

Decode steps are latency-bound: the mHC kernels run 2 x layers + 1 times per step, so a
few microseconds per call are a large share of a small model's step. For `mini`
(hidden 1024) and V4-Flash (hidden 4096) widths, at T = 1 / 64 / 256 / 2048 tokens, this
times ``hc_post_pre`` (+ the sublayer norm, the common call) replayed from a CUDA graph
for each :class:`~deepinfer_kernels.mhc.MhcTuning` candidate (stage 1: split x mix
warps; stage 2: the finish kernel's rows per program x warps around the best split),
checks every candidate against the torch reference, and times an optional baseline
module (an older deepinfer_kernels/mhc.py) the same way. Prints a table; writes mhc_tuning.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))  # kernel_bench is a benchmark

import torch  # noqa: E402

import kernel_bench as kb  # noqa: E402
from deepinfer_kernels import mhc  # noqa: E402

N, ITERS = 4, 20
WIDTHS = {"mini": 1024, "flash": 4096}
TOKENS = (1, 64, 256, 2048)
LARGE_TOKENS = (512, 2048, 8192)


def inputs(t: int, h: int, dev: str) -> tuple:
    g = torch.Generator(device="cpu").manual_seed(1000 * t + h)
    mix = (2 + N) * N
    fn = (torch.randn(mix, N * h, generator=g) * 0.05).to(dev)
    base, scale = (torch.randn(mix, generator=g) * 0.5).to(dev), (torch.rand(3, generator=g) + 0.5).to(dev)
    norm = ((torch.rand(h, generator=g) + 0.5).to(dev), 1e-6)
    streams = (torch.randn(t, N, h, generator=g) * 2).to(torch.bfloat16).to(dev)
    out = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
    post, comb, _ = mhc.hc_pre_ref(streams, fn, base, scale, ITERS, 1e-6, 1e-6)
    return out, streams, post, comb, fn, base, scale, norm


def run_case(module, args: tuple) -> tuple:
    out, streams, post, comb, fn, base, scale, norm = args
    return module.hc_post_pre(out, streams, post, comb, fn, base, scale, ITERS, 1e-6, 1e-6, norm)


def max_err(got: tuple, ref: tuple) -> float:
    return max(kb.rel_err(a.float(), b.float()) for a, b in zip(got[1:], ref[1:]))


def time_us(module, args: tuple) -> float:
    return kb.graph_time(lambda: run_case(module, args)) * 1e3


def kernel_breakdown(args: tuple, tuning: dict) -> dict[str, float]:
    """Device time per kernel per call (torch profiler over 50 eager calls): which of the
    two launches the time goes to."""
    from torch.profiler import ProfilerActivity, profile

    fields = {k: v for k, v in tuning.items() if k in vars(mhc.TUNING)}
    with mhc.tuned(**fields):
        for _ in range(3):
            run_case(mhc, args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(50):
                run_case(mhc, args)
            torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if ("_mix" in ev.key or "_finish" in ev.key) and ev.self_cpu_time_total == 0:
            out[ev.key] = round(ev.device_time_total / 50, 2)
    return out


def sweep(candidates: list[dict], cases: dict, rows: list) -> dict:
    """Time every candidate on every case; return the one with the least summed time."""
    best, best_total = None, float("inf")
    for cand in candidates:
        per = {}
        try:
            with mhc.tuned(**cand):
                for key, (args, ref) in cases.items():
                    err = max_err(run_case(mhc, args), ref)
                    per[key] = {"us": round(time_us(mhc, args), 2), "rel_err": err, "ok": err < 2e-2}
        except Exception as e:  # a shape Triton cannot compile: recorded, not fatal
            rows.append({"tuning": cand, "error": repr(e)[:300], "ok": False})
            print(f"{cand} failed: {e!r}"[:200], flush=True)
            continue
        total = sum(v["us"] for v in per.values())
        rows.append({"tuning": cand, "cases": per, "total_us": round(total, 2),
                     "ok": all(v["ok"] for v in per.values())})
        print(f"{cand} total {total:.1f} us ok={rows[-1]['ok']}", flush=True)
        if rows[-1]["ok"] and total < best_total:
            best, best_total = cand, total
    return best or {}


def large(out_dir: str) -> None:
    """Prefill-sized steps (T = 512 / 2048 / 8192): the tensor-core dot mix kernel's shape
    (stage A: rows per program x warps; stage B: columns per program x K tile), against the
    IEEE float32 dot kernel (``tc_terms=0``) on the same cases."""
    t0 = time.time()
    cases = {}
    for (wname, h), t in itertools.product(WIDTHS.items(), LARGE_TOKENS):
        a = inputs(t, h, "cuda")
        cases[f"{wname} T={t}"] = (a, mhc.hc_post_pre_ref(*a[:7], ITERS, 1e-6, 1e-6, a[7]))
    rows: list = []
    sweep([{"tc_terms": 0}, {}], cases, rows)  # the IEEE kernel, the shipped default
    stage_a = [dict(tc_block_t=bt, tc_warps=w, tc_block_k=bk) for bt in (16, 32, 64) for w in (4, 8) for bk in (32, 64)]
    best_a = sweep(stage_a, cases, rows)
    stage_b = [dict(best_a, tc_split=s, tc_stages=st) for s in (256, 512, 1024, 2048) for st in (1, 2, 3)]
    best = sweep(stage_b, cases, rows)
    res = {"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "commit": os.environ.get("DEEPINFER_COMMIT", "unknown"), "wall_s": round(time.time() - t0, 1),
                    "timing": "CUDA graph replay, per call; hc_post_pre + norm, bf16, prefill-sized T"},
           "default": dict(vars(mhc.TUNING)), "best": dict(vars(mhc.TUNING), **best), "rows": rows}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "mhc_tuning_large.json"), "w") as f:
        json.dump(res, f, indent=1)
    ok = [r for r in rows if r.get("ok")]
    best_row = min(ok, key=lambda r: r["total_us"])

    def us(row: dict, key: str) -> float:
        return row.get("cases", {}).get(key, {}).get("us", float("nan"))

    print(f"\n{'case':16s} {'ieee us':>9s} {'default us':>11s} {'best us':>9s} {'GB/s':>6s}")
    for key in cases:  # bytes: read streams (+ out), write the new streams, bf16
        t, h = int(key.split("T=")[1]), WIDTHS[key.split()[0]]
        gb_s = (2 * N + 1) * t * h * 2 / (us(best_row, key) * 1e-6) / 1e9
        print(f"{key:16s} {us(rows[0], key):9.1f} {us(rows[1], key):11.1f} {us(best_row, key):9.1f} {gb_s:6.0f}")
    print("best:", best_row["tuning"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="profiling/results")
    ap.add_argument("--baseline", default=None, help="path of an older deepinfer_kernels/mhc.py to time alongside")
    ap.add_argument("--large", action="store_true", help="sweep the prefill-sized (tensor-core) mix kernel")
    args = ap.parse_args()
    if args.large:
        return large(args.out)
    dev = "cuda"
    t0 = time.time()
    cases = {}
    for (wname, h), t in itertools.product(WIDTHS.items(), TOKENS):
        a = inputs(t, h, dev)
        out, streams, post, comb, fn, base, scale, norm = a
        ref = mhc.hc_post_pre_ref(out, streams, post, comb, fn, base, scale, ITERS, 1e-6, 1e-6, norm)
        cases[f"{wname} T={t}"] = (a, ref)
    rows: list = []
    base_row = {}
    if args.baseline:
        spec = importlib.util.spec_from_file_location("mhc_baseline", args.baseline)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        for key, (a, ref) in cases.items():
            base_row[key] = {"us": round(time_us(old, a), 2), "rel_err": max_err(run_case(old, a), ref)}
        print("baseline", {k: v["us"] for k, v in base_row.items()}, flush=True)
    sweep([{}], cases, rows)  # the shipped default first
    dot_only = dict(rows_max_t=0, tc_min_t=1 << 30)  # the IEEE dot kernel at every T of this sweep
    stage1 = [dict(dot_only, split=s, large_split=s, mix_warps=w) for s in (64, 128, 256, 512) for w in (2, 4)]
    b1 = sweep(stage1, cases, rows)
    # the row mix kernel for decode-sized steps: columns and tokens per program, warps
    stage_rows = [dict(b1, rows_max_t=64, rows_split=s, rows_per_program=r, rows_warps=w)
                  for s in (64, 128, 256) for r in (1, 2, 4, 8) for w in (1, 2, 4)]
    b_rows = sweep(stage_rows, cases, rows)
    stage2 = [dict(b_rows, finish_block_t=bt, finish_warps=w, finish_splits=fs, finish_one_pass=op)
              for bt in (1, 2, 4) for w in (1, 2, 4) for fs in (16, 64) for op in (0, 4096)]
    best = sweep(stage2, cases, rows)
    breakdown = {key: kernel_breakdown(cases[key][0], dict(vars(mhc.TUNING), **best)) for key in cases
                 if key.endswith(("T=1", "T=64"))}
    print("per-kernel us per call (best):", json.dumps(breakdown), flush=True)
    default = dict(vars(mhc.TUNING))
    res = {"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "commit": os.environ.get("DEEPINFER_COMMIT", "unknown"), "wall_s": round(time.time() - t0, 1),
                    "timing": "CUDA graph replay of 10 calls, median of 20, per call; hc_post_pre + norm, bf16"},
           "default": default, "best": dict(default, **best), "baseline": base_row, "rows": rows,
           "kernel_breakdown_best": breakdown}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mhc_tuning.json"), "w") as f:
        json.dump(res, f, indent=1)
    best_row = min((r for r in rows if r["ok"]), key=lambda r: r["total_us"])
    def_row = rows[0] if rows[0]["ok"] else None
    print(f"\n{'case':16s} {'baseline us':>12s} {'default us':>11s} {'best us':>9s}")
    for key in cases:
        b = base_row.get(key, {}).get("us", float("nan"))
        d = def_row["cases"][key]["us"] if def_row else float("nan")
        print(f"{key:16s} {b:12.2f} {d:11.2f} {best_row['cases'][key]['us']:9.2f}")
    print("best:", best_row["tuning"])


if __name__ == "__main__":
    main()
