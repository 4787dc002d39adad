"""Where a decode step's host time goes, without a profiler's overhead: wall time of the
engine's step functions per decode step, on the `mini` config (random bf16) or a model dir.

    PYTHONPATH=. python3 benchmarks/host_phases.py [--size mini] [--batches 1,64] [--tokens 128] [--out DIR]

Wraps the functions below with perf_counter accumulators (nested ones overlap: `launch`
contains `prepare` and `graph replay`), runs a greedy decode of ``--tokens`` tokens per
request at each batch size after a warm-up of the same shape, and reports microseconds
per engine step (the prefill step is amortised over ``--tokens`` steps) beside the step
time (all steps, and the median period between pure-decode step starts) and
the GPU time of one replayed decode graph. With async scheduling the host work of
step N+1 overlaps the GPU's step N, so a step takes about max(host, GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(ROOT, "profiling", "results")  # every run's record lives there, studies' too
sys.path.insert(0, os.path.join(ROOT, "profiling"))  # fastpath_check / fastpath_roofline: checks and studies live there
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from deepinfer import SamplingParams  # noqa: E402

TIMERS: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def wrap(owner: type, attr: str, label: str) -> None:
    fn = getattr(owner, attr)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMERS[label] += time.perf_counter() - t
            CALLS[label] += 1

    setattr(owner, attr, timed)


def instrument() -> None:
    from deepinfer.engine.async_engine import AsyncStepLoop
    from deepinfer.engine.model_runner import ModelRunner
    from deepinfer.engine.sampler import Sampler, SamplingTensors
    from deepinfer.engine.scheduler import Scheduler
    from deepinfer.engine.token_buffer import DeviceTokenBuffer
    from deepinfer.engine.transfer import ResultCopier
    from deepinfer.engine.core import EngineCore
    from deepinfer.metrics import MetricsCollector
    from deepinfer.models.fast.runner import FastPath

    for owner, attr, label in [
        (AsyncStepLoop, "step", "step (all)"), (Scheduler, "schedule", "schedule"),
        (ModelRunner, "launch", "launch"), (ModelRunner, "build_batch", "  build_batch"),
        (DeviceTokenBuffer, "fill", "    token_buffer.fill"), (FastPath, "prepare", "  fast.prepare"),
        (FastPath, "_host_inputs", "    _host_inputs"), (FastPath, "run", "  fast.run"),
        (torch.cuda.CUDAGraph, "replay", "    graph replay"), (ModelRunner, "sample", "sample"),
        (SamplingTensors, "from_params", "  SamplingTensors.from_params"), (Sampler, "sample", "  Sampler.sample"),
        (DeviceTokenBuffer, "record", "  token_buffer.record"), (ResultCopier, "start", "  ResultCopier.start"),
        (AsyncStepLoop, "_apply", "apply (collect + update)"), (ModelRunner, "collect", "  collect"),
        (Scheduler, "update", "  scheduler.update"), (EngineCore, "process_outputs", "  process_outputs"),
        (MetricsCollector, "record_step", "metrics.record_step"),
    ]:
        wrap(owner, attr, label)


def build_llm(size: str, max_seqs: int, device: str):
    import fastpath_bench as fb

    cfg = {"mini": fb.mini_config, "tiny": lambda: fb.tiny_sizes()["mini"]()}[size]()
    model = fb.build(cfg, device)
    cfg_dir = tempfile.mkdtemp(prefix=f"{size}_cfg_")
    with open(os.path.join(cfg_dir, "config.json"), "w") as f:
        json.dump({**cfg.to_official_json(), "deepinfer_tokenizer": "bundled"}, f)  # random ids: the bundled tokenizer, on purpose
    return fb.PrebuiltLLM(model, cfg_dir, dtype="bfloat16", max_model_len=1024, max_num_seqs=max_seqs,
                          enable_prefix_caching=False, kv_cache_memory_bytes=4 << 30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="mini")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=os.environ.get("OUT", RESULTS))
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (no graphs)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    cuda = args.device == "cuda"
    llm = build_llm(args.size, max(batches), args.device)
    instrument()
    vocab = llm.model_config.vocab_size
    rows = {}
    for b in batches:
        prompts = [[(7 * i + 13 * j) % (vocab - 2) + 2 for j in range(32)] for i in range(b)]
        sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)  # warm-up: graphs, compiles
        TIMERS.clear()
        CALLS.clear()
        llm.metrics.reset()
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        sync()
        wall = time.perf_counter() - t0
        steps = CALLS["step (all)"]
        gpu_us = float("nan")
        fast = llm.runner.fast
        if cuda and fast is not None and fast._graphs:  # the last captured graph: this batch's bucket
            graph = list(fast._graphs.values())[-1][0]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                graph.replay()
            end.record()
            sync()
            gpu_us = start.elapsed_time(end) / 20 * 1e3
        df = llm.metrics.steps_df()
        period = df["t_start_s"].diff()  # async: a step's own span overlaps its neighbours; starts are a period apart
        decode = period[(df["prefill_tokens"] == 0) & (df["prefill_tokens"].shift() == 0)]
        median = float(decode.median()) * 1e6 if len(decode) else float("nan")
        rows[b] = {"step_us": wall / steps * 1e6, "median_decode_step_us": median, "steps": steps, "graph_gpu_us": gpu_us,
                   "us_per_step": {k: v / steps * 1e6 for k, v in TIMERS.items()},
                   "calls_per_step": {k: CALLS[k] / steps for k in TIMERS}}
    meta = {"device": torch.cuda.get_device_name() if cuda else "cpu", "size": args.size, "tokens": args.tokens,
            "commit": os.environ.get("DEEPINFER_COMMIT", "unknown"), "torch": torch.__version__}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"host_phases_{args.size}.json"), "w") as f:
        json.dump({"meta": meta, "batches": rows}, f, indent=1)
    labels = list(rows[batches[0]]["us_per_step"])
    print(f"{'us per engine step':34}" + "".join(f"{'B=' + str(b):>10}" for b in batches))
    for key in ("step_us", "median_decode_step_us", "graph_gpu_us"):
        print(f"{key:34}" + "".join(f"{rows[b][key]:>10.0f}" for b in batches))
    for lab in labels:
        print(f"{lab:34}" + "".join(f"{rows[b]['us_per_step'].get(lab, 0):>10.0f}" for b in batches))


if __name__ == "__main__":
    main()
