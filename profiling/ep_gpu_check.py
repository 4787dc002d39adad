"""Expert parallelism on GPUs: EP + DP outputs == single-GPU outputs (greedy, mixed batch),
before and after a live EPLB rebalance. Issue 11's correctness check.

    python profiling/ep_gpu_check.py --ranks 2 [--size mini] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.parallel.placement import ExpertPlacement
from deepinfer.parallel.skew import mini_like_config, write_skewed_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--size", default="mini", choices=["mini", "mini-cpu"])
    ap.add_argument("--out", default=os.environ.get("OUT", "profiling/results"))
    args = ap.parse_args()
    cfg = mini_like_config(args.size)
    path = tempfile.mkdtemp()
    start = ExpertPlacement.default(cfg.num_hidden_layers, cfg.n_routed_experts, args.ranks, 4 * args.ranks)
    counts = start.replica_counts()[0]
    hot = [e for e in start.rank_experts(0, 0) if counts[e] == 1][:4]
    write_skewed_checkpoint(path, cfg, hot=hot, seed=0, dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    rng = random.Random(0)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in (5, 129, 300, 17, 700, 64, 1, 200)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(dtype="bfloat16" if torch.cuda.is_available() else "float32", max_model_len=2048, max_num_seqs=16, max_num_batched_tokens=512)
    t = time.time()
    single = LLM(path, **kw)
    ref = [o.token_ids for o in single.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)]
    single_s = time.time() - t
    del single
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.empty_cache()
    result = {"ranks": args.ranks, "size": args.size, "gpus": torch.cuda.device_count() if gpu else 0,
              "gpu": torch.cuda.get_device_name(0) if gpu else "cpu (gloo)", "single_s": round(single_s, 1)}
    t = time.time()
    ep = LLM(path, data_parallel_size=args.ranks, expert_parallel_size=args.ranks,
             num_redundant_experts=4 * args.ranks, **kw)
    try:
        before = [o.token_ids for o in ep.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)]
        report = ep.rebalance()
        after = [o.token_ids for o in ep.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)]
    finally:
        ep.shutdown()
    result.update(ep_s=round(time.time() - t, 1),
                  equal_before=sum(a == b for a, b in zip(before, ref)),
                  equal_after=sum(a == b for a, b in zip(after, ref)), prompts=len(prompts),
                  rebalance_s=round(report.seconds, 3), experts_moved=report.experts_moved,
                  imbalance_predicted=[round(report.imbalance_before, 3), round(report.imbalance_after, 3)])
    print(json.dumps(result))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"ep_gpu_check_r{args.ranks}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
