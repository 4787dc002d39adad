"""Decode step time vs verify tokens per request: the curve the confidence-scheduled
verify budget uses (deepinfer/spec/scheduling.py, StepTimeCurve.from_profile).

    python profiling/spec_step_curve.py            # H200: `mini` + MTP layer, bf16, random weights
    python profiling/spec_step_curve.py --smoke    # CPU, tiny config, seconds

1. Greedy check on the device: speculation on (MTP, k=3) == off, token for token.
2. For batch B in (1, 16, 64) and verify size v in 1..6 per request: median wall time of a
   decode step that verifies v rows per request (random drafts, fixed length, so every
   step scores exactly B*v rows; v=1 is plain decode). Prints a table and writes JSON
   ({rows: [{batch, verify_per_request, step_ms, ...}]}) to $OUT or profiling/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.models.tiny import mini_config, tiny_config, write_tiny_checkpoint  # noqa: E402
from deepinfer.spec import RandomDrafter  # noqa: E402


def mini_mtp_config():
    return mini_config(num_nextn_predict_layers=1)


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def greedy_check(accel: str) -> str:
    path = tempfile.mkdtemp()
    write_tiny_checkpoint(path, seed=0, cfg=tiny_config(vocab_size=512, sliding_window=32))
    prompts = [[(5 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate((5, 40, 140, 77))]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(dtype="float32", accelerator=accel, max_model_len=512, max_num_seqs=8)
    off = LLM(path, **kw).generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    on_llm = LLM(path, num_speculative_tokens=3, **kw)
    on = on_llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    agree = sum(a.token_ids == b.token_ids for a, b in zip(off, on))
    return f"{agree}/{len(prompts)}"


def time_steps(llm: LLM, batch: int, v: int, steps: int, prompt_len: int) -> float:
    llm.runner.spec.k = v - 1
    llm.runner.spec.drafter = RandomDrafter(llm.model_config.vocab_size)
    times: list[float] = []
    orig = llm.step

    def timed(*a, **k):
        t = time.perf_counter()
        orig(*a, **k)
        if llm.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)

    llm.step = timed
    try:
        prompts = [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)]
        sp = SamplingParams(temperature=0, max_tokens=steps + 3, ignore_eos=True)
        llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    finally:
        llm.step = orig
    return statistics.median(times[3:]) if len(times) > 4 else statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU")
    ap.add_argument("--batches", default=None)
    ap.add_argument("--max-verify", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    accel = "cpu" if args.smoke or not torch.cuda.is_available() else "nvidia"
    batches = [int(b) for b in (args.batches or ("1,4" if args.smoke else "1,16,64")).split(",")]
    max_v = args.max_verify or (3 if args.smoke else 6)
    steps = args.steps or (4 if args.smoke else 16)
    res: dict = {"commit": commit(), "accelerator": accel,
                 "hardware": torch.cuda.get_device_name() if accel == "nvidia" else "cpu"}
    t = time.time()
    res["greedy_spec_equals_off"] = greedy_check(accel)
    print(f"greedy, speculation on (MTP k=3) == off: {res['greedy_spec_equals_off']} ({time.time() - t:.1f}s)")
    path = tempfile.mkdtemp()
    if args.smoke:
        cfg, dtype = tiny_config(vocab_size=512, sliding_window=32), "float32"
        write_tiny_checkpoint(path, seed=0, cfg=cfg)
        kw = dict(max_model_len=256, max_num_seqs=max(batches))
    else:
        cfg, dtype = mini_mtp_config(), "bfloat16"
        write_tiny_checkpoint(path, seed=0, cfg=cfg, dtype=torch.bfloat16)
        kw = dict(max_model_len=4096, max_num_seqs=max(batches), gpu_memory_utilization=0.5)
    res["config"] = cfg.to_dict()
    llm = LLM(path, dtype=dtype, accelerator=accel, num_speculative_tokens=max_v - 1, **kw)
    rows = []
    print(f"{'batch':>6} {'verify/req':>10} {'rows':>6} {'step ms':>9} {'ms/row':>8}")
    for b in batches:
        for v in range(1, max_v + 1):
            ms = 1e3 * time_steps(llm, b, v, steps, 32)
            rows.append({"batch": b, "verify_per_request": v, "step_ms": round(ms, 3), "rows": b * v})
            print(f"{b:>6} {v:>10} {b * v:>6} {ms:>9.2f} {ms / (b * v):>8.3f}")
    res["rows"] = rows
    os.makedirs(args.out, exist_ok=True)
    name = "spec_step_curve_smoke.json" if args.smoke else "spec_step_curve.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print("wrote", os.path.join(args.out, name))


if __name__ == "__main__":
    main()
