#!/usr/bin/env python
"""Write the `mini` DeepSeek-V4 checkpoint (REFERENCE.md section 5) and sweep it.

    python benchmarks/mini_sweep.py --ckpt /tmp/mini --name mini-h200 --out-dir profiling/results

`mini` = hidden 1024, 8 layers, 16 heads x 512, q_lora 512, o_groups 4, o_lora 256,
64 experts x 512 top-6, indexer 16 x 128 top-512, window 128, vocab 129,280 (1.17B
parameters, no MTP stage; random weights, bf16). Layer schedule as transformers' default: 2 x HCA, then
HCA/CSA alternating; 3 hash-routed MoE layers. Every argument this script does not know
goes to benchmarks/sweep.py, whose defaults here are the GPU sweep of the results folder.
``--smoke`` shrinks the widths so the whole path can be checked on a CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import torch

from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint
from deepinfer.models.v4.config import DeepseekV4Config

HERE = Path(__file__).resolve().parent
GPU_SWEEP = ["--dtype", "bfloat16", "--max-model-len", "4096", "--workload", "datasets/workloads/mini_chat.jsonl",
             "--prefill-budgets", "1024,2048,4096,8192", "--decode-batch-sizes", "1,4,16,64",
             "--concurrency", "8", "--num-requests", "8", "--time-budget", "150"]


def mini_config(smoke: bool = False) -> DeepseekV4Config:
    """The `mini` architecture; ``smoke`` keeps its schedule with tiny widths."""
    n = 8
    ratios = [128, 128] + [4 if i % 2 else 128 for i in range(n - 2)]
    widths = dict(hidden_size=1024, num_attention_heads=16, head_dim=512, qk_rope_head_dim=64, q_lora_rank=512,
                  o_groups=4, o_lora_rank=256, n_routed_experts=64, moe_intermediate_size=512, index_n_heads=16,
                  index_head_dim=128, index_topk=512)
    if smoke:
        widths.update(hidden_size=64, num_attention_heads=4, head_dim=32, qk_rope_head_dim=16, q_lora_rank=32,
                      o_groups=2, o_lora_rank=16, n_routed_experts=8, moe_intermediate_size=32, index_n_heads=4,
                      index_head_dim=16, index_topk=8)
    return tiny_config(num_hidden_layers=n, compress_ratios=ratios, num_experts_per_tok=6 if not smoke else 2,
                       num_hash_layers=3, sliding_window=128, torch_dtype="bfloat16", num_nextn_predict_layers=0,
                       **widths)


def main(argv: list[str] | None = None) -> int:
    """Write the checkpoint unless it exists, then run the sweep CLI on it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", default="/tmp/deepinfer-mini")
    parser.add_argument("--smoke", action="store_true", help="tiny widths, float32, CPU-sized sweep")
    args, rest = parser.parse_known_args(argv)
    cfg = mini_config(smoke=args.smoke)
    if not os.path.exists(os.path.join(args.ckpt, "model.safetensors.index.json")):
        dtype = torch.float32 if args.smoke else torch.bfloat16
        write_tiny_checkpoint(args.ckpt, seed=0, cfg=cfg, dtype=dtype)
    spec = importlib.util.spec_from_file_location("deepinfer_sweep_cli", HERE / "sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    base = ["--model", args.ckpt] + ([] if args.smoke else GPU_SWEEP)
    return sweep.main(base + rest)


if __name__ == "__main__":
    sys.exit(main())
