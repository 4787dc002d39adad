"""Decode step time vs verify rows per request: the curve the confidence-scheduled verify
budget loads (deepinfer/spec/step_curve.py finds the JSON by hardware + model signature).

    python benchmarks/spec_step_curve.py            # GPU: `mini` + 1 MTP layer, bf16, random weights (~2-3 min)
    python benchmarks/spec_step_curve.py --smoke    # CPU, tiny config, seconds

1. Greedy checks on the device, speculation on (k=3) == off token for token: tiny V4 with
   its MTP stage, tiny V4.1 with its DSpark drafter under a compact bounded replay.
2. Per batch B (1, 16, 64): B requests (32-token prompts) are prefilled once; then for
   every verify size v = 1..6 per request the drafts are set to v - 1 random tokens
   (fixed length; v = 1 is a plain decode step through the same speculative path), one
   warm-up step, then ``--steps`` timed engine steps (device synced), whose verify rows
   are checked to be exactly B * v. Verify steps always run the eager reference forward:
   the fast path / CUDA graphs only take pure one-token decode steps, so this is the
   curve such steps really follow. The whole sweep stops at ``--budget-s`` (the JSON then
   says ``complete: false``).
3. JSON (commit, hardware, model signature, config, rows of batch / verify_per_request /
   step_ms with estimated weight bytes and FLOPs and their roofline fractions of one
   H200's ceilings, REFERENCE.md section 5) to $OUT or profiling/results; the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.engine.request import Request  # noqa: E402
from deepinfer.models.tiny import mini_config, tiny_config, tiny_v41_config, write_tiny_checkpoint  # noqa: E402
from deepinfer.profiling.records import git_commit  # noqa: E402
from deepinfer.spec import RandomDrafter  # noqa: E402
from deepinfer.spec.step_curve import curve_record  # noqa: E402

HBM_BYTES_S, PEAK_FLOP_S = 4.2e12, 800e12  # one H200 (REFERENCE.md section 5)
PROMPT_LEN = 32


def greedy_check(accel: str, cfg, **extra) -> str:
    """Greedy output with speculation (k=3, the checkpoint's drafter) == without, on ``accel``."""
    path = tempfile.mkdtemp()
    write_tiny_checkpoint(path, seed=0, cfg=cfg)
    prompts = [[(5 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate((5, 40, 140, 77))]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(dtype="float32", accelerator=accel, max_model_len=512, max_num_seqs=8, **extra)
    off = LLM(path, **kw).generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    on = LLM(path, num_speculative_tokens=3, **kw).generate(prompt_token_ids=prompts, sampling_params=sp,
                                                             use_tqdm=False)
    return f"{sum(a.token_ids == b.token_ids for a, b in zip(off, on))}/{len(prompts)}"


def weight_costs(model) -> tuple[int, int, int, int, int, int]:
    """(dense bytes, one routed expert's bytes, dense params, expert params, experts, top-k):
    every parameter but the MTP stages, the embedding and the routed experts is read each step."""
    skip = {id(p) for p in model.mtp.parameters()} | {id(model.embed.weight)}
    routed = {id(p) for layer in model.layers for ex in layer.ffn.experts for p in ex.parameters()}
    dense = [p for p in model.parameters() if id(p) not in skip and id(p) not in routed]
    ex = model.layers[0].ffn.experts[0]
    e_params = sum(p.numel() for p in ex.parameters())
    return (sum(p.numel() * p.element_size() for p in dense), e_params * ex.w1.weight.element_size(),
            sum(p.numel() for p in dense), e_params, model.cfg.n_routed_experts, model.cfg.num_experts_per_tok)


def roofline(costs: tuple, layers: int, rows: int, seconds: float) -> dict:
    """Estimated weight bytes (distinct experts `rows` tokens touch under uniform routing) and
    FLOPs (2 x active params per row; attention and KV reads ignored: contexts are ~40-60)."""
    dense_b, expert_b, dense_p, expert_p, n_exp, top_k = costs
    distinct = n_exp * (1 - (1 - top_k / n_exp) ** rows)
    bytes_moved = dense_b + layers * distinct * expert_b
    flops = 2 * rows * (dense_p + layers * top_k * expert_p)
    return {"est_weight_gb": round(bytes_moved / 1e9, 3), "gb_s": round(bytes_moved / seconds / 1e9, 1),
            "hbm_frac": round(bytes_moved / seconds / HBM_BYTES_S, 4),
            "tflop_s": round(flops / seconds / 1e12, 3), "peak_frac": round(flops / seconds / PEAK_FLOP_S, 5)}


def timed_step(llm: LLM) -> float:
    t = time.perf_counter()
    llm.step()
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def measure_batch(llm: LLM, batch: int, max_v: int, steps: int, deadline: float, costs: tuple) -> list[dict]:
    """Prefill ``batch`` requests once, then time each verify size (see the module docstring)."""
    spec, sched = llm.runner.spec, llm.scheduler
    sp = SamplingParams(temperature=0, max_tokens=llm.config.max_model_len - PROMPT_LEN - 1, ignore_eos=True)
    reqs = [Request(f"curve-{batch}-{i}", [(7 * i + j) % 1000 + 10 for j in range(PROMPT_LEN)], sp, eos_token_id=1)
            for i in range(batch)]
    for r in reqs:
        sched.add_request(r)
    rows: list[dict] = []
    try:
        while sched.waiting or any(r.num_output_tokens == 0 for r in reqs):  # prefill (chunks) until all decode
            llm.step()
        for v in range(1, max_v + 1):
            if time.perf_counter() > deadline:
                break
            spec.k = v - 1  # RandomDrafter proposes exactly k drafts; attach keeps them (fixed length)
            timed_step(llm)  # warm-up: its drafts were attached under the previous k
            timed_step(llm)  # warm-up at the new verify shape (first use: graph capture, kernel compiles)
            times, verified = [], []
            for _ in range(steps):
                times.append(timed_step(llm))
                verified.append(spec.metrics.history[-1]["verify_tokens"])
            if set(verified) != {batch * v}:
                raise RuntimeError(f"batch {batch}, verify {v}: steps verified {verified} rows, not {batch * v}")
            s = statistics.median(times)
            rows.append({"batch": batch, "verify_per_request": v, "rows": batch * v, "step_ms": round(1e3 * s, 3),
                         "step_ms_all": [round(1e3 * t, 3) for t in times],
                         **roofline(costs, llm.model_config.num_hidden_layers, batch * v, s)})
    finally:
        for r in reqs:
            sched.abort(r.req_id)
    return rows


def main(argv: list[str] | None = None) -> str:
    """Run the sweep; returns the JSON's path."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU (seconds)")
    ap.add_argument("--batches", default=None, help="comma list (default 1,16,64; smoke 1,4)")
    ap.add_argument("--max-verify", type=int, default=None, help="largest verify rows per request (default 6)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per point after one warm-up (default 2)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop starting new points after this many seconds")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "profiling", "results"))
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    accel = "cpu" if args.smoke or not torch.cuda.is_available() else "nvidia"
    batches = [int(b) for b in (args.batches or ("1,4" if args.smoke else "1,16,64")).split(",")]
    max_v = args.max_verify or (3 if args.smoke else 6)
    steps = args.steps or 2
    commit, dirty = git_commit()
    res: dict = {"commit": commit, "dirty": dirty, "accelerator": accel, "torch": torch.__version__,
                 "prompt_len": PROMPT_LEN, "timed_steps_per_point": steps, "drafter": "RandomDrafter (fixed length)"}
    t = time.perf_counter()
    res["greedy_spec_equals_off"] = greedy_check(accel, tiny_config(vocab_size=512, sliding_window=32))
    res["greedy_spec_equals_off_v41_dspark"] = greedy_check(  # V4.1 DSpark under a compact bounded replay
        accel, tiny_v41_config(vocab_size=512, sliding_window=32), swa_replay_mode="compact", swa_replay_keep=40)
    print(f"greedy, speculation on (k=3) == off: V4 MTP {res['greedy_spec_equals_off']}, V4.1 DSpark "
          f"{res['greedy_spec_equals_off_v41_dspark']} ({time.perf_counter() - t:.1f}s)")
    path = tempfile.mkdtemp()
    if args.smoke:
        cfg, dtype = tiny_config(vocab_size=512, sliding_window=32), "float32"
        write_tiny_checkpoint(path, seed=0, cfg=cfg)
        kw = dict(max_model_len=256)
    else:
        cfg, dtype = mini_config(num_nextn_predict_layers=1), "bfloat16"
        write_tiny_checkpoint(path, seed=0, cfg=cfg, dtype=torch.bfloat16)
        kw = dict(max_model_len=1024, gpu_memory_utilization=0.5)
    llm = LLM(path, dtype=dtype, accelerator=accel, num_speculative_tokens=max_v - 1, async_scheduling=False,
              max_num_seqs=max(batches), max_num_batched_tokens=max(max(batches) * max(PROMPT_LEN, max_v), 256), **kw)
    llm.runner.spec.drafter = RandomDrafter(llm.model_config.vocab_size)
    res.update(curve_record(llm, []), config=cfg.to_dict(), engine_config=llm.config.to_dict())
    costs = weight_costs(llm.model)
    os.makedirs(args.out, exist_ok=True)
    # smoke files are not named spec_step_curve_*.json: the engine never loads them
    name = "smoke_spec_step_curve.json" if args.smoke else \
        f"spec_step_curve_{res['hardware'].replace(' ', '_').lower()}_mini.json"
    deadline, rows = t_start + args.budget_s, []
    for b in batches:  # the JSON is rewritten after every batch: a killed run keeps what it measured
        rows += measure_batch(llm, b, max_v, steps, deadline, costs)
        res.update(rows=rows, complete=len(rows) == len(batches) * max_v,
                   wall_s=round(time.perf_counter() - t_start, 1))
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(res, f, indent=1, default=str)
    print(f"wrote {os.path.join(args.out, name)} (complete: {res['complete']}, {res['wall_s']} s)")
    print(f"{'batch':>6} {'verify/req':>10} {'rows':>6} {'step ms':>9} {'ms/row':>8} {'GB/s':>8} {'HBM':>7} {'TFLOP/s':>8} "
          f"{'peak':>7}")
    for r in rows:
        print(f"{r['batch']:>6} {r['verify_per_request']:>10} {r['rows']:>6} {r['step_ms']:>9.2f} "
              f"{r['step_ms'] / r['rows']:>8.3f} {r['gb_s']:>8.1f} {r['hbm_frac']:>7.2%} {r['tflop_s']:>8.3f} "
              f"{r['peak_frac']:>7.3%}")
    return os.path.join(args.out, name)


if __name__ == "__main__":
    main()
