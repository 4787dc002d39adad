#!/usr/bin/env python
"""Batch-invariant mode on one GPU: per-op bitwise table, end-to-end bitwise checks, cost.

    PYTHONPATH=. python3 profiling/batch_invariant_gpu.py                    # H200: random `mini` bf16, < 4 min
    PYTHONPATH=. python3 profiling/batch_invariant_gpu.py --model /tmp/mini  # reuse h200_session.sh's checkpoint
    .venv/bin/python profiling/batch_invariant_gpu.py --device cpu --size tiny   # CPU smoke run (torch references)

1. ops: every op of the model, a target row alone vs inside batches of 1..256 at three
   positions (attention: a query in one chunk vs alone vs other chunkings), mismatches
   counted with the mode off / on (Triton kernels) / on with the torch references
   (profiling/batch_invariance_probe.py).
2. end to end, mode on (then off, as a control): a seeded request alone and inside
   batches of 1, 7 and 64 -> unique (tokens, logprobs); 64 copies among 40 varied
   requests, twice (a 512-token budget splits prompts into traffic-dependent chunks; the
   second pass hits the prefix cache) -> unique. Pass = 1 and 1 with the mode on.
3. kernels: the invariant GEMM vs cuBLAS and the attention kernel, timed, with roofline
   fractions (of REFERENCE.md section 5's H200 ceilings).
4. cost: prefill and decode tok/s (benchmarks/batch_invariant_cost.py's workloads) for the
   default engine, the reference path (DEEPINFER_FASTPATH=0; the mode runs on it), the
   mode with the kernels, and the mode with its torch references.

Phases stop early (marked "skipped") when --budget-s runs out, so the run always ends
with its table and the JSON (commit, hardware, config, every number) under $OUT.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "profiling"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # batch_invariant_cost: a benchmark

from batch_invariance_probe import probe_table, torch_references  # noqa: E402
from batch_invariant_cost import workload  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer import batch_invariant as bi  # noqa: E402
from deepinfer.profiling.records import run_metadata  # noqa: E402

PEAK_TFLOPS, PEAK_GBS = 800.0, 4200.0
TARGET_SEED = 0xC0FFEE_1234_5678


class Clock:
    """The run's time budget: phases ask before starting and between steps."""

    def __init__(self, budget_s: float) -> None:
        self.t0, self.budget = time.perf_counter(), budget_s

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)


# ---- end to end ------------------------------------------------------------------------
def scenario(vocab: int) -> tuple[list[int], list[int], SamplingParams]:
    """(shared prefix, target prompt, target params): the prefix spans > one 128-token block."""
    rng = random.Random(7)
    shared = [rng.randrange(vocab) for _ in range(140)]
    return shared, shared + [rng.randrange(vocab) for _ in range(9)], \
        SamplingParams(temperature=1.0, seq_seed=TARGET_SEED, max_tokens=6, ignore_eos=True)


def traffic(n: int, seed: int, vocab: int, shared: list[int]) -> list[tuple[list[int], SamplingParams]]:
    """n varied requests: lengths 3..200, a third share the target's prefix, mixed sampling."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < 0.35:
            prompt = shared[: rng.choice([60, 130, 140])] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))]
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.choice([3, 17, 40, 70, 129, 200]))]
        kind, new = rng.randrange(3), rng.randrange(1, 7)
        params = (SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True) if kind == 0 else
                  SamplingParams(temperature=0.8, top_p=0.9, max_tokens=new, ignore_eos=True) if kind == 1 else
                  SamplingParams(temperature=1.0, top_k=20, max_tokens=new, seq_seed=rng.randrange(2**64),
                                 ignore_eos=True))
        out.append((prompt, params))
    return out


def end_to_end(llm: LLM, vocab: int, clock: Clock) -> dict:
    """Unique (tokens, logprobs) of the target across the scenarios (see module doc)."""
    shared, target, params = scenario(vocab)

    def run(n_target: int, others: list, seed: int) -> tuple[list, list[int]]:
        items = [(target, params, True)] * n_target + [(p, sp, False) for p, sp in others]
        random.Random(seed).shuffle(items)
        outs = llm.generate(prompt_token_ids=[p for p, _, _ in items], sampling_params=[s for _, s, _ in items],
                            use_tqdm=False)
        mine = [o for o, it in zip(outs, items) if it[2]]
        return [(tuple(o.token_ids), tuple(o.logprobs or ())) for o in mine], \
            [o.metrics.num_cached_tokens for o in mine if o.metrics is not None]

    t0 = time.perf_counter()
    alone, cached = run(1, [], 0)
    every = list(alone)
    res: dict = {"batches": []}
    for n in (1, 7, 64):
        if clock.left() < 30:
            res.setdefault("skipped", []).append(f"batch {n} and later (time)")
            break
        got, _ = run(1, traffic(n - 1, n, vocab, shared), n)
        every += got
        res["batches"].append(n)
    res["alone_vs_batches_unique"] = len(set(every))
    others, mixed = traffic(40, 99, vocab, shared), []
    for seed in (1, 2):
        if clock.left() < 25:
            res.setdefault("skipped", []).append(f"mixed pass {seed} and later (time)")
            break
        got, hits = run(64, others, seed)
        mixed += got
        cached += hits
    res.update(mixed_copies=len(mixed), mixed_unique=len(set(mixed)) if mixed else None,
               max_prefix_hit_tokens=max(cached), all_unique=len(set(every + mixed)),
               tokens_only_unique=len({t for t, _ in every + mixed}), seconds=time.perf_counter() - t0)
    res["passed"] = res["all_unique"] == 1 and len(mixed) == 128 and "skipped" not in res
    return res


# ---- kernel check ----------------------------------------------------------------------
def check_kernels(device: str) -> dict[str, str]:
    """Each registered kernel once against its torch reference on fresh random inputs
    (relative error of the norm). A kernel that raises or misses its dtype's tolerance is
    unregistered, so the rest of the run measures the mode without it, and reported."""
    from deepinfer.models.invariant_attention import attend_reference
    from deepinfer.models.moe import MoE

    if bi.get_kernel("linear", device) is None:
        return {"all": "no kernels registered (torch references)"}

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))

    bf, f32 = torch.bfloat16, torch.float32
    rnd = lambda *shape, dt=f32: torch.randn(*shape, device=device).to(dt)  # noqa: E731
    moe = MoE(256, 128, 16, 4, 1, False, 100, "sqrtsoftplus", 1.5, True, 10.0, bf).to(device)
    with torch.no_grad():
        for prm in moe.parameters():
            prm.copy_(rnd(*prm.shape) * (prm.shape[-1] ** -0.5 if prm.dim() > 1 else 0.5))
    xm, ids = rnd(37, 256, dt=bf), torch.randint(0, 100, (37,), device=device)
    q, keys, ent = rnd(9, 16, 512, dt=bf), rnd(9, 512, dt=bf), rnd(2, 512, dt=bf)
    amask, pos, sink = torch.rand(9, 2, device=device) < 0.7, torch.arange(9, device=device), rnd(16)
    xs, wb, a32, b32, probs = rnd(70, 1024, dt=bf), rnd(300, 1024, dt=bf) * 0.03, rnd(50, 128), rnd(77, 128), \
        torch.rand(3, 5000, device=device)

    def moe_ref() -> torch.Tensor:
        with torch_references(device), bi.batch_invariant_mode(True):
            return moe(xm, ids)

    cases = {  # op -> (kernel call, reference, tolerance)
        "linear": (lambda k: k(xs, wb), lambda: (xs.float() @ wb.float().T).to(bf), 1e-2),
        "matmul_nt": (lambda k: k(a32, b32), lambda: a32 @ b32.T, 2e-5),
        "attention": (lambda k: k(q, pos, keys, 0, 4, ent, amask, sink, 512 ** -0.5),
                      lambda: attend_reference(q, pos, keys, 0, 4, ent, amask, sink, 512 ** -0.5), 1e-2),
        "moe": (lambda k: k(moe, xm, ids), moe_ref, 1e-2),
        "row_sum": (lambda k: k(xs, True), lambda: xs.float().pow(2).sum(-1), 2e-5),
        "row_cumsum": (lambda k: k(probs), lambda: probs.cumsum(-1), 2e-5),
    }
    out = {}
    for op, (call, ref, tol) in cases.items():
        kernel = bi.get_kernel(op, device)
        try:
            with torch.no_grad(), bi.batch_invariant_mode(True):
                err = rel(call(kernel), ref())
            out[op] = f"rel err {err:.2e} (tol {tol:.0e})" + ("" if err <= tol else ": FAILED, unregistered")
            if err > tol:
                bi.register_kernel(op, device, None)
        except Exception as exc:  # a kernel that does not compile here: measure the rest without it
            out[op] = f"{type(exc).__name__}: {str(exc)[:300]}: unregistered"
            bi.register_kernel(op, device, None)
    return out


# ---- kernel timings --------------------------------------------------------------------
def timed(fn, reps: int = 20) -> float:
    """Median seconds of fn() on a GPU (CUDA events), after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def kernel_timings(device: str) -> list[dict]:
    """The invariant GEMM vs cuBLAS (mini's shapes) and the attention kernel on a chunk."""
    if device != "cuda":
        return []
    lin, att = bi.get_kernel("linear", "cuda"), bi.get_kernel("attention", "cuda")
    if lin is None or att is None:
        return []
    rows = []
    for m, k, n in ((1, 1024, 4096), (64, 1024, 4096), (4096, 1024, 4096), (4096, 4096, 1024), (64, 1024, 129280)):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5
        flops, nbytes = 2 * m * n * k, 2 * (m * k + n * k + m * n)
        for name, fn in (("bi_linear", lambda: lin(x, w)), ("cublas", lambda: torch.nn.functional.linear(x, w))):
            s = timed(fn)
            rows.append({"kernel": name, "shape": f"M{m} K{k} N{n}", "us": s * 1e6,
                         "tflops": flops / s / 1e12, "gbs": nbytes / s / 1e9,
                         "frac_tflops": flops / s / 1e12 / PEAK_TFLOPS, "frac_gbs": nbytes / s / 1e9 / PEAK_GBS})
    length, heads, dim, window = 2048, 16, 512, 128
    q = torch.randn(length, heads, dim, device=device, dtype=torch.bfloat16)
    keys = torch.randn(length, dim, device=device, dtype=torch.bfloat16)
    entries = torch.randn(length // 4, dim, device=device, dtype=torch.bfloat16)
    mask = torch.rand(length, length // 4, device=device) < 512 / (length // 4)
    pos = torch.arange(length, device=device)
    s = timed(lambda: att(q, pos, keys, 0, window, entries, mask, torch.zeros(heads, device=device), dim ** -0.5), 5)
    visible = float(mask.sum()) + length * window
    flops = 4 * heads * dim * visible  # QK^T and PV over the keys each query sees
    rows.append({"kernel": "bi_attention", "shape": f"L{length} H{heads} D{dim} W{window} CSA~512", "us": s * 1e6,
                 "tflops": flops / s / 1e12, "gbs": None, "frac_tflops": flops / s / 1e12 / PEAK_TFLOPS,
                 "frac_gbs": None})
    return rows


# ---- cost ------------------------------------------------------------------------------
def cost(model: str, dtype: str, scale: float, clock: Clock) -> list[dict]:
    """tok/s of each workload for the four engines (module doc), one warm-up each."""
    engines = {"off": ("auto", False, True), "off, reference path": ("0", False, True),
               "on": ("0", True, True), "on, torch references": ("0", True, False)}
    rows = []
    for name, (fastpath, invariant, kernels) in engines.items():
        if clock.left() < 25:
            rows.append({"engine": name, "skipped": "time"})
            continue
        saved = os.environ.get("DEEPINFER_FASTPATH")
        os.environ["DEEPINFER_FASTPATH"] = fastpath  # read when the engine is built
        llm = LLM(model, dtype=dtype, batch_invariant=invariant, enable_prefix_caching=False, max_model_len=1024,
                  max_num_batched_tokens=1024)
        if saved is None:
            del os.environ["DEEPINFER_FASTPATH"]
        else:
            os.environ["DEEPINFER_FASTPATH"] = saved
        vocab = llm.model_config.vocab_size
        with torch_references(llm.device.type) if not kernels else contextlib.nullcontext():
            for wl in ("prefill", "decode"):
                prompts, params = workload(wl, vocab, scale)
                warm = [SamplingParams(temperature=1.0, seq_seed=p.seq_seed, max_tokens=min(3, p.max_tokens),
                                       ignore_eos=True) for p in params]
                llm.generate(prompt_token_ids=prompts, sampling_params=warm, use_tqdm=False)  # compile, graphs
                _sync(llm)
                t0 = time.perf_counter()
                outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
                _sync(llm)
                wall = time.perf_counter() - t0
                n_in, n_out = sum(len(p) for p in prompts), sum(len(o.token_ids) for o in outs)
                rows.append({"engine": name, "workload": wl, "seconds": wall, "prompt_tokens": n_in,
                             "output_tokens": n_out, "tok_per_s": (n_in + n_out) / wall, "out_tok_per_s": n_out / wall})
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    base = {r["workload"]: r["tok_per_s"] for r in rows if r.get("engine") == "off" and "workload" in r}
    ref = {r["workload"]: r["tok_per_s"] for r in rows if r.get("engine") == "off, reference path" and "workload" in r}
    for r in rows:
        if "workload" in r:
            r["vs_off"] = r["tok_per_s"] / base[r["workload"]] if r["workload"] in base else None
            r["vs_reference_path"] = r["tok_per_s"] / ref[r["workload"]] if r["workload"] in ref else None
    return rows


def _sync(llm: LLM) -> None:
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)


# ---- driver ----------------------------------------------------------------------------
def make_checkpoint(size: str, dtype: torch.dtype) -> str:
    from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint
    from deepinfer.parallel.skew import mini_like_config

    path = str(Path(tempfile.mkdtemp()) / f"bi-{size}")
    cfg = mini_like_config("mini") if size == "mini" else tiny_config(vocab_size=512, sliding_window=32)
    write_tiny_checkpoint(path, seed=0, cfg=cfg, dtype=dtype)
    return path


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", default="mini", choices=["mini", "tiny"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model", default=None, help="an existing checkpoint (default: write a random one of --size)")
    p.add_argument("--budget-s", type=float, default=200.0, help="stop starting phases after this many seconds")
    p.add_argument("--cost-scale", type=float, default=0.5, help="request-count scale of the cost workloads")
    p.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "profiling" / "results")))
    args = p.parse_args(argv)
    clock, dtype = Clock(args.budget_s), getattr(torch, args.dtype)
    if args.device == "cpu":
        os.environ["DEEPINFER_ACCELERATOR"] = "cpu"
    torch.manual_seed(0)
    model = args.model or make_checkpoint(args.size, dtype)
    result: dict = {"args": vars(args)}
    llm = LLM(model, dtype=args.dtype, batch_invariant=True, max_model_len=1024, max_num_batched_tokens=512,
              max_num_seqs=128)
    vocab = llm.model_config.vocab_size
    result["meta"] = run_metadata(llm, script="profiling/batch_invariant_gpu.py", device_type=args.device)
    result["kernel_check"] = check_kernels(args.device)
    t0 = time.perf_counter()
    result["ops"] = probe_table(dtype, args.device, wide=args.size == "mini", targets=2)
    result["ops_seconds"] = time.perf_counter() - t0
    result["kernels"] = {f"{k}@{d}": v for (k, d), v in bi.registered_kernels().items()}
    result["e2e_on"] = end_to_end(llm, vocab, clock)
    del llm
    result["kernel_timings"] = kernel_timings(args.device)
    if clock.left() > 60:
        off = LLM(model, dtype=args.dtype, batch_invariant=False, max_model_len=1024, max_num_batched_tokens=512,
                  max_num_seqs=128)
        result["e2e_off"] = end_to_end(off, vocab, Clock(min(60.0, clock.left() - 40)))
        del off
    result["cost"] = cost(model, args.dtype, args.cost_scale, clock)
    result["seconds"] = time.perf_counter() - clock.t0
    report(result)
    meta = result["meta"]
    name = f"batch_invariant_gpu_{meta['device'].replace(' ', '_').lower()}_{args.size}"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"{name}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {path}")
    return result


def report(r: dict) -> None:
    meta = r["meta"]
    print("kernels vs torch references: " + "; ".join(f"{k}: {v}" for k, v in r["kernel_check"].items()))
    print(f"\nops (mismatching placements, {meta['dtype']}):")
    cols = [c for c in r["ops"][0] if c not in ("op", "dtype")]
    for row in r["ops"]:
        print(f"  {row['op']:>30} " + " ".join(f"{c}={row[c]:<9}" for c in cols))
    for t in r["kernel_timings"]:
        gbs = f"{t['gbs']:8.0f} GB/s ({t['frac_gbs']:.1%} of 4.2 TB/s)" if t["gbs"] else ""
        print(f"  {t['kernel']:>12} {t['shape']:>28} {t['us']:9.1f} us {t['tflops']:7.1f} TFLOP/s "
              f"({t['frac_tflops']:.1%} of 800) {gbs}")
    print(f"\nbatch-invariant mode on {meta['device']} ({meta['hardware']}), {meta['model']} {meta['dtype']}, "
          f"commit {meta['commit'][:10]}{'-dirty' if meta['dirty'] else ''}, {r['seconds']:.0f} s")
    for key, label in (("e2e_on", "mode on"), ("e2e_off", "mode off (control)")):
        if key in r:
            e = r[key]
            verdict = ("PASS" if e["passed"] else "FAIL") if key == "e2e_on" else "control"
            print(f"  {label}: alone vs batches {e['batches']} -> {e['alone_vs_batches_unique']} unique; "
                  f"{e['mixed_copies']} copies among traffic -> {e['mixed_unique']} unique; all -> {e['all_unique']} "
                  f"(tokens only {e['tokens_only_unique']}); prefix hit {e['max_prefix_hit_tokens']} tokens: "
                  f"{verdict}{'; skipped ' + ', '.join(e['skipped']) if 'skipped' in e else ''}")
    print(f"  {'engine':>22} {'workload':>8} {'tok/s':>9} {'out tok/s':>9} {'vs off':>7} {'vs ref path':>11}")
    for c in r["cost"]:
        if "skipped" in c:
            print(f"  {c['engine']:>22} skipped ({c['skipped']})")
            continue
        fmt = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        print(f"  {c['engine']:>22} {c['workload']:>8} {c['tok_per_s']:>9.1f} {c['out_tok_per_s']:>9.1f} "
              f"{fmt(c['vs_off']):>7} {fmt(c['vs_reference_path']):>11}")


if __name__ == "__main__":
    main()
