"""Prefill fast path (deepinfer/models/v4/fast/prefill*.py) against the reference path, and its
speed, for `mini` (REFERENCE.md section 5, random weights) in bf16 and with FP8 e4m3
128x128 block-scaled weights (+ FP4 routed experts, the official V4 layout), one GPU call.

    python benchmarks/prefill_bench.py [--config mini] [--lengths 2048,8192] [--repeats 3]
                                      [--variants bf16,fp8] [--out DIR] [--commit SHA]
    python benchmarks/prefill_bench.py --config tiny --lengths 64,160 --repeats 1   # CPU smoke run

Per variant:
(a) check: a mixed batch (prompt lengths 1 / 100 / 700 / 2100 / 6000; the last one is
    chunked by the 8192-token budget, so a chunked step runs beside whole prompts)
    prefilled (``max_tokens=1``) through the reference path in float32 (the truth), then
    in bf16 through the reference path and the fast path: relative error (Frobenius) of
    each prompt's last-row logits to the truth; pass = the fast path's mean error over the
    prompts <= 1.25 x the bf16 reference's mean + 1e-3, and no prompt's above 2 x the
    reference's largest (the two bf16 paths round at different points, so they are not
    compared with each other for the verdict; that distance is recorded). Per prompt, two
    bf16 errors on random weights scatter by several times either way (docs/measurements.md),
    so a per-prompt rule fails both paths at random; a wrong fast path reaches ~1 on the
    prompts it breaks;
(b) FP8 GEMMs (GPU): the FP8 linear (act quant + Triton block-scaled GEMM) vs bf16
    F.linear vs torch's cuBLAS block-scaled _scaled_mm, on mini's projection shapes at 8192
    rows: TFLOP/s and error to the w8a8 reference;
(c) speed: one prompt of each length, ``max_tokens=1``, warm-up then the median of
    ``--repeats`` runs of generate() (host scheduling + sampling included): prefill tok/s,
    ms, analytic TFLOP/s (GEMMs of the active weights + attention + indexer scores) and
    its fraction of the bf16 matmul ceiling (REFERENCE.md section 5, docs/measurements.md
    "Ceilings"; FP8 rows too, for comparison); the
    reference path once per length; the ratio to HF transformers' numbers of REFERENCE.md.
JSON (commit, device, config, every number) under --out/prefill_bench_<config>.json,
then a short table. On a host without CUDA the fast path runs with the kernels' torch
references (DEEPINFER_FAST_PREFILL=ref) and FP8 linears with the w8a8 torch reference.

Other benchmarks can call :func:`check_prefill` and :func:`time_prefill` on their own LLM.
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
from dataclasses import replace

import torch

ON_GPU = torch.cuda.is_available()
#: Without CUDA (smoke runs, tests): the fast path's torch references and w8a8 FP8 linears.
HOST_ENV = {"DEEPINFER_FAST_PREFILL": "ref", "DEEPINFER_FP8_GEMM": "ref"}

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.models.checkpoint_layout import storage_format  # noqa: E402
from deepinfer.models.loader import iter_tensors, weight_bytes  # noqa: E402
from deepinfer.models.registry import read_model_config  # noqa: E402
from deepinfer.models.quant import quantize_fp4, quantize_fp8_block  # noqa: E402
from deepinfer.models.tiny import mini_config, tiny_config, write_tiny_checkpoint  # noqa: E402

PEAK_TFLOPS = 800.0  # bf16 8192^3 matmul on one H200 (REFERENCE.md section 5)
HF_TOK_S = {2048: 34500.0, 8192: 23000.0}  # transformers generate(), mini, REFERENCE.md section 5
CHECK_LENS = (1, 100, 700, 2100, 6000)


def commit(explicit: str | None) -> str:
    if explicit:
        return explicit
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def quantize_checkpoint(src: str, dst: str, device: str) -> str:
    """The official quantized layout of a dense checkpoint (FP8 e4m3 + E8M0 128x128 blocks,
    FP4 routed experts), quantised on ``device`` (minutes faster than the CPU for `mini`)."""
    from safetensors.torch import save_file

    cfg = read_model_config(src)
    qcfg = replace(cfg, fp8_block=(128, 128), expert_dtype="fp4")
    out: dict[str, torch.Tensor] = {}
    for name, t in iter_tensors(src):
        fmt = storage_format(name, "fp4")
        if fmt == "fp8":
            out[name], out[name[:-len("weight")] + "scale"] = (x.cpu() for x in quantize_fp8_block(
                t.to(device).float(), (128, 128)))
        elif fmt == "fp4":
            out[name], out[name[:-len("weight")] + "scale"] = (x.cpu() for x in quantize_fp4(t.to(device).float(), 32))
        else:
            out[name] = t.contiguous()
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**qcfg.to_official_json(), "deepinfer_tokenizer": "bundled"}, f, indent=2)  # random ids
    return dst


def _sync() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def prefill_logits(llm: LLM, prompts: list[list[int]], fast: bool) -> list[torch.Tensor]:
    """Float32 logits of each prompt's last row (``max_tokens=1``), through the fast or the
    reference prefill path (the runner's ``fast_prefill`` switched for the call). Rows are
    recorded in sampling order, which is prompt order: requests are scheduled first come
    first served and a chunked prompt finishes after the ones before it."""
    runner = llm.runner
    saved_path, sample = runner.fast_prefill, runner.sampler.sample
    if not fast:
        runner.fast_prefill = None
    rows: list[torch.Tensor] = []

    def record(logits, params, *args):
        rows.extend(logits.float().cpu())
        return sample(logits, params, *args)

    runner.sampler.sample = record  # prefill steps never take the greedy decode lane
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    try:
        llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    finally:
        runner.fast_prefill, runner.sampler.sample = saved_path, sample
    assert len(rows) == len(prompts), (len(rows), len(prompts))
    return rows


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def check_prefill(llm: LLM, prompts: list[list[int]], truth: list[torch.Tensor]) -> dict:
    """Fast vs reference prefill logits of each prompt's last row, both against ``truth``
    (the reference path in float32 on the same weights): two bf16 paths round at different
    points, so each is held to the bf16 reference's own distance from float32. Passes when
    the fast path's mean error <= 1.25 x the bf16 reference's mean + 1e-3 and no prompt's
    exceeds 2 x the reference's largest (module docstring: why not per prompt)."""
    ref = prefill_logits(llm, prompts, fast=False)
    fast = prefill_logits(llm, prompts, fast=True)
    err_fast = [_rel(f, t) for f, t in zip(fast, truth)]
    err_ref = [_rel(r, t) for r, t in zip(ref, truth)]
    return {"prompt_lens": [len(p) for p in prompts], "fast_vs_fp32_rel_err": err_fast,
            "reference_vs_fp32_rel_err": err_ref, "fast_vs_reference_rel_err": [_rel(f, r) for f, r in zip(fast, ref)],
            "greedy_agree_fast_reference": sum(int(f.argmax() == r.argmax()) for f, r in zip(fast, ref)),
            "passed": (sum(err_fast) <= 1.25 * sum(err_ref) + 1e-3 * len(err_ref)
                       and max(err_fast) <= 2.0 * max(err_ref) + 1e-3),
            "fast_prefill_stats": dict(llm.runner.fast_prefill.stats)}


def prefill_flops(cfg, model, length: int) -> dict[str, float]:
    """Analytic FLOPs of prefilling ``length`` tokens from position 0: GEMMs of the active
    weights (attention projections, compressors, indexer, router, top-k + shared experts;
    the head for one row), attention (QK and PV over the visible keys) and indexer scores."""
    from deepinfer.models.linear import Linear

    gemm = 0.0
    attn = 0.0
    pos = torch.arange(length, dtype=torch.float64)
    for layer in model.layers:
        a = layer.attn
        per_token = sum(m.in_features * m.out_features for m in a.modules() if isinstance(m, Linear))
        ffn = layer.ffn
        expert = sum(lin.in_features * lin.out_features for lin in (ffn.experts[0].w1, ffn.experts[0].w2,
                                                                  ffn.experts[0].w3))
        per_token += ffn.gate.weight.numel() + (cfg.num_experts_per_tok + cfg.n_shared_experts) * expert
        gemm += 2.0 * per_token * length
        keys = torch.clamp(pos + 1, max=a.window)
        if a.ratio:
            entries = torch.floor((pos + 1) / a.ratio)
            keys = keys + (torch.clamp(entries, max=a.indexer.topk) if a.indexer is not None else entries)
            if a.indexer is not None:
                attn += float(2.0 * a.indexer.n_heads * a.indexer.dim * entries.sum())
        attn += float(4.0 * a.n_heads * a.head_dim * keys.sum())
    gemm += 2.0 * cfg.vocab_size * cfg.hidden_size
    return {"gemm": gemm, "attention": attn, "total": gemm + attn}


def time_prefill(llm: LLM, length: int, repeats: int, fast: bool = True, seed: int = 0, warm: bool = True) -> dict:
    """Median wall time of prefilling one ``length``-token prompt (generate(), max_tokens=1),
    after one untimed run when ``warm`` (Triton compiles on first use)."""
    g = torch.Generator().manual_seed(seed + length)
    prompt = torch.randint(10, 100000 if llm.model.cfg.vocab_size > 100000 else llm.model.cfg.vocab_size,
                           (length,), generator=g).tolist()
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    runner = llm.runner
    saved = runner.fast_prefill
    runner.fast_prefill = saved if fast else None
    try:
        if warm:
            llm.generate(prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False)
        walls = []
        for _ in range(repeats):
            _sync()
            t = time.perf_counter()
            llm.generate(prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False)
            _sync()
            walls.append(time.perf_counter() - t)
    finally:
        runner.fast_prefill = saved
    wall = statistics.median(walls)
    return {"length": length, "path": "fast" if fast else "reference", "wall_s": wall, "tok_s": length / wall,
            "runs": len(walls)}


def _time_cuda(fn, iters: int = 20) -> float:
    """Median seconds of ``fn()`` over CUDA-event-timed calls (after one warm-up call)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _cublas_blockwise(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, ref: torch.Tensor, flop: float) -> dict:
    """torch's block-scaled FP8 matmul (cuBLAS: 1x128 activation x 128x128 weight scales),
    where this build has it: the first API / scale layout that runs and matches the w8a8
    reference is timed. Recorded, never fatal: its scale layout rules are not documented."""
    import torch.nn.functional as F
    from deepinfer_kernels.fp8_act_quant import act_quant

    from deepinfer.models.quant import e8m0_to_float

    a_q, a_s = act_quant(x, 128)
    ws = e8m0_to_float(w_s).t()  # [K/128, N/128], as torch's shape checks ask
    col = lambda t: t.t().contiguous().t()  # noqa: E731  (column-major copy)
    tries = {}
    for layout, (sa, sb) in {"rowmajor": (a_s, ws.contiguous()), "a_colmajor": (col(a_s), ws.contiguous()),
                             "both_colmajor": (col(a_s), col(ws))}.items():
        calls = {"F.scaled_mm": lambda sa=sa, sb=sb: F.scaled_mm(
                     a_q, w_q.t(), sa, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise128x128,
                     output_dtype=torch.bfloat16),
                 "torch._scaled_mm": lambda sa=sa, sb=sb: torch._scaled_mm(
                     a_q, w_q.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)}
        for api, fn in calls.items():
            try:
                err = float((fn().float() - ref.float()).norm() / ref.float().norm())
            except Exception as exc:
                tries[f"{api}/{layout}"] = repr(exc)[:160]
                continue
            if err < 2e-2:
                return {"cublas_blockwise_api": f"{api}/{layout}", "cublas_blockwise_rel_err": err,
                        "cublas_blockwise_tflops": flop / _time_cuda(fn) / 1e12}
            tries[f"{api}/{layout}"] = f"rel err {err:.2e}"
    return {"cublas_blockwise_error": tries}


def bench_fp8_gemms(cfg, tokens: int = 8192) -> list[dict]:
    """The FP8 linear (act quant + block-scaled GEMM) against bf16 F.linear on the shapes of
    ``cfg``'s FP8 projections at ``tokens`` rows, and torch's block-scaled _scaled_mm
    (cuBLAS, 1x128 activations x 128x128 weights) where this torch build has it: TFLOP/s
    and relative error to the w8a8 torch reference."""
    from deepinfer_kernels.fp8_gemm import fp8_linear, fp8_linear_ref

    h, q = cfg.hidden_size, cfg.q_lora_rank
    shapes = {"wq_a": (h, q), "wq_b": (q, cfg.num_attention_heads * cfg.head_dim), "wkv": (h, cfg.head_dim),
              "wo_b": (cfg.o_groups * cfg.o_lora_rank, h), "shared_w1": (h, cfg.moe_intermediate_size),
              "shared_w2": (cfg.moe_intermediate_size, h)}
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (k, n) in shapes.items():
        x = torch.randn(tokens, k, device="cuda", generator=g).to(torch.bfloat16)
        w = torch.randn(n, k, device="cuda", generator=g) * k ** -0.5
        w_q, w_s = quantize_fp8_block(w, (128, 128))
        w_bf16 = w.to(torch.bfloat16)
        flop = 2.0 * tokens * k * n
        ref = fp8_linear_ref(x, w_q, w_s, (128, 128))
        out = fp8_linear(x, w_q, w_s, (128, 128))
        row = {"linear": name, "M": tokens, "K": k, "N": n,
               "triton_fp8_tflops": flop / _time_cuda(lambda: fp8_linear(x, w_q, w_s, (128, 128))) / 1e12,
               "triton_fp8_rel_err": float((out.float() - ref.float()).norm() / ref.float().norm()),
               "bf16_tflops": flop / _time_cuda(lambda: torch.nn.functional.linear(x, w_bf16)) / 1e12}
        row.update(_cublas_blockwise(x, w_q, w_s, ref, flop))
        rows.append(row)
        print("[gemm]", json.dumps(row), flush=True)
    return rows


def bench_variant(name: str, path: str, args: argparse.Namespace, results: dict) -> None:
    g = torch.Generator().manual_seed(1)
    engine = dict(max_model_len=max(args.lengths + list(CHECK_LENS)) + 8, max_num_seqs=8,
                  max_num_batched_tokens=args.budget, enable_prefix_caching=False,
                  **({"gpu_memory_utilization": 0.45} if ON_GPU else {"cpu_dense_weights": False}))
    lens = [n for n in CHECK_LENS if n <= args.check_max_len]
    t0 = time.time()
    truth_llm = LLM(path, dtype="float32", **engine)  # the reference path in float32: the check's truth
    vocab = min(truth_llm.model.cfg.vocab_size, 100000)
    prompts = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lens]
    truth = prefill_logits(truth_llm, prompts, fast=False)
    del truth_llm
    _free()
    t1 = time.time()
    llm = LLM(path, dtype="bfloat16", **engine)
    assert llm.runner.fast_prefill is not None, "the prefill fast path was not selected"
    out = results["variants"][name] = {"fp32_truth_s": round(t1 - t0, 1), "load_s": round(time.time() - t1, 1),
                                       "weight_bytes": weight_bytes(llm.model),
                                       "fast_prefill_ops": llm.runner.fast_prefill.ops.kind}
    out["check"] = check_prefill(llm, prompts, truth)
    print(f"[{name}] check:", json.dumps(out["check"]), flush=True)
    rows = []
    for length in args.lengths:
        flops = prefill_flops(llm.model.cfg, llm.model, length)
        for fast in (True, False):
            r = time_prefill(llm, length, args.repeats if fast else 1, fast, warm=fast)  # the reference compiles nothing
            r["tflop_s"] = flops["total"] / r["wall_s"] / 1e12
            r["peak_frac"] = r["tflop_s"] / PEAK_TFLOPS
            r["gflop_per_prompt"] = flops["total"] / 1e9
            r["attention_flop_share"] = flops["attention"] / flops["total"]
            if length in HF_TOK_S:
                r["x_hf_reference_md"] = r["tok_s"] / HF_TOK_S[length]
            rows.append(r)
            print(f"[{name}]", json.dumps(r), flush=True)
    out["prefill"] = rows
    out["fast_prefill_stats"] = dict(llm.runner.fast_prefill.stats)
    del llm
    _free()


def _free() -> None:
    gc.collect()
    if ON_GPU:
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=("mini", "tiny"), default="mini")
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--variants", default="bf16,fp8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check-max-len", type=int, default=max(CHECK_LENS), help="drop longer check prompts")
    parser.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens (chunked prefill)")
    parser.add_argument("--out", default=os.environ.get("OUT", "profiling/results"))
    parser.add_argument("--commit", default=None)
    args = parser.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    saved = {k: os.environ.get(k) for k in HOST_ENV}
    if not ON_GPU:
        for k, v in HOST_ENV.items():
            os.environ.setdefault(k, v)
    try:
        return run(args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(args: argparse.Namespace) -> dict:
    device = "cuda" if ON_GPU else "cpu"
    import triton

    results = {"commit": commit(args.commit), "device": torch.cuda.get_device_name(0) if ON_GPU else "cpu",
               "torch": torch.__version__, "triton": triton.__version__, "config_name": args.config,
               "peak_tflops": PEAK_TFLOPS, "hf_tok_s_reference_md": HF_TOK_S, "variants": {},
               "env": {k: v for k, v in os.environ.items() if k.startswith("DEEPINFER_")}}
    cfg = mini_config() if args.config == "mini" else tiny_config(vocab_size=512, sliding_window=32, index_topk=8)
    results["config"] = cfg.to_official_json()
    results["args"] = {k: v for k, v in vars(args).items() if k != "out"}
    t0 = time.time()
    root = tempfile.mkdtemp()
    dense = write_tiny_checkpoint(os.path.join(root, "bf16"), seed=0, cfg=cfg, dtype=torch.bfloat16)
    paths = {"bf16": dense}
    if "fp8" in args.variants:
        paths["fp8"] = quantize_checkpoint(dense, os.path.join(root, "fp8"), device)
    results["setup_s"] = round(time.time() - t0, 1)
    os.makedirs(args.out, exist_ok=True)
    out_file = os.path.join(args.out, f"prefill_bench_{args.config}.json")
    if ON_GPU and "fp8" in args.variants:
        try:
            results["fp8_gemms"] = bench_fp8_gemms(cfg)
        except Exception as exc:  # the engine benchmark below still runs
            results["fp8_gemms_error"] = repr(exc)[:500]
            print("[gemm] failed:", results["fp8_gemms_error"], flush=True)
    for name in args.variants.split(","):
        bench_variant(name, paths[name], args, results)
        with open(out_file, "w") as f:  # after each variant: a later failure keeps the earlier numbers
            json.dump(results, f, indent=1)
    for r in results.get("fp8_gemms", []):
        print(f"gemm {r['linear']:10} {r['M']}x{r['K']}x{r['N']}: triton fp8 {r['triton_fp8_tflops']:.0f} TFLOP/s "
              f"(err {r['triton_fp8_rel_err']:.1e}), bf16 {r['bf16_tflops']:.0f}, cublas blockwise "
              f"{r.get('cublas_blockwise_tflops', float('nan')):.0f} (err {r.get('cublas_blockwise_rel_err', float('nan')):.1e})")
    print(f"\nprefill_bench ({args.config}, {results['device']}, commit {results['commit'][:10]}) -> {out_file}")
    print(f"{'variant':8}{'path':>10}{'tokens':>8}{'ms':>10}{'tok/s':>11}{'TFLOP/s':>9}{'/800':>7}{'xHF':>7}"
          f"{'check':>8}{'fast err':>9}{'ref err':>9}")
    for name, v in results["variants"].items():
        chk = v["check"]
        for r in v["prefill"]:
            print(f"{name:8}{r['path']:>10}{r['length']:>8}{r['wall_s'] * 1e3:>10.1f}{r['tok_s']:>11.0f}"
                  f"{r['tflop_s']:>9.1f}{r['peak_frac']:>7.3f}{r.get('x_hf_reference_md', float('nan')):>7.2f}"
                  f"{'pass' if chk['passed'] else 'FAIL':>8}{max(chk['fast_vs_fp32_rel_err']):>9.1e}"
                  f"{max(chk['reference_vs_fp32_rel_err']):>9.1e}")
    return results


if __name__ == "__main__":
    sys.exit(0 if all(v["check"]["passed"] for v in main()["variants"].values()) else 1)
