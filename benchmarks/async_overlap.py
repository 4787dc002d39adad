#!/usr/bin/env python
"""Sync vs async scheduling on a decode batch: device idle between consecutive steps (as %
of the step), host time per step and decode tok/s, from torch profiler traces.

    python benchmarks/async_overlap.py                                  # tiny model, CPU
    PYTHONPATH=. python3 benchmarks/async_overlap.py --size mini --batch 64   # one H200, < 3 min

``--size mini`` writes `mini` (REFERENCE.md section 5) with random bf16 weights and runs
it on CUDA with the fast path and CUDA graphs. For each mode (one engine per mode, same
workload, greedy): a warm-up run (graph capture, outputs of the two modes must agree),
``--repeats`` timed runs with the profiler off (interleaved: sync, async, sync, ...), then
one traced run whose decode steps give the timeline figures
(deepinfer/profiling/overlap.py: a GPU event counts in the step that launched it). Writes
``$OUT/async_overlap_<name>.json`` (commit, hardware, config, both modes' summaries and
a compact 3-step timeline each, for notebook 03); the traces themselves go to --trace-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from deepinfer.llm import LLM
from deepinfer.profiling.overlap import compact_timeline, overlap_summary
from deepinfer.profiling.records import run_metadata
from deepinfer.profiling.trace import capture_trace
from deepinfer.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
HBM_GBPS, BF16_TFLOPS = 4200.0, 800.0  # one H200 (REFERENCE.md section 5)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=("tiny", "mini", "mini_v41"), default="tiny",
                   help="tiny: the embedded model (float32, CPU); mini / mini_v41: random bf16 V4 / V4.1 "
                        "weights at mini widths (CUDA)")
    p.add_argument("--batch", type=int, default=16, help="requests decoding together")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--trace-steps", type=int, default=10, help="decode steps in each traced window")
    p.add_argument("--name", default=None, help="result name (default: <size>_<device>_b<batch>)")
    p.add_argument("--out-dir", default=os.environ.get("OUT", str(ROOT / "profiling" / "results")))
    p.add_argument("--trace-dir", default=os.path.join(tempfile.gettempdir(), "deepinfer_traces"))
    return p


def build_engines(args: argparse.Namespace) -> dict[str, LLM]:
    kw: dict = dict(max_model_len=args.prompt_len + args.output_len + 64, max_num_seqs=args.batch,
                    max_num_batched_tokens=max(args.batch * args.prompt_len, 256), enable_prefix_caching=False)
    model = None
    if args.size in ("mini", "mini_v41"):
        from deepinfer.models.tiny import mini_config, write_tiny_checkpoint

        if args.size == "mini_v41":
            sys.path.insert(0, str(ROOT / "benchmarks"))
            from v41_bounded_replay import mini_v41_config as mini_config  # noqa: F811
        model = tempfile.mkdtemp(prefix=f"{args.size}_")
        write_tiny_checkpoint(model, seed=0, cfg=mini_config(), dtype=torch.bfloat16)
        kw.update(dtype="bfloat16")  # the KV pool is capped at what batch x max_model_len needs
    else:
        kw.update(dtype="float32")
    return {mode: LLM(model, async_scheduling=(mode == "async"), **kw) for mode in ("sync", "async")}


def workload(args: argparse.Namespace) -> tuple[list[list[int]], SamplingParams]:
    ids = [[(7 * i + j) % 1000 + 2 for j in range(args.prompt_len)] for i in range(args.batch)]
    return ids, SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)


def sync_device(llm: LLM) -> None:
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)


def timed(llm: LLM, ids: list[list[int]], sp: SamplingParams) -> dict[str, float]:
    """Decode tok/s and ms per decode step (from the last first token to the last finish)."""
    sync_device(llm)
    outs = llm.generate(prompt_token_ids=ids, sampling_params=sp, use_tqdm=False)
    sync_device(llm)
    wall = max(o.metrics.finished_time for o in outs) - max(o.metrics.first_token_time for o in outs)
    steps = sp.max_tokens - 1
    return {"decode_tok_s": len(ids) * steps / wall, "decode_step_ms": wall / steps * 1e3}


def active_weights(llm: LLM) -> tuple[int, int]:
    """(bytes, params) a decode step reads at batch 1: all weights but the embedding table
    and the routed experts a token does not pick (a lower bound at larger batches)."""
    cfg = llm.model_config
    params = sum(p.numel() for p in llm.model.parameters())
    itemsize = next(llm.model.parameters()).element_size()
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    inactive = cfg.num_hidden_layers * (cfg.n_routed_experts - cfg.num_experts_per_tok) * expert
    active = params - inactive - cfg.vocab_size * cfg.hidden_size
    return active * itemsize, active


def traced(llm: LLM, ids: list[list[int]], sp: SamplingParams, args: argparse.Namespace, mode: str) -> dict:
    skip = 4  # prefill and the first decode steps stay out of the window
    cap = capture_trace(llm, prompt_token_ids=ids, sampling_params=sp, num_steps=args.trace_steps, skip_steps=skip,
                        warmup_steps=2, out_dir=args.trace_dir, name=f"async_overlap_{args.name}_{mode}")
    summary = overlap_summary(cap.events, skip_steps=1, skip_last=1)
    merge_us = 5.0 if llm.device.type == "cuda" else 200.0  # a CPU "device" op stream has wider gaps
    return {"summary": summary, "timeline": compact_timeline(cap.events, num_steps=3, merge_us=merge_us),
            "trace_path": cap.path,
            "traced_steps": int(len(cap.steps))}


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    t0 = time.time()
    engines = build_engines(args)
    device = engines["sync"].device
    args.name = args.name or f"{args.size}_{device.type}_b{args.batch}"
    ids, sp = workload(args)
    outs = {mode: [o.token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=sp, use_tqdm=False)]
            for mode, llm in engines.items()}  # warm-up: graph capture, kernel compilation
    same = outs["sync"] == outs["async"]
    runs: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    for _ in range(args.repeats):
        for mode, llm in engines.items():
            runs[mode].append(timed(llm, ids, sp))
    wbytes, wparams = active_weights(engines["sync"])
    result: dict = {"meta": run_metadata(engines["async"], workload={
        "batch": args.batch, "prompt_len": args.prompt_len, "output_len": args.output_len, "greedy": True,
        "repeats": args.repeats, "trace_steps": args.trace_steps, "size": args.size}),
        "outputs_equal": same, "active_weight_bytes": wbytes, "modes": {}}
    for mode, llm in engines.items():
        med = {k: statistics.median(r[k] for r in runs[mode]) for k in runs[mode][0]}
        step_s = med["decode_step_ms"] / 1e3
        med["gbps_active_weights"] = wbytes / step_s / 1e9
        med["hbm_roofline_frac"] = med["gbps_active_weights"] / HBM_GBPS
        med["tflops"] = 2 * wparams * args.batch / step_s / 1e12
        med["bf16_peak_frac"] = med["tflops"] / BF16_TFLOPS
        result["modes"][mode] = {"timed_median": med, "timed_runs": runs[mode], **traced(llm, ids, sp, args, mode)}
        if llm.async_loop is not None:
            result["modes"][mode]["async_stats"] = llm.async_loop.stats.as_dict()
        if llm.runner.fast is not None:
            result["modes"][mode]["fast_path_stats"] = dict(llm.runner.fast.stats)
    s, a = (result["modes"][m]["timed_median"] for m in ("sync", "async"))
    result["async_over_sync_decode_tok_s"] = a["decode_tok_s"] / s["decode_tok_s"]
    result["wall_s"] = time.time() - t0
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"async_overlap_{args.name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"outputs equal: {same}; async/sync decode tok/s: {result['async_over_sync_decode_tok_s']:.3f}; "
          f"wall {result['wall_s']:.0f} s; wrote {path}")
    cols = ("decode_tok_s", "decode_step_ms", "gbps_active_weights", "hbm_roofline_frac", "tflops", "bf16_peak_frac")
    trace_cols = ("mean_device_period_ms", "mean_gap_ms", "gap_pct_of_step", "device_busy_frac", "host_ms_per_step",
                  "wait_ms_per_step")
    print(f"{'mode':6}" + "".join(f"{c:>22}" for c in cols + trace_cols))
    for mode in ("sync", "async"):
        m, t = result["modes"][mode]["timed_median"], result["modes"][mode]["summary"]
        print(f"{mode:6}" + "".join(f"{m[c]:22.4f}" for c in cols) + "".join(f"{t.get(c, float('nan')):22.4f}"
                                                                             for c in trace_cols))
    return result


if __name__ == "__main__":
    main()
