"""Where one long prefill's time goes: the engine's prefill of ``--tokens`` tokens (one
request, one step) on a random bf16 model built on the GPU, profiled.

    PYTHONPATH=. python3 profiling/prefill_profile.py [--size flash4] [--tokens 8192] [--out DIR]
    python profiling/prefill_profile.py --tiny     # CPU: tiny shapes, torch references (tests)

Reports the step's wall time, GPU busy time and launches, the GPU time per model part
(``record_function`` ranges around each layer's attention, MoE and mHC calls: the kernels
inside each range's span on the device timeline, and the span itself, whose excess over
the kernels is launch-bound idle time; ``attn.*`` ranges nest inside ``attention``), the host time before the first kernel
(scheduling, input build, prefill metadata) and the top kernels, with the roofline of
profiling/fastpath_roofline.py. Writes ``prefill_profile_<size>_<tokens>.json`` and a
chrome trace (open in Perfetto) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))  # fastpath_bench is a benchmark

import torch  # noqa: E402
from fastpath_bench import PrebuiltLLM, build, commit, tiny_sizes  # noqa: E402
from fastpath_check import token_ids  # noqa: E402
from fastpath_roofline import ModelCosts, roofline  # noqa: E402

from deepinfer import SamplingParams  # noqa: E402
from deepinfer.models.tiny import flash4_config, mini_config  # noqa: E402

#: model parts, each a (module, function) wrapped in a record_function range of that name
PARTS = {
    "attention": ("deepinfer.models.v4.fast.prefill", "attention_prefill"),
    "moe": ("deepinfer.models.fast.forward", "moe_forward"),
}


PART_NAMES = ("attention", "moe", "mhc", "head", "attn.projections", "attn.compressor")


def _ranged(label: str, fn):
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)
    return wrapped


def instrument(llm) -> None:
    """Ranges around attention, MoE, the mHC ops and the head of the fast prefill path."""
    import importlib

    for label, (mod_name, attr) in PARTS.items():
        mod = importlib.import_module(mod_name)
        setattr(mod, attr, _ranged(label, getattr(mod, attr)))
    fp = llm.runner.fast_prefill
    if fp is not None:
        for op in ("hc_pre", "hc_post_pre", "hc_head"):
            setattr(fp.ops, op, _ranged("mhc", getattr(fp.ops, op)))
    head = llm.model.head
    head.forward = _ranged("head", head.forward)


def _attention_subparts() -> None:
    """Finer ranges inside attention: the projections and the compressors."""
    from deepinfer.models.v4.fast import prefill_attention as pa

    pa.attention_inputs = _ranged("attn.projections", pa.attention_inputs)
    pa.compress_prefill = _ranged("attn.compressor", pa.compress_prefill)


def profile_prefill(llm, costs: ModelCosts, tokens: int, out_dir: str, name: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    vocab = llm.model_config.vocab_size
    cuda = torch.cuda.is_available()
    walls = []
    for seed in (1, 2):  # warm-up (compiles, allocates), then one timed run without the profiler
        prompt = [token_ids(7000 + seed, tokens, vocab)]
        torch.cuda.synchronize() if cuda else None
        t = time.perf_counter()
        llm.generate(prompt_token_ids=prompt, sampling_params=sp, use_tqdm=False)
        torch.cuda.synchronize() if cuda else None
        walls.append(time.perf_counter() - t)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prompt = [token_ids(7003, tokens, vocab)]
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=prompt, sampling_params=sp, use_tqdm=False)
        torch.cuda.synchronize() if cuda else None
        prof_wall = time.perf_counter() - t0
    trace = os.path.join(out_dir, f"prefill_profile_{name}_{tokens}_trace.json")
    prof.export_chrome_trace(trace)
    events = prof.events()
    # GPU-side copies of the record_function / NVTX ranges are CUDA events too: not kernels
    ranges = {e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU}
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in ranges]
    by_kernel: dict = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_kernel[e.name][0] += 1
        by_kernel[e.name][1] += e.device_time
    # a range's GPU-side copy spans its kernels on the device timeline: its kernel time is the
    # kernels inside that span (device_time_total of the CPU range also counted nested copies)
    parts, spans = defaultdict(float), defaultdict(float)
    for a in events:
        if a.name in PART_NAMES and (a.device_type == torch.autograd.DeviceType.CUDA or not cuda):
            lo, hi = a.time_range.start, a.time_range.end
            spans[a.name] += hi - lo
            parts[a.name] += sum(k.device_time for k in kernels if lo <= k.time_range.start < hi)
    busy_us = sum(t for _, t in by_kernel.values())
    first_kernel_us = min((e.time_range.start for e in kernels), default=0)
    cpu_start_us = min((e.time_range.start for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                       default=0)
    wall = walls[-1]
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:25]
    return {
        "tokens": tokens, "wall_ms": round(wall * 1e3, 2), "tok_s": round(tokens / wall, 1),
        "profiled_wall_ms": round(prof_wall * 1e3, 2), "kernels": len(kernels),
        "gpu_busy_ms": round(busy_us / 1e3, 2), "gpu_busy_frac": round(busy_us / 1e3 / max(prof_wall * 1e3, 1e-9), 3),
        "host_before_first_kernel_ms": round((first_kernel_us - cpu_start_us) / 1e3, 2) if kernels else None,
        "parts_gpu_ms": {k: round(v / 1e3, 2) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
        "parts_span_ms": {k: round(v / 1e3, 2) for k, v in sorted(spans.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": k[:90], "calls": c, "ms": round(t / 1e3, 3)} for k, (c, t) in top],
        "trace": os.path.basename(trace),
        **roofline(costs.prefill_bytes(tokens), costs.prefill_flops(tokens), wall),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="flash4", choices=("mini", "flash4"))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--out", default=os.environ.get("OUT", os.path.join(HERE, "results")))
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny shapes, torch-reference kernels")
    parser.add_argument("--quantize", choices=("fp4", "fp8"), default=None,
                        help="the official quantized storage, made in memory: FP8 dense + these routed experts")
    args = parser.parse_args(argv)
    if args.tiny:
        os.environ.setdefault("DEEPINFER_FASTPATH", "ref")
        os.environ.setdefault("DEEPINFER_FAST_PREFILL", "ref")
        cfg, device = tiny_sizes()[args.size](), "cpu"
    else:
        cfg, device = {"mini": mini_config, "flash4": flash4_config}[args.size](), "cuda"
    model = build(cfg, device)
    if args.quantize:
        from deepinfer.models.quant_online import quantize_linears

        quantize_linears(model, args.quantize, (128, 128))
    costs = ModelCosts.of(model)
    import tempfile

    cfg_dir = tempfile.mkdtemp(prefix=f"{args.size}_cfg_")
    with open(os.path.join(cfg_dir, "config.json"), "w") as f:
        json.dump({**cfg.to_official_json(), "deepinfer_tokenizer": "bundled"}, f)  # random ids: the bundled tokenizer, on purpose
    llm = PrebuiltLLM(model, cfg_dir, dtype="bfloat16", max_model_len=args.tokens + 64, max_num_seqs=4,
                      max_num_batched_tokens=args.tokens, enable_prefix_caching=False,
                      kv_cache_memory_bytes=(1 if args.tiny else 8) << 30)
    if llm.runner.fast_prefill is None:
        raise RuntimeError("the fast prefill path was not selected")
    instrument(llm)
    _attention_subparts()
    os.makedirs(args.out, exist_ok=True)
    res = {"commit": os.environ.get("DEEPINFER_COMMIT") or commit(), "size": args.size, "tiny": args.tiny,
           "quantized": args.quantize and {"dense": "fp8", "experts": args.quantize},
           "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
           **profile_prefill(llm, costs, args.tokens, args.out, args.size + (args.quantize and '_' + args.quantize or ''))}
    path = os.path.join(args.out, f"prefill_profile_{args.size}_{args.tokens}{args.quantize and '_' + args.quantize or ''}"
                        f"{'_tiny' if args.tiny else ''}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{args.size} prefill {args.tokens}: {res['wall_ms']} ms, {res['tok_s']} tok/s, "
          f"{res['tflop_s']} TFLOP/s ({100 * res['peak_frac']:.1f}% of 800), GPU busy {res['gpu_busy_ms']} ms "
          f"({res['kernels']} kernels), host before first kernel {res['host_before_first_kernel_ms']} ms")
    print("parts (GPU ms):", json.dumps(res["parts_gpu_ms"]))
    for k in res["top_kernels"][:15]:
        print(f"  {k['ms']:9.3f} ms  x{k['calls']:<4d} {k['name']}")
    print(f"results: {path}")
    return res


if __name__ == "__main__":
    main()
