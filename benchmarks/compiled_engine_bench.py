"""Issue 23's benchmark: V4 and V4.1 at `mini` widths through `LLM.generate` in one run
(random bf16 weights, the engine built over a model in memory), decode at batch 1 and 64
and one 8k prefill each, plus a greedy check of the compiled path against the reference
path on the same engine. Writes ``compiled_engine_<hardware>_<commit>.json`` with a
``targets`` list of {name, value, target, met}.

    python3 benchmarks/compiled_engine_bench.py [--out DIR] [--tiny] [--processes N]   # --tiny: CPU stand-ins

The decode rows are host-bound, and the same code measures differently from one process to
the next (profiling/results/compiled_engine_v4_variance_h200.json), so ``--processes N``
runs the whole benchmark in N fresh processes one after another and records, per row, the
median (judged by the targets) beside every process's value.
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
from fastpath_bench import (PrebuiltLLM, build, commit, decode_speed, kernel_profile, prefill_speed, release,  # noqa: E402
                            sync)
from fastpath_check import token_ids  # noqa: E402
from fastpath_roofline import ModelCosts  # noqa: E402
from v41_bounded_replay import mini_v41_config  # noqa: E402

from deepinfer import SamplingParams  # noqa: E402
from deepinfer.models.tiny import mini_config, tiny_config, tiny_v41_config  # noqa: E402
from deepinfer.profiling.records import result_tag  # noqa: E402


def sizes(tiny: bool) -> dict:
    if tiny:
        small = dict(vocab_size=512, sliding_window=32)
        return {"v4_mini": lambda: tiny_config(index_topk=4, **small),
                "v41_mini": lambda: tiny_v41_config(index_topk=8, candidate_topk_blocks=4, **small)}
    return {"v4_mini": mini_config, "v41_mini": mini_v41_config}


def greedy_check(llm, n_prompts: int, new: int) -> dict:
    """Greedy tokens of the compiled path against the reference path of the same engine
    (fast path switched off), on prompts of a few lengths: the fraction of matching tokens
    before the first divergence (bf16 random weights: an early flip is numerics)."""
    vocab = llm.model_config.vocab_size
    prompts = [token_ids(77 + i, n, vocab) for i, n in enumerate((5, 60, 140, 300)[:n_prompts])]
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    fast = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)]
    steps = dict(llm.runner.fast.stats)
    saved, llm.runner.fast = llm.runner.fast, None
    try:
        ref = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)]
    finally:
        llm.runner.fast = saved
    agree = [next((i for i, (a, b) in enumerate(zip(f, r)) if a != b), len(f)) for f, r in zip(fast, ref)]
    return {"prompt_lens": [len(p) for p in prompts], "tokens": new, "agree_prefix": agree,
            "exact": all(a == new for a in agree), "fast_steps_during_check": steps["fast_steps"]}


def host_profile(llm, batch: int, new: int, top: int = 30) -> list[dict]:
    """Python time of the decode steps of one generate at ``batch`` (cProfile, after a
    warm-up): the functions with the most own time, to tell host-bound steps apart from
    GPU-bound ones."""
    import cProfile
    import pstats

    prompts = [token_ids(1000 + i, 32, llm.model_config.vocab_size) for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    prof, step, calls = cProfile.Profile(), llm.step, [0]

    def profiled_step(*a, **kw):  # decode steps only: the profile starts after the prefill step
        calls[0] += 1
        if calls[0] == 2:
            prof.enable()
        return step(*a, **kw)

    llm.step = profiled_step
    try:
        llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        sync()
    finally:
        prof.disable()
        del llm.step
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{os.path.relpath(f[0], os.path.dirname(HERE)) if f[0].startswith('/') else f[0]}:{f[1]}"
                         f"({f[2]})", "calls": v[1], "own_ms_per_step": round(v[2] / new * 1e3, 3),
             "cum_ms_per_step": round(v[3] / new * 1e3, 3)} for f, v in rows]


def run_size(name: str, make_cfg, args) -> dict:
    cfg = make_cfg()
    device = "cpu" if args.tiny else "cuda"
    res: dict = {"config": cfg.to_official_json()}
    t = time.time()
    model = build(cfg, device)
    costs = ModelCosts.of(model)
    cfg_dir = tempfile.mkdtemp(prefix=f"{name}_cfg_")
    with open(os.path.join(cfg_dir, "config.json"), "w") as f:
        json.dump({**cfg.to_official_json(), "deepinfer_tokenizer": "bundled"}, f)  # random ids: the bundled tokenizer, on purpose
    extra = {"swa_replay_mode": "compact"} if name.startswith("v41") else {}
    llm = PrebuiltLLM(model, cfg_dir, dtype="bfloat16", max_model_len=args.prefill + 64, max_num_seqs=64,
                      max_num_batched_tokens=max(args.prefill, 2048), enable_prefix_caching=False, **extra)
    res["engine_init_s"] = round(time.time() - t, 1)
    res["graphs_warmed"] = llm.graphs_warmed
    res["fast_path"] = {"decode": llm.runner.fast is not None, "prefill": llm.runner.fast_prefill is not None}
    llm._fast_paths = (llm.runner.fast, llm.runner.fast_prefill)
    if llm.runner.fast is not None:
        res["check"] = greedy_check(llm, 4 if not args.tiny else 2, args.check_tokens)
    res["decode"] = [decode_speed(llm, costs, b, args.new_tokens) for b in args.batches]
    res["decode_fast_stats"] = dict(llm.runner.fast.stats) if llm.runner.fast is not None else None
    res["prefill"] = [prefill_speed(llm, costs, args.prefill)]
    if args.profile and torch.cuda.is_available() and not args.tiny:
        res["kernel_profile"] = [kernel_profile(llm, b) for b in args.batches]
    if args.host_profile:
        res["host_profile"] = host_profile(llm, max(args.batches), args.new_tokens)
    release(llm)
    del llm, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def targets(out: dict) -> list[dict]:
    v4, v41 = out["v4_mini"], out["v41_mini"]
    rows = []

    def add(name: str, value: float, target: float) -> None:
        rows.append({"name": name, "value": round(value, 3), "target": target, "met": value >= target})

    for i, b in enumerate(out["args"]["batches"]):
        add(f"v41 decode b{b} / v4 decode b{b}", v41["decode"][i]["tok_s"] / v4["decode"][i]["tok_s"], 0.8)
    add("v41 8k prefill (compact) / v4 8k prefill", v41["prefill"][0]["tok_s"] / v4["prefill"][0]["tok_s"], 1.0)
    for i, b in enumerate(out["args"]["batches"]):
        floor = {1: 950, 64: 40_000}.get(b)
        if floor:
            add(f"v4 mini decode b{b} tok/s", v4["decode"][i]["tok_s"], floor)
    add("v4 mini 8k prefill tok/s", v4["prefill"][0]["tok_s"], 160_000)
    return rows


def median_of_processes(runs: list[dict]) -> dict:
    """One record from the records of N processes: the first's details, with every number of
    each decode / prefill row (tok/s, step ms, GB/s ...) the median over the processes, and
    ``tok_s_runs`` / ``spread`` (max / min) beside it."""
    out = json.loads(json.dumps(runs[0]))
    for name in ("v4_mini", "v41_mini"):
        if not all("decode" in r.get(name, {}) for r in runs):
            continue
        for kind in ("decode", "prefill"):
            for i, row in enumerate(out[name][kind]):
                rows = [r[name][kind][i] for r in runs]
                for key in list(row):
                    values = [x.get(key) for x in rows]
                    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
                    if numeric and len(set(values)) > 1:  # (equal values, e.g. the batch size, stay as they are)
                        row[key] = statistics.median(values)
                values = [x["tok_s"] for x in rows]
                row["tok_s_runs"] = values
                row["spread"] = round(max(values) / min(values), 3) if min(values) > 0 else None
    out["processes"] = len(runs)
    out["targets"] = targets(out) if all("decode" in out.get(n, {}) for n in ("v4_mini", "v41_mini")) else []
    return out


def run_processes(argv: list[str], n: int) -> list[dict]:
    """This benchmark in ``n`` fresh processes, one after another; their records."""
    runs = []
    for i in range(n):
        with tempfile.TemporaryDirectory(prefix="compiled_engine_run_") as tmp:
            cmd = [sys.executable, os.path.abspath(__file__), *argv, "--processes", "1", "--out", tmp]
            print(f"process {i + 1}/{n}: {' '.join(cmd[1:])}", flush=True)
            subprocess.run(cmd, check=True)
            (name,) = [f for f in os.listdir(tmp) if f.endswith(".json")]
            with open(os.path.join(tmp, name)) as f:
                runs.append(json.load(f))
    return runs


def _child_argv(argv: list[str]) -> list[str]:
    """``argv`` without its --processes / --out options (the parent sets them per child)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--processes", "--out"):
            skip = True
        elif not a.startswith(("--processes=", "--out=")):
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--tiny", action="store_true", help="CPU stand-ins (tests of this script)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--sizes", default="v4_mini,v41_mini")
    ap.add_argument("--profile", action="store_true", help="kernels per graphed decode step (CUDA)")
    ap.add_argument("--host-profile", action="store_true", help="cProfile of one decode generate at the largest batch")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--check-tokens", type=int, default=24)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--processes", type=int, default=1,
                    help="run in N fresh processes and record each row's median (host-bound rows vary between processes)")
    args = ap.parse_args(argv)
    if args.processes < 1:
        ap.error(f"--processes must be >= 1, got {args.processes}")
    args.batches = [int(b) for b in args.batches.split(",")]
    hw = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.tiny else "cpu"
    out: dict = {"commit": os.environ.get("DEEPINFER_COMMIT") or commit(), "hardware": hw,
                 "torch": torch.__version__, "args": vars(args) | {"out": None}}
    if args.processes > 1:
        out = {**median_of_processes(run_processes(_child_argv(argv), args.processes)), "args": out["args"]}
    else:
        for name, make in sizes(args.tiny).items():
            if name not in args.sizes.split(","):
                continue
            try:
                out[name] = run_size(name, make, args)
            except Exception:  # recorded: the other size still runs
                out[name] = {"error": traceback.format_exc()}
                print(f"{name} failed:\n{out[name]['error']}")
            sync()
        out["targets"] = targets(out) if all("decode" in out.get(n, {}) for n in ("v4_mini", "v41_mini")) else []
    os.makedirs(args.out, exist_ok=True)
    tag = result_tag(hw)
    path = os.path.join(args.out, f"compiled_engine_{tag}_{out['commit'][:7]}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{'size':10} {'b':>4} {'tok/s':>10} {'step ms':>8}")
    for name in [n for n in sizes(args.tiny) if "decode" in out.get(n, {})]:
        for d in out[name]["decode"]:
            runs = f"  runs {d['tok_s_runs']}" if "tok_s_runs" in d else ""
            print(f"{name:10} {d['batch']:>4} {d['tok_s']:>10} {d['step_ms']:>8}{runs}")
        p = out[name]["prefill"][0]
        print(f"{name:10} {'8k':>4} {p['tok_s']:>10} prefill ({p['path']})  check {out[name].get('check')}")
    for t in out["targets"]:
        print(f"{'MET ' if t['met'] else 'MISS'} {t['name']}: {t['value']} (target {t['target']})")
    print(path)
    return out


if __name__ == "__main__":
    main()
