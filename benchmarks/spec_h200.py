"""Issue 24's targets on one GPU: speculative decoding of the trained default through
`LLM.generate` (``deepinfer-tiny``: its MTP stage; ``deepinfer-tiny-dspark``: its DSpark
drafter), greedy, 128 new tokens, 8 real-text prompts (the repository's docs), batch 1 /
16 / 64: off, MTP k=1, MTP k=3, DSpark k=5 fixed, DSpark k=5 scheduled
(``enable_mtp_varlen``, i.e. DEEPINFER_ENABLE_MTP_VARLEN=1).

Correctness first: in batch-invariant mode the speculative greedy tokens must equal the
non-speculative ones bitwise (MTP k=3 and DSpark k=5, 8 prompts x 128 tokens); in the
default mode the share of equal outputs is reported (bf16 verify rows and decode rows may
round differently there). Then timing per configuration and batch: tok/s per user (its
decode tokens over its first-token -> finish time, averaged) and in total (all tokens over
the batch's wall time from its first token), effective tokens per step and acceptance per
position from the engine's speculative metrics, the verify graphs the warm-up captured.
Then a torch.profiler trace of a few steady DSpark k=5 steps at batch 16 (one verify +
draft step each): kernel launches, GPU busy share, host gaps, per step.

Writes ``spec_h200_<commit>.json`` under --out (default $OUT or profiling/results) with
commit, hardware, config and the issue's ``targets`` list of {name, value, target, met};
prints a short table last.

    python3 benchmarks/spec_h200.py [--out DIR] [--tiny]   # --tiny: CPU stand-in (tests)
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import torch  # noqa: E402
from fastpath_bench import commit  # noqa: E402  (DEEPINFER_COMMIT first: the GPU host's checkout reports another HEAD)

from deepinfer import LLM, SamplingParams  # noqa: E402

#: label -> (model, engine kwargs)
CONFIGS = {
    "off": ("deepinfer-tiny", {}),
    "mtp-k1": ("deepinfer-tiny", {"num_speculative_tokens": 1}),
    "mtp-k3": ("deepinfer-tiny", {"num_speculative_tokens": 3}),
    "dspark-k5-fixed": ("deepinfer-tiny-dspark", {"num_speculative_tokens": 5}),
    "dspark-k5-scheduled": ("deepinfer-tiny-dspark", {"num_speculative_tokens": 5, "enable_mtp_varlen": True}),
}




def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def doc_prompts(n: int, chars: int) -> list[str]:
    """``n`` real-text prompts: the opening paragraphs of the repository's docs, ``chars`` each."""
    files = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]
    texts = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            body = " ".join(line.strip() for line in f if line.strip() and not line.startswith(("```", "|")))
        for start in range(0, max(1, len(body) - chars), chars * 3):
            texts.append(body[start:start + chars])
    if len(texts) < n:
        raise RuntimeError(f"doc_prompts: only {len(texts)} prompts of {chars} chars in docs/ and README.md")
    step = len(texts) // n
    return [texts[i * step] for i in range(n)]


def engine(label: str, args, invariant: bool = False) -> LLM:
    model, kw = CONFIGS[label]
    return LLM(model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=max(args.batches),
               max_num_batched_tokens=max(2048, max(args.batches) * 8), batch_invariant=invariant, **kw)


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)


def timed(llm: LLM, prompts: list[str], batch: int, tokens: int) -> dict:
    """One warm-up call, then one timed ``generate`` of ``batch`` prompts (the 8 repeated)."""
    batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
    llm.generate(batch_prompts, greedy(min(tokens, 16)), use_tqdm=False)
    spec = llm.runner.spec
    if spec is not None:
        spec.metrics.reset()
    sync()
    outs = llm.generate(batch_prompts, greedy(tokens), use_tqdm=False)
    sync()
    m = [o.metrics for o in outs]
    first, last = min(x.first_token_time for x in m), max(x.finished_time for x in m)
    per_user = sum((len(o.token_ids) - 1) / max(1e-9, x.finished_time - x.first_token_time)
                   for o, x in zip(outs, m)) / batch
    row = {"batch": batch, "tok_s_per_user": round(per_user, 1),
           "tok_s_total": round(sum(len(o.token_ids) - 1 for o in outs) / max(1e-9, last - first), 1),
           "tokens": [o.token_ids for o in outs[:len(prompts)]]}
    if spec is not None:
        s = spec.metrics.summary()
        row |= {"effective_tokens_per_step": round(s["effective_tokens_per_step"], 3),
                "verify_tokens_per_step": round(s["verify_tokens_per_step"], 3),
                "acceptance_per_position": [round(a, 3) for a in s["acceptance_per_position"]]}
    else:
        row |= {"effective_tokens_per_step": 1.0}
    return row


def graph_info(llm: LLM) -> dict:
    """The warm-up's captures and the steps that ran outside them (should be none)."""
    fast = llm.runner.fast
    if fast is None:
        return {"fast_path": False}
    info = {"fast_path": True, **fast.stats, "warmed": llm.graphs_warmed}
    spec = llm.runner.spec
    verify = spec._verify if spec is not None else None
    if verify is not None:
        info |= {"verify_counts": dict(verify.counts), "verify_graphs": len(verify.warmed),
                 "verify_graph_bytes": verify.graph_bytes}
    draft = getattr(spec.drafter, "graphs", None) if spec is not None else None
    if draft is not None and hasattr(draft, "stats"):
        info["draft_graph_stats"] = dict(draft.stats)
    loop = llm.async_loop  # steps overlapped with the one before (speculative: planned ahead)
    if loop is not None:
        info["async"] = loop.stats.as_dict() | (dict(loop.planner.stats) if loop.planner is not None else {})
    return info


def profile_steps(llm: LLM, prompts: list[str], batch: int, steps: int) -> dict:
    """torch.profiler over ``steps`` steady engine steps (all requests decoding): per step,
    kernel launches, GPU busy time, wall time and the host gaps between kernels."""
    from torch.profiler import ProfilerActivity, profile

    core = llm.engine
    for i in range(batch):
        core.add_request(f"prof-{i}", core.tokenizer.encode(prompts[i % len(prompts)]), greedy(10_000))
    for _ in range(4):  # prefill + first speculative steps
        llm.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.step()
        sync()
        wall = time.perf_counter() - t0
    syncs = None
    if torch.cuda.is_available():  # implicit host syncs (.tolist(), .item(), blocking copies) per step
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    llm.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = round(sum("synchroniz" in str(w.message) for w in caught) / steps, 1)
    for i in range(batch):
        core.abort(f"prof-{i}")
    while core.has_unfinished():
        llm.step()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    runtime = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU
               and e.name.startswith(("cudaLaunch", "cuLaunch", "cudaGraphLaunch", "cudaMemcpy"))]
    busy = sum(e.time_range.elapsed_us() for e in kernels)
    per_kernel: dict[str, list[float]] = {}
    for e in kernels:
        per_kernel.setdefault(e.name[:80], []).append(e.time_range.elapsed_us())
    top = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:15]
    host_ops = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                      key=lambda e: -e.self_cpu_time_total)[:15]
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(kernels, kernels[1:])]
    big = [g for g in gaps if g > 20]
    return {"batch": batch, "steps": steps, "wall_ms_per_step": round(wall * 1e3 / steps, 3),
            "kernels_per_step": round(len(kernels) / steps, 1),  # GPU kernels run (graph nodes included)
            "host_kernel_launches_per_step": round(sum(n.startswith(("cudaLaunch", "cuLaunch")) for n in runtime)
                                                   / steps, 1),
            "graph_launches_per_step": round(sum(n.startswith("cudaGraphLaunch") for n in runtime) / steps, 1),
            "memcpy_calls_per_step": round(sum(n.startswith("cudaMemcpy") for n in runtime) / steps, 1),
            "gpu_busy_ms_per_step": round(busy / 1e3 / steps, 3),
            "gpu_busy_share": round(busy / 1e6 / wall, 3) if wall else None,
            "host_gaps_over_20us_per_step": round(len(big) / steps, 1),
            "host_gap_ms_per_step": round(sum(big) / 1e3 / steps, 3),
            # torch.cuda sync debug mode's warnings per step (the explicit waits on the results'
            # copy events are not among them); None off CUDA
            "implicit_syncs_per_step": syncs,
            "top_kernels": [{"name": n, "calls_per_step": round(len(t) / steps, 1),
                             "us_per_step": round(sum(t) / steps, 1)} for n, t in top],
            "top_host_ops": [{"name": e.key[:80], "calls_per_step": round(e.count / steps, 1),
                              "self_us_per_step": round(e.self_cpu_time_total / steps, 1)} for e in host_ops]}


def invariant_check(prompts: list[str], args) -> dict:
    """Batch-invariant mode: MTP k=3 and DSpark k=5 greedy == off greedy, bitwise (the
    speculative configurations of ``--configs`` when neither is among them)."""
    ref = engine("off", args, invariant=True)
    base = [o.token_ids for o in ref.generate(prompts, greedy(args.tokens), use_tqdm=False)]
    del ref
    out = {}
    labels = [c for c in ("mtp-k3", "dspark-k5-fixed") if c in args.configs] or \
        [c for c in args.configs if c != "off"]
    for label in labels:
        llm = engine(label, args, invariant=True)
        toks = [o.token_ids for o in llm.generate(prompts, greedy(args.tokens), use_tqdm=False)]
        out[label] = {"equal_prompts": sum(a == b for a, b in zip(toks, base)), "prompts": len(prompts),
                      "effective_tokens_per_step": round(llm.runner.spec.metrics.effective_tokens_per_step, 3)}
        del llm
        gc.collect()
    out["bitwise"] = all(v["equal_prompts"] == v["prompts"] for v in out.values())
    return out


def targets(res: dict, batches: list[int]) -> list[dict]:
    """Issue 24's targets over the configurations that ran (all of them by default)."""
    def at(label: str, b: int, key: str) -> float:
        return next(r[key] for r in res[label]["runs"] if r["batch"] == b)

    b1, bmid, btop = batches[0], batches[len(batches) // 2], batches[-1]
    dspark = [c for c in ("dspark-k5-fixed", "dspark-k5-scheduled") if c in res]
    rows = []
    if dspark:  # the better of fixed and scheduled
        for name, b, key, goal in ((f"DSpark k=5 per-user tok/s b{b1} / off", b1, "tok_s_per_user", 1.5),
                                   (f"DSpark k=5 per-user tok/s b{bmid} / off", bmid, "tok_s_per_user", 1.3),
                                   (f"DSpark k=5 total tok/s b{btop} / off", btop, "tok_s_total", 1.0)):
            rows.append((name, max(at(c, b, key) for c in dspark) / at("off", b, key), goal))
    if "mtp-k1" in res:
        rows.append((f"MTP k=1 per-user tok/s b{b1} / off",
                     at("mtp-k1", b1, "tok_s_per_user") / at("off", b1, "tok_s_per_user"), 1.2))
    if len(dspark) == 2:
        rows.append((f"DSpark scheduled / fixed total tok/s b{btop}",
                     at("dspark-k5-scheduled", btop, "tok_s_total") / at("dspark-k5-fixed", btop, "tok_s_total"), 1.0))
    out = [{"name": n, "value": round(v, 3), "target": t, "met": bool(v >= t)} for n, v, t in rows]
    inv = res["invariant"]["bitwise"]
    out.append({"name": "batch-invariant mode: speculative greedy == off greedy, bitwise", "value": inv,
                "target": True, "met": bool(inv)})
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "profiling", "results"))
    ap.add_argument("--tiny", action="store_true", help="CPU stand-in: 2 prompts, 6 tokens, batches 1/2")
    ap.add_argument("--batches", default=None)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--prompt-chars", type=int, default=400)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"a subset of {','.join(CONFIGS)} (off always runs)")
    args = ap.parse_args(argv)
    args.configs = ["off"] + [c for c in args.configs.split(",") if c != "off"]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        ap.error(f"--configs: unknown {bad}; allowed: {', '.join(CONFIGS)}")
    args.batches = [int(b) for b in (args.batches or ("1,2" if args.tiny else "1,16,64")).split(",")]
    args.tokens = args.tokens or (6 if args.tiny else 128)
    n_prompts = args.prompts or (2 if args.tiny else 8)
    args.max_model_len = 512
    t_start = time.perf_counter()
    prompts = doc_prompts(n_prompts, args.prompt_chars)
    hw = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.tiny else "cpu"
    res: dict = {"commit": commit(), "hardware": hw, "torch": torch.__version__,
                 "config": {"models": {k: v[0] for k, v in CONFIGS.items()}, "engine": {k: v[1] for k, v in
                                                                                        CONFIGS.items()},
                            "dtype": args.dtype, "max_model_len": args.max_model_len, "prompts": prompts},
                 "args": vars(args) | {"out": None}}
    res["invariant"] = invariant_check(prompts, args)
    gc.collect()
    for label in args.configs:
        t0 = time.perf_counter()
        llm = engine(label, args)
        start_s = time.perf_counter() - t0
        runs = [timed(llm, prompts, b, args.tokens) for b in args.batches]
        res[label] = {"engine_start_s": round(start_s, 2), "runs": runs, "graphs": graph_info(llm)}
        if label == "dspark-k5-fixed" or (label == args.configs[-1] and "profile" not in res and label != "off"):
            res["profile"] = {"config": label, **profile_steps(llm, prompts, args.batches[len(args.batches) // 2],
                                                               args.profile_steps)}
        if label in ("off", "mtp-k1", "dspark-k5-fixed"):  # where a batch-1 step's time goes, beside off's
            res.setdefault("profiles_b1", {})[label] = profile_steps(llm, prompts, 1, args.profile_steps)
        del llm
        gc.collect()
    for label in args.configs:  # default mode: equal to off at the same batch (not a target: bf16 rounding)
        for r in res[label]["runs"]:
            base = next(x for x in res["off"]["runs"] if x["batch"] == r["batch"])["tokens"]
            r["equal_to_off"] = sum(a == b for a, b in zip(r["tokens"], base))
    for label in args.configs:
        for r in res[label]["runs"]:
            r.pop("tokens")
    res["targets"] = targets(res, args.batches)
    res["seconds"] = round(time.perf_counter() - t_start, 1)
    os.makedirs(args.out, exist_ok=True)
    card = "h100" if "H100" in hw else "h200"  # the lent machine may be either (the JSON names it in full)
    path = os.path.join(args.out, f"spec_{card}_{res['commit'][:7]}{'_tiny' if args.tiny else ''}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{'config':22} {'batch':>5} {'tok/s/user':>11} {'tok/s':>10} {'eff tok/step':>12}  acceptance/position")
    for label in args.configs:
        for r in res[label]["runs"]:
            print(f"{label:22} {r['batch']:>5} {r['tok_s_per_user']:>11} {r['tok_s_total']:>10} "
                  f"{r['effective_tokens_per_step']:>12}  {r.get('acceptance_per_position', '')}")
    print("profile:", {k: v for k, v in res.get("profile", {}).items() if not k.startswith("top_")})
    for label, p in res.get("profiles_b1", {}).items():
        print(f"b1 {label}: wall {p['wall_ms_per_step']} ms/step, GPU busy {p['gpu_busy_ms_per_step']} ms, "
              f"{p['kernels_per_step']} kernels, {p['graph_launches_per_step']} graphs, "
              f"{p['host_kernel_launches_per_step']} launches, syncs {p['implicit_syncs_per_step']}")
    print("invariant:", res["invariant"])
    for t in res["targets"]:
        print(f"{'MET ' if t['met'] else 'MISS'} {t['name']}: {t['value']} (target {t['target']})")
    print(path, f"{res['seconds']} s")
    return res


if __name__ == "__main__":
    main()
