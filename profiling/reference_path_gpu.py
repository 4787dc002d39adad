"""Run the engine's reference (eager) path on a GPU: correctness against the CPU path
and where decode speed stands before compiled kernels.

    python profiling/reference_path_gpu.py [--out DIR]

1. deepinfer-tiny (float32): greedy outputs on cuda == on cpu, token for token.
2. KV cache sized from gpu_memory_utilization (blocks per group reported).
3. `mini` (REFERENCE.md section 5, bf16, random weights): decode tok/s at batch 1/16/64 and
   the roofline fraction of the weight bytes read per step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.tiny import mini_config, write_tiny_checkpoint

HBM_GBPS = 4200.0




def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def check_tiny(results: dict) -> None:
    path = tempfile.mkdtemp()
    write_tiny_checkpoint(path, seed=0)
    prompts = ["Hello, my name is", "The capital of France is", "x " * 150, "def f(n):"]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for acc in ("nvidia", "cpu"):
        llm = LLM(path, dtype="float32", accelerator=acc, max_model_len=1024, max_num_seqs=8)
        outs[acc] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        if acc == "nvidia":
            results["tiny_gpu_blocks"] = llm.kv_manager.pools["swa"].num_blocks
    agree = sum(a == b for a, b in zip(outs["nvidia"], outs["cpu"]))
    results["tiny_gpu_equals_cpu"] = f"{agree}/{len(prompts)}"


def bench_mini(results: dict) -> None:
    path = tempfile.mkdtemp()
    t = time.time()
    write_tiny_checkpoint(path, seed=0, cfg=mini_config(), dtype=torch.bfloat16)
    results["mini_write_s"] = round(time.time() - t, 1)
    llm = LLM(path, dtype="bfloat16", max_model_len=4096, max_num_seqs=64, gpu_memory_utilization=0.5)
    model = llm.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.cfg
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    inactive = cfg.num_hidden_layers * (cfg.n_routed_experts - cfg.num_experts_per_tok) * expert
    embed = cfg.vocab_size * cfg.hidden_size * 2
    active_bytes = total - inactive - embed
    results["mini_params"] = sum(p.numel() for p in model.parameters())
    rows = []
    for batch in (1, 16, 64):
        prompts = [[(7 * i + j) % 1000 + 10 for j in range(32)] for i in range(batch)]
        sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)  # warm up
        torch.cuda.synchronize()
        llm_steps_before = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - llm_steps_before
        decode_wall = max(o.metrics.finished_time for o in outs) - max(o.metrics.first_token_time for o in outs)
        tok_s = batch * 23 / decode_wall
        step_s = decode_wall / 23
        rows.append({"batch": batch, "decode_tok_s": round(tok_s, 1), "step_ms": round(step_s * 1e3, 2),
                     "gbps_weights": round(active_bytes / step_s / 1e9, 1),
                     "roofline_frac": round(active_bytes / step_s / 1e9 / HBM_GBPS, 4), "wall_s": round(wall, 2)})
    results["mini_decode"] = rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "profiling/results"))
    args = parser.parse_args()
    results = {"commit": commit(), "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    check_tiny(results)
    bench_mini(results)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "reference_path_gpu.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps({k: v for k, v in results.items() if k != "mini_decode"}))
    print(f"{'batch':>5} {'tok/s':>9} {'ms/step':>8} {'GB/s':>8} {'of 4.2TB/s':>10}")
    for r in results["mini_decode"]:
        print(f"{r['batch']:>5} {r['decode_tok_s']:>9} {r['step_ms']:>8} {r['gbps_weights']:>8} {r['roofline_frac']:>10}")


if __name__ == "__main__":
    main()
