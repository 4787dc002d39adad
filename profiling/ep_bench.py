"""Expert-parallel prefill and decode with skewed routing, before and after EPLB.

    python profiling/ep_bench.py                       # CPU: 2 gloo ranks, `mini-cpu` config
    python profiling/ep_bench.py --ranks 4 --size mini --dtype bfloat16   # GPUs (issue 11)

A random checkpoint (64 experts, top-6) is written with forced hot experts: H experts that
the default contiguous placement keeps only on rank 0 are favoured by every router (the
worst case for a static layout: one straggler rank).
The engine runs `LLM(data_parallel_size=N, expert_parallel_size=N)` with redundant
slots; each phase (prefill: prompts with one output token; decode: short prompts with
many output tokens) is timed, and its imbalance is read from the recorded per-step slot
loads: sum over steps of the max rank load / sum of the mean rank load (1.0 = even).
Then EPLB rebalances from the recorded window (weights move in place) and the phases
run again. Results (commit, hardware, full config) go to profiling/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.parallel.placement import ExpertPlacement, imbalance
from deepinfer.parallel.skew import mini_like_config, write_skewed_checkpoint


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def hardware() -> dict[str, Any]:
    info = {"machine": platform.machine(), "cpu_count": os.cpu_count(), "torch": torch.__version__}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def run_phase(llm: LLM, name: str, prompts: list[list[int]], params: SamplingParams, repeats: int
              ) -> dict[str, Any]:
    """Time ``repeats`` generate() calls (median wall) and read the imbalance of exactly
    their steps from the EPLB window."""
    steps_before = llm.expert_load()["total_steps"]
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        walls.append(time.perf_counter() - start)
    wall = float(np.median(walls))
    load = llm.expert_load()
    steps = load["total_steps"] - steps_before
    rank = load["rank"][-steps:] if steps <= load["rank"].shape[0] else load["rank"]
    per_layer = imbalance(rank)
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(o.token_ids) for o in outs)
    return {"phase": name, "requests": len(prompts), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "steps": steps, "wall_s": round(wall, 3), "walls_s": [round(w, 3) for w in walls],
            "tok_s": round((prompt_tokens if name == "prefill" else output_tokens) / wall, 1),
            "imbalance_max_over_mean": round(float(per_layer.mean()), 4),
            "imbalance_per_layer": [round(float(v), 4) for v in per_layer],
            "rank_tokens": rank.sum(axis=(0, 1)).tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--size", choices=["mini-cpu", "mini"], default="mini-cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--hot", type=int, default=4, help="forced hot experts (held only by rank 0 at start)")
    ap.add_argument("--redundant", type=int, default=None, help="redundant slots (default: 4 per rank)")
    ap.add_argument("--prefill-requests", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--decode-requests", type=int, default=48)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per phase (median reported)")
    ap.add_argument("--out", default=os.environ.get("OUT", "profiling/results"))
    args = ap.parse_args()
    redundant = 4 * args.ranks if args.redundant is None else args.redundant
    cfg = mini_like_config(args.size)
    path = tempfile.mkdtemp(prefix="ep_bench_")
    dtype = getattr(torch, args.dtype)
    # worst case for a static layout: the hot experts live only on rank 0
    start = ExpertPlacement.default(cfg.num_hidden_layers, cfg.n_routed_experts, args.ranks, redundant)
    counts = start.replica_counts()[0]
    hot = [e for e in start.rank_experts(0, 0) if counts[e] == 1][: args.hot]
    write_skewed_checkpoint(path, cfg, hot=hot, seed=0, dtype=dtype)
    rng = random.Random(0)
    vocab = cfg.vocab_size
    prefill = [[rng.randrange(vocab) for _ in range(args.prefill_len)] for _ in range(args.prefill_requests)]
    decode = [[rng.randrange(vocab) for _ in range(8)] for _ in range(args.decode_requests)]
    p_prefill = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    p_decode = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    engine_kw = dict(dtype=args.dtype, max_model_len=max(1024, args.prefill_len + 64), max_num_seqs=64,
                     enable_prefix_caching=False,  # repeats must recompute their prompts
                     data_parallel_size=args.ranks, expert_parallel_size=args.ranks, num_redundant_experts=redundant,
                     eplb_window_size=4096)
    t0 = time.perf_counter()
    llm = LLM(path, **engine_kw)
    startup = time.perf_counter() - t0
    rows, outputs = [], {}
    try:
        llm.generate(prompt_token_ids=decode[:2], sampling_params=SamplingParams(temperature=0, max_tokens=2),
                     use_tqdm=False)  # warm-up
        for stage in ("before", "after"):
            if stage == "after":
                report = llm.rebalance()
            for name, prompts, params in (("prefill", prefill, p_prefill), ("decode", decode, p_decode)):
                row = run_phase(llm, name, prompts, params, args.repeats)
                rows.append({"eplb": stage, **row})
                print(f"{stage:>6} {name:>7}: {row['tok_s']:>9} tok/s  imbalance {row['imbalance_max_over_mean']:.3f}"
                      f"  steps {row['steps']}  median wall {row['wall_s']} s of {row['walls_s']}")
            outs = llm.generate(prompt_token_ids=decode, sampling_params=p_decode, use_tqdm=False)
            outputs[stage] = [o.token_ids for o in outs]
        placement = llm.placement
    finally:
        llm.shutdown()
    same = outputs["before"] == outputs["after"]
    print(f"rebalance: predicted imbalance {report.imbalance_before:.3f} -> {report.imbalance_after:.3f}, "
          f"{report.experts_moved} expert copies moved in {report.seconds:.2f} s; greedy outputs unchanged: {same}")
    result = {"command": "python " + " ".join(sys.argv), "commit": commit(), "hardware": hardware(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "args": vars(args), "num_redundant_experts": redundant, "engine": engine_kw,
              "model_config": cfg.to_dict(), "startup_s": round(startup, 2), "phases": rows,
              "rebalance": {k: v for k, v in vars(report).items()}, "outputs_unchanged_by_rebalance": same,
              "hot_experts": hot, "replicas_after": placement.replica_counts()[:, hot].tolist()}
    os.makedirs(args.out, exist_ok=True)
    device = "gpu" if torch.cuda.is_available() else "cpu"
    out = os.path.join(args.out, f"ep_bench_{args.size}_{device}_r{args.ranks}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=lambda o: o.tolist() if isinstance(o, np.ndarray) else str(o))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
