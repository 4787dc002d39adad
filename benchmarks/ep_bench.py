"""Expert-parallel prefill and decode with balanced or skewed routing, before and after EPLB.

    python benchmarks/ep_bench.py                       # CPU: 2 gloo ranks, `mini-cpu` config
    python benchmarks/ep_bench.py --ranks 4 --size mini --dtype bfloat16 \
        --decode-batch-per-rank 256 --prefill-len 8192        # GPUs (issue 11)
    python benchmarks/ep_bench.py --ranks 2 --size flash4w --routing balanced ...

A random checkpoint (``mini``: 64 experts, ``flash4w``: two V4-Flash-width layers with 256
experts; top-6) is written. ``--routing skewed`` (default) forces hot experts: H experts
that the default contiguous placement keeps only on rank 0 are favoured by every router
(the worst case for a static layout: one straggler rank); ``balanced`` keeps the random
weights' near-uniform routing. Prefill runs ``--prefill-requests`` prompts (default one per
rank) of ``--prefill-len`` tokens; decode ``--decode-batch-per-rank`` x ranks requests.
Each phase reports tok/s in total and per GPU and each rank's all-to-all time per step
(``DEEPINFER_EP_TIMING``: CUDA events on GPUs).
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
from deepinfer.parallel.skew import EP_SIZES, mini_like_config, write_skewed_checkpoint


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
    llm.comm_stats()  # reset the all-to-all totals
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        walls.append(time.perf_counter() - start)
    wall = float(np.median(walls))
    comm = llm.comm_stats()
    load = llm.expert_load()
    steps = load["total_steps"] - steps_before
    rank = load["rank"][-steps:] if steps <= load["rank"].shape[0] else load["rank"]
    per_layer = imbalance(rank)
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(o.token_ids) for o in outs)
    tok_s = (prompt_tokens if name == "prefill" else output_tokens) / wall
    ranks = len(comm)
    a2a = [None if c is None else round(c["seconds"] / max(1, steps) * 1e3, 4) for c in comm]
    return {"phase": name, "requests": len(prompts), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "steps": steps, "wall_s": round(wall, 3), "walls_s": [round(w, 3) for w in walls],
            "tok_s": round(tok_s, 1), "tok_s_per_rank": round(tok_s / ranks, 1),
            "a2a_ms_per_step": a2a, "a2a_calls": [c and c["calls"] for c in comm],
            "a2a_bytes": [c and c["bytes"] for c in comm],
            "imbalance_max_over_mean": round(float(per_layer.mean()), 4),
            "imbalance_per_layer": [round(float(v), 4) for v in per_layer],
            "rank_tokens": rank.sum(axis=(0, 1)).tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--size", choices=EP_SIZES, default="mini-cpu")
    ap.add_argument("--routing", choices=["skewed", "balanced"], default="skewed")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--hot", type=int, default=4, help="forced hot experts (held only by rank 0 at start)")
    ap.add_argument("--redundant", type=int, default=None, help="redundant slots (default: 4 per rank)")
    ap.add_argument("--prefill-requests", type=int, default=None, help="default: one per rank")
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--decode-requests", type=int, default=None, help="total (default: 24 per rank)")
    ap.add_argument("--decode-batch-per-rank", type=int, default=None, help="decode requests per rank")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per phase (median reported)")
    ap.add_argument("--out", default=os.environ.get("OUT", "profiling/results"))
    args = ap.parse_args()
    os.environ.setdefault("DEEPINFER_EP_TIMING", "1")  # the ranks inherit it: all-to-all time per step
    redundant = 4 * args.ranks if args.redundant is None else args.redundant
    n_prefill = args.prefill_requests or args.ranks
    per_rank = args.decode_batch_per_rank or (args.decode_requests or 24 * args.ranks) // args.ranks
    n_decode = args.decode_requests or per_rank * args.ranks
    cfg = mini_like_config(args.size)
    path = tempfile.mkdtemp(prefix="ep_bench_")
    dtype = getattr(torch, args.dtype)
    # worst case for a static layout: the hot experts live only on rank 0
    start = ExpertPlacement.default(cfg.num_hidden_layers, cfg.n_routed_experts, args.ranks, redundant)
    counts = start.replica_counts()[0]
    hot = [e for e in start.rank_experts(0, 0) if counts[e] == 1][: args.hot] if args.routing == "skewed" else []
    write_skewed_checkpoint(path, cfg, hot=hot, seed=0, dtype=dtype)
    rng = random.Random(0)
    vocab = cfg.vocab_size
    prefill = [[rng.randrange(vocab) for _ in range(args.prefill_len)] for _ in range(n_prefill)]
    decode = [[rng.randrange(vocab) for _ in range(8)] for _ in range(n_decode)]
    p_prefill = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    p_decode = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    engine_kw = dict(dtype=args.dtype, max_model_len=max(1024, args.prefill_len + 64), max_num_seqs=max(64, per_rank),
                     max_num_batched_tokens=max(2048, args.prefill_len),
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
                print(f"{stage:>6} {name:>7}: {row['tok_s']:>9} tok/s ({row['tok_s_per_rank']} per rank)  imbalance "
                      f"{row['imbalance_max_over_mean']:.3f}  a2a ms/step {row['a2a_ms_per_step']}  steps {row['steps']}"
                      f"  median wall {row['wall_s']} s of {row['walls_s']}")
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
    tag = "" if args.routing == "skewed" else "_balanced"
    out = os.path.join(args.out, f"ep_bench_{args.size}{tag}_{device}_r{args.ranks}_b{per_rank}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=lambda o: o.tolist() if isinstance(o, np.ndarray) else str(o))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
