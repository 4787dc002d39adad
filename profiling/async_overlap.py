#!/usr/bin/env python
"""Sync vs async scheduling: steps/s, host time per step, device idle between steps.

    python profiling/async_overlap.py                      # tiny model on CPU
    python profiling/async_overlap.py --model /ckpt --dtype bfloat16 --batch 64 --repeats 3

Each mode runs the same decode-heavy batch ``--repeats`` times, interleaved (sync, async,
sync, ...) so machine load hits both alike; medians are reported. Device intervals and host
time come from host clocks (deepinfer.profiling.overlap.StepClock: on CPU the async model
step runs in a worker thread, which torch's profiler does not record). A torch profiler
trace of a few steps of each mode is captured too; for sync mode its trace idle gaps
cross-check the clock-based ones. Writes profiling/results/async_overlap_<name>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from deepinfer.llm import LLM
from deepinfer.profiling.overlap import StepClock
from deepinfer.profiling.records import run_metadata
from deepinfer.profiling.trace import capture_trace
from deepinfer.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: embedded tiny model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=16, help="requests decoding together")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stop", action="store_true", help="give every request a stop string (detokenizer work)")
    p.add_argument("--name", default="cpu_tiny")
    p.add_argument("--out-dir", default=str(ROOT / "profiling" / "results"))
    p.add_argument("--trace-dir", default=str(ROOT / "artifacts" / "traces"))
    return p


def workload(args: argparse.Namespace) -> tuple[list[list[int]], SamplingParams]:
    ids = [[(7 * i + j) % 1000 + 2 for j in range(args.prompt_len)] for i in range(args.batch)]
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0,
                        stop=["\x00never\x00"] if args.stop else None)
    return ids, sp


def run_once(llm: LLM, ids: list[list[int]], sp: SamplingParams) -> dict[str, float]:
    rec = StepClock.attach(llm)
    try:
        llm.generate(prompt_token_ids=ids, sampling_params=sp, use_tqdm=False)
    finally:
        rec.detach()
    return rec.summary()


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    ids, sp = workload(args)
    kw = dict(dtype=args.dtype, max_model_len=args.prompt_len + args.output_len + 64, max_num_seqs=args.batch,
              max_num_batched_tokens=max(args.batch * args.prompt_len, 256))
    engines = {mode: LLM(args.model, async_scheduling=(mode == "async"), **kw) for mode in ("sync", "async")}
    outs = {}
    for mode, llm in engines.items():  # warm-up, and the outputs must agree
        outs[mode] = [o.token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=sp, use_tqdm=False)]
    assert outs["sync"] == outs["async"], "async and sync outputs differ"
    runs: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    for _ in range(args.repeats):
        for mode, llm in engines.items():
            runs[mode].append(run_once(llm, ids, sp))
    result: dict = {"meta": run_metadata(engines["async"], workload={
        "batch": args.batch, "prompt_len": args.prompt_len, "output_len": args.output_len, "greedy": True,
        "stop_strings": args.stop, "repeats": args.repeats}), "modes": {}}
    for mode, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        result["modes"][mode] = {"median": med, "runs": rs}
    for mode, llm in engines.items():  # profiler traces: host lanes in both modes, device lane in sync
        cap = capture_trace(llm, prompt_token_ids=ids, sampling_params=sp, num_steps=6, skip_steps=4,
                            out_dir=args.trace_dir, name=f"async_overlap_{args.name}_{mode}")
        steps, gaps = cap.steps, cap.gaps
        result["modes"][mode]["trace"] = {
            "path": os.path.relpath(cap.path, ROOT), "steps": int(len(steps)),
            "mean_step_ms": float(steps["step_ms"].mean()) if len(steps) else None,
            "mean_host_ms": float(steps["host_ms"].mean()) if len(steps) else None,
            "mean_idle_gap_ms": float(gaps["gap_ms"].mean()) if len(gaps) else None,
            "device_lane": bool((cap.events["kind"] == "device").any()),
        }
    s, a = result["modes"]["sync"]["median"], result["modes"]["async"]["median"]
    result["speedup_steps_per_s"] = a["steps_per_s"] / s["steps_per_s"]
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"async_overlap_{args.name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    keys = ("steps_per_s", "mean_device_step_ms", "mean_gap_ms", "gap_pct_of_step", "host_ms_per_step",
            "device_busy_frac")
    print(f"{'':8}" + "".join(f"{k:>22}" for k in keys))
    for mode in ("sync", "async"):
        m = result["modes"][mode]["median"]
        print(f"{mode:8}" + "".join(f"{m[k]:22.3f}" for k in keys))
    print(f"async/sync steps/s: {result['speedup_steps_per_s']:.3f}; wrote {path}")
    return result


if __name__ == "__main__":
    main()
