"""Where a speculative step's host time goes: wall time of the engine's and the
speculative runner's step functions per engine step, through `LLM.generate` on the trained
default (off, MTP, DSpark: the configurations of `spec_h200.py`), greedy, after a warm-up.

    PYTHONPATH=. python3 benchmarks/spec_host_phases.py [--configs off,mtp-k1,dspark-k5-fixed]
        [--batches 1,16] [--tokens 128] [--out DIR] [--tiny]   # --tiny: CPU smoke run (tests)

The table is per steady decode step: a 1-token run of the same batch (its prefill) is
timed first and its time and calls are taken out. Nested timers overlap (``spec execute`` contains ``verify forward`` and ``draft``). The
``copy wait`` rows are where the host waits for the device: a step whose other rows add
up to most of its time is host-bound. Also writes a cProfile of each timed run
(a second run, ``spec_host_phases_<label>_b<batch>.pstats``) and prints its top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from host_phases import CALLS, TIMERS, wrap  # noqa: E402
from spec_h200 import CONFIGS, commit, doc_prompts, engine, greedy, sync  # noqa: E402


def instrument() -> list[tuple[object, str, object]]:
    """Wrap the step's functions with accumulating timers (host_phases.wrap); returns the
    originals, for `restore`."""
    import deepinfer.spec.runner as spec_runner
    from deepinfer.engine.core import EngineCore
    from deepinfer.engine.model_runner import ModelRunner
    from deepinfer.engine.scheduler import Scheduler
    from deepinfer.engine.transfer import HostResult
    from deepinfer.metrics import MetricsCollector
    from deepinfer.models.fast.runner import FastPath
    from deepinfer.models.fast.verify_graphs import VerifyGraphs
    from deepinfer.spec.dspark_drafter import DSparkDrafter
    from deepinfer.spec.mtp_drafter import MTPDrafter
    from deepinfer.spec.mtp_graphs import MTPStageGraphs
    from deepinfer.spec.plan_ahead import SpeculativePlanner
    from deepinfer.engine.async_engine import AsyncStepLoop
    from deepinfer.engine.token_buffer import DeviceTokenBuffer

    targets = [
        (EngineCore, "step", "step (all)"), (AsyncStepLoop, "step", "async loop step"),
        (Scheduler, "schedule", "schedule"), (SpeculativePlanner, "device_step_ok", "  planner.device_step_ok"),
        (ModelRunner, "launch", "launch"), (ModelRunner, "build_batch", "  build_batch"),
        (ModelRunner, "sample", "sample (spec execute)"), (spec_runner.SpecDecoder, "launch", "  spec.launch"),
        (spec_runner.SpecDecoder, "_launch_lane", "  spec._launch_lane"),
        (spec_runner.SpecDecoder, "collect", "  spec.collect"),
        (DeviceTokenBuffer, "fill", "  token_buffer.fill"), (DeviceTokenBuffer, "record_verify", "  record_verify"),
        (spec_runner.SpecDecoder, "_forward", "  verify forward"), (VerifyGraphs, "run", "    VerifyGraphs.run"),
        (FastPath, "_host_inputs", "    fast._host_inputs"),
        (spec_runner, "greedy_verify_result", "  greedy_verify_result"),
        (spec_runner.SpecDecoder, "_record", "  spec metrics record"),
        (MTPDrafter, "propose", "  draft (MTP)"), (MTPDrafter, "draft_after_verify", "  MTP draft_after_verify"), (MTPStageGraphs, "run", "    MTPStageGraphs.run"),
        (DSparkDrafter, "propose", "  draft (DSpark)"), (DSparkDrafter, "_write_features", "    DSpark features"),
        (DSparkDrafter, "_propose_graphed", "    DSpark graphed pass"),
        (HostResult, "wait", "copy wait (device sync)"), (torch.cuda.CUDAGraph, "replay", "graph replay"),
        (Scheduler, "update", "scheduler.update"), (spec_runner.SpecDecoder, "attach", "spec.attach"),
        (EngineCore, "process_outputs", "process_outputs"), (MetricsCollector, "record_step", "metrics.record_step"),
    ]
    originals = [(owner, attr, owner.__dict__[attr]) for owner, attr, _ in targets]
    for owner, attr, label in targets:
        wrap(owner, attr, label)
    return originals


STEPS: list[dict] = []  # per async loop step of the timed run: start, duration, the timers inside it


def trace_steps() -> tuple[object, str, object]:
    """Record each async loop step's wall time and what its timers spent (``STEPS``), so a
    run's slow steps are named, not averaged away. Wraps the already-timed step."""
    from deepinfer.engine.async_engine import AsyncStepLoop

    fn = AsyncStepLoop.__dict__["step"]

    def step(self):
        before, t = dict(TIMERS), time.perf_counter()
        try:
            return fn(self)
        finally:
            STEPS.append({"t": t, "ms": (time.perf_counter() - t) * 1e3,
                          "inside_ms": {k: round((v - before.get(k, 0.0)) * 1e3, 3)
                                        for k, v in TIMERS.items() if v - before.get(k, 0.0) > 5e-5}})

    AsyncStepLoop.step = step
    return AsyncStepLoop, "step", fn


def slow_steps(outs: list, t0: float, n: int) -> dict:
    """The ``n`` slowest steps (index, ms, the timers inside) and where the first token and
    the finish fell (ms from the generate call) against the step starts."""
    slow = sorted(range(len(STEPS)), key=lambda i: -STEPS[i]["ms"])[:n]
    first = min(o.metrics.first_token_time for o in outs)
    return {"step_ms": [round(s["ms"], 3) for s in STEPS],
            "first_token_ms": round((first - t0) * 1e3, 3),
            "finished_ms": round((max(o.metrics.finished_time for o in outs) - t0) * 1e3, 3),
            "steps_before_first_token": sum(1 for s in STEPS if s["t"] < first),
            "slowest": [{"step": i, "ms": round(STEPS[i]["ms"], 3), "start_ms": round((STEPS[i]["t"] - t0) * 1e3, 3),
                         "inside_ms": STEPS[i]["inside_ms"]} for i in slow]}


def restore(originals: list[tuple[object, str, object]]) -> None:
    for owner, attr, fn in originals:
        setattr(owner, attr, fn)


def top_functions(prof: cProfile.Profile, n: int) -> list[str]:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(n)
    return [line for line in s.getvalue().splitlines() if line.strip()][-n:]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "profiling", "results"))
    ap.add_argument("--configs", default="off,mtp-k1,dspark-k5-fixed")
    ap.add_argument("--batches", default=None)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--top", type=int, default=25, help="cProfile rows printed per run")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: batches 1/2, 6 tokens")
    args = ap.parse_args(argv)
    labels = args.configs.split(",")
    bad = [c for c in labels if c not in CONFIGS]
    if bad:
        ap.error(f"--configs: unknown {bad}; allowed: {', '.join(CONFIGS)}")
    args.batches = [int(b) for b in (args.batches or ("1,2" if args.tiny else "1,16")).split(",")]
    args.tokens = args.tokens or (6 if args.tiny else 128)
    args.dtype, args.max_model_len = "auto", 512
    prompts = doc_prompts(2 if args.tiny else 8, 400)
    originals = instrument()
    originals.append(trace_steps())
    try:
        return _run(args, labels, prompts)
    finally:
        restore(originals)


def _run(args: argparse.Namespace, labels: list[str], prompts: list[str]) -> dict:
    os.makedirs(args.out, exist_ok=True)
    res: dict = {"commit": commit(), "hardware": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                 "torch": torch.__version__, "args": vars(args) | {"out": None}, "runs": {}}
    for label in labels:
        llm = engine(label, args)
        for b in args.batches:
            batch = [prompts[i % len(prompts)] for i in range(b)]
            llm.generate(batch, greedy(min(args.tokens, 16)), use_tqdm=False)
            TIMERS.clear()
            CALLS.clear()
            sync()
            t0 = time.perf_counter()
            llm.generate(batch, greedy(1), use_tqdm=False)  # the prefill alone: subtracted below
            sync()
            prefill_wall, prefill_timers, prefill_calls = time.perf_counter() - t0, dict(TIMERS), dict(CALLS)
            TIMERS.clear()
            CALLS.clear()
            STEPS.clear()
            sync()
            t0 = time.perf_counter()
            outs = llm.generate(batch, greedy(args.tokens), use_tqdm=False)
            sync()
            wall = time.perf_counter() - t0
            steps = max(1, CALLS["step (all)"])
            timers, calls = dict(TIMERS), dict(CALLS)
            timeline = slow_steps(outs, t0, 5)
            decode_steps = max(1, steps - prefill_calls.get("step (all)", 0))
            prof = cProfile.Profile()  # a second run, profiled: its times are inflated
            prof.enable()
            llm.generate(batch, greedy(args.tokens), use_tqdm=False)
            prof.disable()
            name = f"spec_host_phases_{label}_b{b}"
            prof.dump_stats(os.path.join(args.out, name + ".pstats"))
            tokens = sum(len(o.token_ids) for o in outs)
            res["runs"][f"{label} b{b}"] = {
                "config": label, "batch": b, "steps": steps, "step_us": round(wall / steps * 1e6, 1),
                "tokens_per_step": round(tokens / steps, 3),
                # steady decode: the 1-token run's (prefill) time and calls taken out
                "decode_steps": decode_steps, "decode_step_us": round((wall - prefill_wall) / decode_steps * 1e6, 1),
                "decode_us_per_step": {k: round((v - prefill_timers.get(k, 0.0)) / decode_steps * 1e6, 1)
                                       for k, v in timers.items()},
                "us_per_step": {k: round(v / steps * 1e6, 1) for k, v in timers.items()},
                "calls_per_step": {k: round(calls[k] / steps, 2) for k in timers},
                "timeline": timeline, "cprofile_top": top_functions(prof, args.top)}
        del llm
        gc.collect()
    path = os.path.join(args.out, f"spec_host_phases_{res['commit'][:7]}{'_tiny' if args.tiny else ''}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    for key, run in res["runs"].items():
        print(f"\n== {key}: cProfile top by own time (profiler on: times inflated)")
        print("\n".join(run["cprofile_top"]))
    for key, run in res["runs"].items():
        tl = run["timeline"]
        print(f"\n== {key}: first token at {tl['first_token_ms']} ms (after {tl['steps_before_first_token']} steps), "
              f"finished at {tl['finished_ms']} ms; slowest steps:")
        for s in tl["slowest"]:
            inside = sorted(s["inside_ms"].items(), key=lambda kv: -kv[1])[:6]
            print(f"  step {s['step']:>3} at {s['start_ms']:>8} ms: {s['ms']:>7} ms  " + ", ".join(f"{k.strip()} {v}" for k, v in inside))
    runs = list(res["runs"].values())
    keys = list(dict.fromkeys(k for r in runs for k in r["us_per_step"]))
    print(f"\n{'us per decode step (no prefill)':32}"
          + "".join(f"{r['config'][:12] + ' b' + str(r['batch']):>18}" for r in runs))
    for key in ("step_us", "decode_step_us", "tokens_per_step"):
        print(f"{key:32}" + "".join(f"{r[key]:>18}" for r in runs))
    for key in keys:
        print(f"{key:32}" + "".join(f"{r['decode_us_per_step'].get(key, 0):>18.0f}" for r in runs))
    print(path)
    return res


if __name__ == "__main__":
    main()
