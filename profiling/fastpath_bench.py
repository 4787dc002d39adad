"""GPU fast path (deepinfer/models/fast) vs the reference path on `mini` (REFERENCE.md
section 5, bf16, random weights), in one process on one LLM (the runner's fast path is
switched per phase: reference = ``runner.fast = None``; eager = graphs off).

    python profiling/fastpath_bench.py [--out DIR]

(a) correctness: a mixed batch (prompt lengths 1..600, greedy, 16 tokens) through the
    reference path and through the fast path with CUDA graphs; per-step float32 logits
    of the sampled rows compared (relative Frobenius error, steps where both runs fed the
    same tokens) and greedy token agreement;
(b) decode speed at batch 1 / 16 / 64 (32-token prompts, 24 new tokens): fast eager and
    fast + CUDA graphs (reference timed at batch 1 only; batch 16 / 64 from
    profiling/results/reference_path_gpu_h200.json: ~1.4 s per step), tok/s, ms/step,
    GB/s of the active weight bytes against 4.2 TB/s, and the ratio to HF transformers
    eager generate() (REFERENCE.md section 5: 20 tok/s batch 1, ~315 batch 16, ~1,300 batch 64);
(c) JSON under --out (fastpath_bench.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_path_gpu import HBM_GBPS, commit, mini_config  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.models.fast.runner import FastPath  # noqa: E402
from deepinfer.models.tiny import write_tiny_checkpoint  # noqa: E402

HF_TOK_S = {1: 20.0, 16: 315.0, 64: 1300.0}
REF_TOK_S = {1: 11.8, 16: 32.2, 64: 45.7}  # reference_path_gpu_h200.json


def set_mode(llm, fast, mode: str) -> None:
    llm.runner.fast = None if mode == "reference" else fast
    if fast is not None:
        fast.graphs_enabled = mode == "graphs"


def record_logits(llm) -> list:
    steps: list = []
    sample = llm.runner.sampler.sample

    def wrapped(logits, params):
        steps.append(logits.float().cpu())
        return sample(logits, params)

    llm.runner.sampler.sample = wrapped
    return steps


def compare(ra, rb) -> dict:
    """Per-row float32 logits error on rows whose tokens so far agree in both runs, greedy
    agreement, and the reference's margin (in logits std) where greedy first differs."""
    (ta, la), (tb, lb) = ra, rb
    errs, first_step, margins = [], [], []
    for step, (a, b) in enumerate(zip(la, lb)):
        if a.shape != b.shape:
            break
        for r in range(a.shape[0]):
            if ta[r][:step] == tb[r][:step]:
                e = float((a[r] - b[r]).norm() / a[r].norm())
                errs.append(e)
                if step == 1:
                    first_step.append(e)
                if step < len(ta[r]) and ta[r][step] != tb[r][step]:
                    margins.append(float((a[r, ta[r][step]] - a[r, tb[r][step]]) / a[r].std()))
    agree = sum(x == y for s, t in zip(ta, tb) for x, y in zip(s, t))
    return {"greedy_token_agreement": f"{agree}/{sum(len(s) for s in ta)}",
            "first_divergence": [next((k for k, (x, y) in enumerate(zip(s, t)) if x != y), None) for s, t in zip(ta, tb)],
            "row_logits_rel_err_max": max(errs) if errs else None,
            "row_logits_rel_err_mean": sum(errs) / len(errs) if errs else None,
            "first_decode_step_rel_err_max": max(first_step) if first_step else None,
            "divergence_margins_in_std": [round(m, 4) for m in margins], "rows_compared": len(errs)}


def check(llm, fast, results: dict) -> None:
    lens = (1, 17, 64, 130, 300, 600)
    prompts = [[(11 * i + 5 * j) % 5000 + 10 for j in range(n)] for i, n in enumerate(lens)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = {}
    for mode in ("reference", "eager", "graphs"):
        set_mode(llm, fast, mode)
        prev = llm.runner.sampler.sample  # the async engine's hook, if any: chained, then restored
        steps = record_logits(llm)
        try:
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        finally:
            llm.runner.sampler.sample = prev
        runs[mode] = ([o.token_ids for o in outs], steps)
    results["check"] = {"prompt_lens": list(lens), "new_tokens": 16, "fast_stats": dict(fast.stats),
                        "reference_vs_eager": compare(runs["reference"], runs["eager"]),
                        "reference_vs_graphs": compare(runs["reference"], runs["graphs"]),
                        "eager_vs_graphs": compare(runs["eager"], runs["graphs"])}
    print("check:", json.dumps(results["check"]), flush=True)


def breakdown(llm, fast, results: dict) -> None:
    """Host wall time (synchronized) of the fast path's pieces over eager decode steps at batch 16."""
    import deepinfer.models.fast.decode as dec
    import deepinfer.models.fast.moe as fmoe

    acc: dict = {}

    def timer(name, fn):
        def wrapped(*a, **k):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = fn(*a, **k)
            torch.cuda.synchronize()
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t
            return out
        return wrapped

    saved = (dec.attention_decode, dec.compressor_decode, fmoe.moe_forward, dict(vars(fast.ops)))
    dec.attention_decode = timer("attention_decode", dec.attention_decode)
    dec.compressor_decode = timer("compressor_decode", dec.compressor_decode)
    fmoe.moe_forward = timer("moe_forward", fmoe.moe_forward)
    for n in ("decode_attention", "indexer_topk", "router", "fused_moe"):
        setattr(fast.ops, n, timer(n, getattr(fast.ops, n)))
    set_mode(llm, fast, "eager")
    try:
        prompts = [[(7 * i + j) % 1000 + 10 for j in range(32)] for i in range(16)]
        t = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=9,
                     ignore_eos=True), use_tqdm=False)
        acc["generate_total"] = time.perf_counter() - t
    finally:
        dec.attention_decode, dec.compressor_decode, fmoe.moe_forward = saved[:3]
        vars(fast.ops).update(saved[3])
    results["eager_breakdown_b16_8steps_s"] = {k: round(v, 4) for k, v in acc.items()}
    print("breakdown:", json.dumps(results["eager_breakdown_b16_8steps_s"]), flush=True)


def timed(llm, batch: int, new: int = 24) -> dict:
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(32)] for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)  # warm up / capture
    torch.cuda.synchronize()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    torch.cuda.synchronize()
    wall = max(o.metrics.finished_time for o in outs) - max(o.metrics.first_token_time for o in outs)
    return {"tok_s": batch * (new - 1) / wall, "step_ms": wall / (new - 1) * 1e3}


def bench(llm, fast, results: dict) -> None:
    model, cfg = llm.model, llm.model.cfg
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    inactive = cfg.num_hidden_layers * (cfg.n_routed_experts - cfg.num_experts_per_tok) * expert
    active_bytes = total - inactive - cfg.vocab_size * cfg.hidden_size * 2
    results["active_weight_bytes_batch1"] = active_bytes
    rows = []
    for mode, batches in (("fast_graphs", (1, 16, 64)), ("fast_eager", (1, 16, 64)), ("reference", (1,))):
        set_mode(llm, fast, {"reference": "reference", "fast_eager": "eager", "fast_graphs": "graphs"}[mode])
        for b in batches:
            try:
                t = timed(llm, b)
            except Exception:
                rows.append({"mode": mode, "batch": b, "error": traceback.format_exc()[-2000:]})
                print(rows[-1]["error"], flush=True)
                continue
            gbps = active_bytes / (t["step_ms"] / 1e3) / 1e9  # batch-1 active bytes (a lower bound at b > 1)
            row = {"mode": mode, "batch": b, "tok_s": round(t["tok_s"], 1), "step_ms": round(t["step_ms"], 3),
                   "gbps_active_weights": round(gbps, 1), "roofline_frac": round(gbps / HBM_GBPS, 4),
                   "x_hf_transformers": round(t["tok_s"] / HF_TOK_S[b], 2),
                   "x_reference": round(t["tok_s"] / REF_TOK_S[b], 1)}
            rows.append(row)
            results["decode"] = rows
            print(json.dumps(row), flush=True)
    results["decode"] = rows
    results["fast_stats"] = dict(fast.stats)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "profiling/results"))
    parser.add_argument("--breakdown", action="store_true", help="host time of the eager pieces (batch 16)")
    args = parser.parse_args()
    results = {"commit": commit(), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "hf_tok_s_reference_md": HF_TOK_S, "reference_tok_s_prior_run": REF_TOK_S}
    path = tempfile.mkdtemp()
    t0 = time.time()
    write_tiny_checkpoint(path, seed=0, cfg=mini_config(), dtype=torch.bfloat16)
    llm = LLM(path, dtype="bfloat16", max_model_len=4096, max_num_seqs=64, gpu_memory_utilization=0.5,
              enable_prefix_caching=False)
    fast = llm.runner.fast
    results["setup_s"] = round(time.time() - t0, 1)
    assert fast is not None and fast.ops.kind == "triton", f"fast path not selected on CUDA: {type(llm.runner).__name__} {FastPath.unavailable}"
    os.makedirs(args.out, exist_ok=True)
    phases = [("check", check)] + ([("breakdown", breakdown)] if args.breakdown else []) + [("bench", bench)]
    for name, fn in phases:
        try:
            fn(llm, fast, results)
        except Exception:  # keep what ran; report the failure
            results[f"{name}_error"] = traceback.format_exc()
            print(results[f"{name}_error"][-3000:], flush=True)
        with open(os.path.join(args.out, "fastpath_bench.json"), "w") as f:  # after every phase
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
