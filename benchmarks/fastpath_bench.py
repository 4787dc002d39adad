"""The GPU fast path vs the reference path and HF transformers, in one GPU call.

    PYTHONPATH=. python3 benchmarks/fastpath_bench.py [--sizes mini,flash4] [--out DIR] [--budget-s 450]
    python benchmarks/fastpath_bench.py --tiny          # CPU: tiny shapes, torch references (tests)

For each size (``mini`` = REFERENCE.md section 5, 1.17B params; ``flash4`` = V4-Flash
widths, 4 layers, 27.4B params), a random bf16 model is built directly on the GPU (no
checkpoint on disk) and served by the engine:

1. correctness (``mini``; ``flash4`` the engine part only): a mixed batch through the
   reference path, the fast path eager and the fast path with CUDA graphs (per-step
   logits rel err on rows with equal history, greedy agreement), then the teacher-forced
   per-layer study of profiling/fastpath_layers.py (float32 truth vs bf16 reference vs bf16
   fast path over their own caches) with its verdict, and the batched prefill path vs the
   reference on one prefill step (profiling/fastpath_check.py);
2. decode at batch 1 / 16 / 64 / 256 (32-token prompts, graphs) and prefill of 2k and 8k
   tokens (one request, the engine's prefill path), with GB/s and TFLOP/s against the
   ceilings (profiling/fastpath_roofline.py) and the kernels of a graphed decode step at
   batch 1 and 64 (torch profiler: launches per step, GPU busy vs wall time, top kernels);
3. HF transformers' eager generate() on the same config in the same run (model freed
   first), and our ratio to it.

Every phase is guarded by the time budget and writes ``fastpath_bench_<sizes>.json`` (commit,
hardware, configs, results) under --out as it goes; a short table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(ROOT, "profiling", "results")  # every run's record lives there, studies' too
sys.path.insert(0, os.path.join(ROOT, "profiling"))  # fastpath_check / fastpath_roofline: checks and studies live there
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from fastpath_check import check_engine, check_layers, check_prefill, set_mode, token_ids  # noqa: E402
from fastpath_roofline import ModelCosts, roofline  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.engine.core import EngineCore  # noqa: E402
from deepinfer.models.tiny import flash4_config, init_random, mini_config, tiny_config  # noqa: E402


def tiny_sizes() -> dict:
    """CPU stand-ins with the same layer kinds (tests of this script)."""
    small = dict(vocab_size=512, index_topk=4, sliding_window=32)
    return {"mini": lambda: tiny_config(compress_ratios=[128, 4, 128, 4], num_hash_layers=2, **small),
            "flash4": lambda: tiny_config(hidden_size=96, n_routed_experts=16, num_experts_per_tok=4, **small)}


class PrebuiltCore(EngineCore):
    """An engine core over a model built in memory: ``init_model`` runs as usual with the
    checkpoint load replaced by the given model (flash4 would need 55 GB on disk)."""

    def __init__(self, prebuilt: torch.nn.Module, config_dir: str, **kwargs: object) -> None:
        self._prebuilt = prebuilt
        super().__init__(config_dir, **kwargs)

    def init_model(self) -> None:
        import deepinfer.engine.core as core_module

        original = core_module.load_model
        core_module.load_model = lambda *a, **k: self._prebuilt
        try:
            super().init_model()
        finally:
            core_module.load_model = original


class PrebuiltLLM(LLM):
    """`LLM` over a `PrebuiltCore`."""

    def __init__(self, model: torch.nn.Module, config_dir: str, **kwargs: object) -> None:
        self._prebuilt = model
        super().__init__(config_dir, **kwargs)

    def make_core(self, model: str | None, tokenizer: str | None, **kwargs: object) -> EngineCore:
        return PrebuiltCore(self._prebuilt, model, **kwargs)


def build(cfg, device: str, seed: int = 0) -> torch.nn.Module:
    from deepinfer.models.registry import build_model

    with torch.device("meta"):
        model = build_model(cfg, torch.bfloat16)
    model = model.to_empty(device=device)
    init_random(model, seed, device=device)
    return model.eval()


def commit() -> str:
    if os.environ.get("DEEPINFER_COMMIT"):  # a copied checkout (the GPU host) may hold another HEAD
        return os.environ["DEEPINFER_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, cwd=HERE).strip()
    except Exception:
        return "unknown"


# ---------------------------------------------------------------------------- speed
def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_speed(llm, costs: ModelCosts, batch: int, new: int, prompt_len: int = 32) -> dict:
    prompts = [token_ids(1000 + i, prompt_len, llm.model_config.vocab_size) for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)  # warm-up / graph capture
    sync()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    sync()
    wall = max(o.metrics.finished_time for o in outs) - max(o.metrics.first_token_time for o in outs)
    step_s = wall / (new - 1)
    ctx = prompt_len + new // 2
    return {"batch": batch, "tok_s": round(batch / step_s, 1), "step_ms": round(step_s * 1e3, 3),
            **roofline(costs.decode_bytes(batch, ctx), costs.decode_flops(batch, ctx), step_s)}


def prefill_speed(llm, costs: ModelCosts, tokens: int) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for seed in (1, 2):  # the first builds/compiles, the second is timed (different ids: no prefix hits)
        prompt = [token_ids(5000 + seed, tokens, llm.model_config.vocab_size)]
        sync()
        t = time.perf_counter()
        llm.generate(prompt_token_ids=prompt, sampling_params=sp, use_tqdm=False)
        sync()
        wall = time.perf_counter() - t
    fp = llm.runner.fast_prefill
    return {"tokens": tokens, "tok_s": round(tokens / wall, 1), "ms": round(wall * 1e3, 2),
            "path": "fast_prefill" if fp is not None and fp.stats["prefill_steps"] else "reference",
            **roofline(costs.prefill_bytes(tokens), costs.prefill_flops(tokens), wall)}


def kernel_profile(llm, batch: int, short: int = 4, extra: int = 8) -> dict:
    """Kernels of graphed decode steps (CUDA only): two generates of the same prompts that
    differ by ``extra`` decode steps, so the difference is per decode step (model, sampler,
    input copies; no prefill): launches, GPU busy time against the step's wall time, and the
    top kernels by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    prompts = [token_ids(9000 + i, 32, llm.model_config.vocab_size) for i in range(batch)]
    counts = {}
    for new in (short, short + extra):
        sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)  # warm / captured
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
            sync()
        walls = []  # timed without the profiler, median of 5: one profiled pair's difference was noise
        for _ in range(5):
            t = time.perf_counter()
            llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
            sync()
            walls.append(time.perf_counter() - t)
        wall = statistics.median(walls)
        by_name: dict = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                v = by_name.setdefault(e.name, [0, 0.0])
                v[0] += 1
                v[1] += e.device_time
        counts[new] = (by_name, wall)
    (a_names, a_wall), (b_names, b_wall) = counts[short], counts[short + extra]
    diff = {k: (v[0] - a_names.get(k, [0, 0.0])[0], v[1] - a_names.get(k, [0, 0.0])[1]) for k, v in b_names.items()}
    kernels = sum(c for c, _ in diff.values()) / extra
    gpu_us = sum(t for _, t in diff.values()) / extra
    step_us = (b_wall - a_wall) / extra * 1e6
    top = sorted(diff.items(), key=lambda kv: -kv[1][1])[:12]
    return {"batch": batch, "kernels_per_decode_step": round(kernels, 1), "gpu_busy_us_per_step": round(gpu_us, 1),
            "wall_us_per_step": round(step_us, 1),
            "gpu_busy_frac": round(gpu_us / step_us, 3) if step_us > 0 else None,
            "top_kernels_us_per_step": {k[:80]: round(t / extra, 1) for k, (_, t) in top},
            "kernel_table": [{"name": k[:100], "calls_per_step": round(c / extra, 2), "us_per_step": round(t / extra, 2)}
                             for k, (c, t) in sorted(diff.items(), key=lambda kv: -kv[1][1]) if c > 0]}


# ---------------------------------------------------------------------------- driver
class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.time() + seconds

    def left(self) -> float:
        return self.end - time.time()


def phase(results: dict, key: str, budget: Budget, need_s: float, fn, *args):
    """Run fn unless the budget is short; record its result or its error."""
    if budget.left() < need_s:
        results[key] = {"skipped": f"time budget ({budget.left():.0f}s left, needs ~{need_s:.0f}s)"}
        return None
    t = time.time()
    try:
        results[key] = fn(*args)
    except Exception:
        results[key] = {"error": traceback.format_exc()[-3000:]}
        print(results[key]["error"], flush=True)
    print(f"[{time.time() - t:6.1f}s] {key}: {json.dumps(results[key])[:400]}", flush=True)
    return results[key]


def run_size(name: str, cfg, args, out: dict, budget: Budget) -> None:
    res = out.setdefault(name, {"config": cfg.to_official_json()})
    device = "cpu" if args.tiny else "cuda"
    t = time.time()
    model = build(cfg, device)
    res["build_s"] = round(time.time() - t, 1)
    if args.quantize:  # the official storage in memory: FP8 block-scaled dense, FP4 / FP8 routed experts
        from deepinfer.models.quant_online import quantize_linears

        res["quantized"] = {"dense": "fp8", "experts": args.quantize,
                            "linears": quantize_linears(model, args.quantize, (128, 128))}
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    costs = ModelCosts.of(model)
    res["dense_weight_bytes"], res["expert_bytes"] = costs.dense_bytes, costs.expert_bytes
    cfg_dir = tempfile.mkdtemp(prefix=f"{name}_cfg_")
    with open(os.path.join(cfg_dir, "config.json"), "w") as f:
        json.dump({**cfg.to_official_json(), "deepinfer_tokenizer": "bundled"}, f)  # random ids: the bundled tokenizer, on purpose
    max_len = max(max(args.prefill), 300 + max(args.new_tokens, args.check_tokens)) + 64
    t = time.time()
    llm = PrebuiltLLM(model, cfg_dir, dtype="bfloat16", max_model_len=max_len, max_num_seqs=max(args.batches),
                      max_num_batched_tokens=max(max(args.prefill), 2048), enable_prefix_caching=False,
                      kv_cache_memory_bytes=args.kv_gib << 30)
    # engine start: memory profile of the worst-case step, KV sizing, decode graph warm-up
    res["engine_init_s"] = round(time.time() - t, 1)
    res["step_peak_bytes"], res["graphs_warmed"] = llm.step_peak_bytes, llm.graphs_warmed
    res["kv_blocks"] = {g: p.num_blocks for g, p in llm.kv_manager.pools.items()}
    llm._fast_paths = (llm.runner.fast, llm.runner.fast_prefill)
    res["fast_path"] = {"decode": llm.runner.fast is not None, "prefill": llm.runner.fast_prefill is not None,
                        "ops": getattr(llm.runner.fast, "ops", None) and llm.runner.fast.ops.kind}
    if llm.runner.fast is None:
        raise RuntimeError(f"fast path not selected for {name}")
    lens = (1, 17, 130, 300) if name == "mini" else (5, 140)
    skip = set(args.skip.split(",")) if args.skip else set()
    if "check" not in skip:
        phase(res, "check_engine", budget, 20, check_engine, llm, args.check_tokens, lens)
        if name == "mini" or args.tiny:
            phase(res, "check_layers", budget, 20, check_layers, model, args.check_tokens, (5, 127, 300))
        if llm.runner.fast_prefill is not None:  # rows before / behind the first HCA entry, and a long one
            phase(res, "check_prefill", budget, 20, check_prefill, model, (40, 127, 129, 300))
    set_mode(llm, "graphs")
    res["decode"] = []
    for b in () if "decode" in skip else args.batches:
        r = phase(res, f"decode_b{b}", budget, 15, decode_speed, llm, costs, b, args.new_tokens)
        res["decode"].append(res.pop(f"decode_b{b}"))
        if r is None:
            break
    res["prefill"] = []
    for n in args.prefill:
        phase(res, f"prefill_{n}", budget, 15, prefill_speed, llm, costs, n)
        res["prefill"].append(res.pop(f"prefill_{n}"))
    if not args.tiny and "profile" not in skip:
        for b in (1, 64):
            phase(res, f"kernel_profile_b{b}", budget, 15, kernel_profile, llm, b)
    release(llm)
    del llm, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        res["gpu_bytes_left_after_release"] = torch.cuda.memory_allocated()
    if not args.no_hf and "hf" not in skip:
        phase(res, "hf", budget, 40, run_hf, cfg, device, args, budget)


def release(llm) -> None:
    """Free the engine's device memory even if something still refers to it (the HF model
    of the same size is built next)."""
    for fast in llm._fast_paths:
        if fast is not None and hasattr(fast, "_graphs"):
            fast._graphs.clear()
    for module in llm.model.modules():  # the fast paths' fused weights (expert stacks, concatenations)
        for name in [n for n in vars(module) if n.startswith("_fast")]:
            delattr(module, name)
    for p in llm.model.parameters():
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    for value in vars(llm.kv_cache).values():
        if isinstance(value, dict):
            value.clear()


def run_hf(cfg, device: str, args, budget: Budget) -> dict:
    from fastpath_hf import build_hf, hf_decode, hf_prefill

    t = time.time()
    model = build_hf(cfg, torch.bfloat16, device)
    out = {"build_s": round(time.time() - t, 1), "decode": [], "prefill": []}
    try:
        for b in args.batches:
            if budget.left() < 20:
                out["decode"].append({"batch": b, "skipped": "time budget"})
                continue
            out["decode"].append({"batch": b, **hf_decode(model, b, 32, args.hf_new_tokens, cfg.vocab_size)})
        for n in args.prefill:
            if budget.left() < 15:
                out["prefill"].append({"tokens": n, "skipped": "time budget"})
                continue
            out["prefill"].append({"tokens": n, **hf_prefill(model, n, cfg.vocab_size)})
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def table(out: dict) -> str:
    lines = [f"{'size':7s} {'phase':8s} {'n':>5s} {'ours tok/s':>11s} {'HF tok/s':>9s} {'x HF':>6s} "
             f"{'ms':>8s} {'GB/s':>7s} {'%HBM':>6s} {'TFLOP/s':>8s} {'%peak':>6s}"]
    for name, res in out.items():
        if not isinstance(res, dict) or "decode" not in res:
            continue
        hf = res.get("hf") or {}
        for kind, key, ms in (("decode", "batch", "step_ms"), ("prefill", "tokens", "ms")):
            hf_rows = {r[key]: r for r in hf.get(kind, [])} if isinstance(hf.get(kind), list) else {}
            for r in res.get(kind, []):
                if "tok_s" not in r:
                    continue
                h = hf_rows.get(r[key], {}).get("tok_s")
                lines.append(f"{name:7s} {kind:8s} {r[key]:5d} {r['tok_s']:11.1f} {h or float('nan'):9.1f} "
                             f"{(r['tok_s'] / h) if h else float('nan'):6.1f} {r[ms]:8.2f} {r['gb_s']:7.0f} "
                             f"{100 * r['hbm_frac']:5.1f}% {r['tflop_s']:8.1f} {100 * r['peak_frac']:5.1f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="mini,flash4")
    parser.add_argument("--out", default=os.environ.get("OUT", RESULTS))
    parser.add_argument("--budget-s", type=float, default=450.0, help="skip phases past this much wall time")
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny shapes, torch-reference kernels")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--kv-gib", type=int, default=8)
    parser.add_argument("--quantize", choices=("fp4", "fp8"), default=None,
                        help="serve the official quantized storage, made in memory: FP8 dense + these routed experts")
    parser.add_argument("--skip", default="", help="comma list of phases to skip: check, decode, profile, hf")
    args = parser.parse_args(argv)
    args.batches = (1, 4) if args.tiny else (1, 16, 64, 256)
    args.prefill = (64, 200) if args.tiny else (2048, 8192)
    args.new_tokens, args.hf_new_tokens, args.check_tokens = (4, 3, 3) if args.tiny else (24, 12, 16)
    if args.tiny:  # the fast paths forced onto the host with the torch references, graphs emulated
        os.environ.setdefault("DEEPINFER_FASTPATH", "ref")
        os.environ.setdefault("DEEPINFER_FAST_PREFILL", "ref")
        os.environ.setdefault("DEEPINFER_CUDA_GRAPHS", "1")
        args.kv_gib = 1
    sizes = tiny_sizes() if args.tiny else {"mini": mini_config, "flash4": flash4_config}
    budget = Budget(args.budget_s)
    out: dict = {"commit": commit(), "torch": torch.__version__, "budget_s": args.budget_s, "tiny": args.tiny,
                 "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.tiny else "cpu",
                 "ceilings": {"hbm_gb_s": 4200, "bf16_tflop_s": 800}}
    try:
        import transformers
        import triton
        out["transformers"], out["triton"] = transformers.__version__, triton.__version__
    except ImportError:
        pass
    os.makedirs(args.out, exist_ok=True)
    tag = f"_{args.quantize}" if args.quantize else ""
    path = os.path.join(args.out, f"fastpath_bench_{args.sizes.replace(',', '_')}{tag}{'_tiny' if args.tiny else ''}.json")
    for name in args.sizes.split(","):
        try:
            run_size(name, sizes[name](), args, out, budget)
        except Exception:
            out.setdefault(name, {})["error"] = traceback.format_exc()[-3000:]
            print(out[name]["error"], flush=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    out["table"] = table(out)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"results: {path}\n{out['table']}", flush=True)
    return out


if __name__ == "__main__":
    main()
