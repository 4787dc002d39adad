#!/usr/bin/env python
"""Where the first generate() after engine start spends its extra host time.

    PYTHONPATH=. python3 profiling/first_generate_profile.py [--tiny] [--out DIR]

decode_grid.py measures the first generate after start against the same call again (8
requests of 100 random tokens, 16 new each) and finds the first engine of a process slower
while a second engine in the same process is not, with the extra time spread as host time
over the call's steps. This builds the same `mini` engine (random bf16 weights,
max_model_len 65536) and runs that call three times, each under cProfile, and records per
call: wall ms, per-step host times by step kind (the engine's step metrics), and the
functions whose own time grew most from the steady call to the first. The JSON goes to
``--out`` as ``first_generate_profile_<hardware>_<commit>.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

import torch  # noqa: E402
from fastpath_bench import PrebuiltLLM, build, commit, sync  # noqa: E402
from fastpath_check import token_ids  # noqa: E402

import deepinfer.engine.prefill_warmup as prefill_warmup  # noqa: E402
from deepinfer import SamplingParams  # noqa: E402
from deepinfer.models.tiny import mini_config, tiny_config  # noqa: E402


def own_times(prof: cProfile.Profile) -> dict[str, tuple[float, int]]:
    """function -> (own seconds, calls) of one profiled call."""
    stats = pstats.Stats(prof)
    return {f"{os.path.basename(f)}:{line} {name}": (tt, nc)
            for (f, line, name), (_, nc, tt, _, _) in stats.stats.items()}  # type: ignore[attr-defined]


def steps_by_kind(llm) -> dict[str, dict]:
    """Per step kind of the last call: steps, mean and max step ms (the engine's metrics)."""
    df = llm.metrics.steps_df()
    if df.empty:
        return {}
    kind = df["num_prefill_reqs"].gt(0).map({True: "prefill", False: "decode"})
    out = {}
    for k, rows in df.groupby(kind):
        out[str(k)] = {"steps": int(len(rows)), "mean_ms": round(float(rows["step_ms"].mean()), 3),
                       "max_ms": round(float(rows["step_ms"].max()), 3),
                       "first_ms": round(float(rows["step_ms"].iloc[0]), 3)}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU stand-in (tests of this script)")
    ap.add_argument("--out", default=os.environ.get("OUT", "artifacts"))
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-ladder", action="store_true",
                    help="A/B: start without the prefill warm-up's token ladder (engine/prefill_warmup.py)")
    args = ap.parse_args(argv)
    ladder = prefill_warmup.token_ladder
    if args.no_ladder:
        prefill_warmup.token_ladder = lambda *a, **k: []
    try:
        return profile_calls(args)
    finally:
        prefill_warmup.token_ladder = ladder


def profile_calls(args: argparse.Namespace) -> dict:
    """The engine built, ``args.calls`` profiled calls, the record written and printed."""
    cfg = tiny_config(vocab_size=512, sliding_window=32, index_topk=4) if args.tiny else mini_config()
    device = "cpu" if args.tiny else "cuda"
    model = build(cfg, device)
    cfg_dir = tempfile.mkdtemp(prefix="first_generate_cfg_")
    with open(os.path.join(cfg_dir, "config.json"), "w") as f:
        json.dump({**cfg.to_official_json(), "deepinfer_tokenizer": "bundled"}, f)
    t = time.perf_counter()
    kw = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 8} if args.tiny else \
        {"dtype": "bfloat16", "max_model_len": 65536, "max_num_seqs": 256}
    llm = PrebuiltLLM(model, cfg_dir, **kw)
    init_s = time.perf_counter() - t
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    calls, profiles = [], []
    for i in range(args.calls):
        prompts = [token_ids(11 + i * 100 + j, 100, cfg.vocab_size) for j in range(8)]
        llm.metrics.reset()
        sync()
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        sync()
        prof.disable()
        wall = time.perf_counter() - t
        profiles.append(own_times(prof))
        calls.append({"call": i, "wall_ms": round(wall * 1e3, 2), "steps": steps_by_kind(llm)})
    first, steady = profiles[0], profiles[-1]
    grew = sorted(((name, tt - steady.get(name, (0.0, 0))[0], nc, steady.get(name, (0.0, 0))[1])
                   for name, (tt, nc) in first.items()), key=lambda r: -r[1])[:args.top]
    record = {"commit": commit(), "hardware": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
              "torch": torch.__version__, "init_s": round(init_s, 2),
              "warmup_requests_served": llm.engine.warmup_requests_served, "token_ladder": not args.no_ladder,
              "calls": calls,
              "first_over_steady": round(calls[0]["wall_ms"] / calls[-1]["wall_ms"], 3),
              "grew_most": [{"function": n, "extra_ms": round(d * 1e3, 3), "calls_first": nc, "calls_steady": ns}
                            for n, d, nc, ns in grew]}
    os.makedirs(args.out, exist_ok=True)
    tag = record["hardware"].replace(" ", "_").lower()
    variant = f"{'_noladder' if args.no_ladder else ''}{'' if record['warmup_requests_served'] else '_noreq'}"
    path = os.path.join(args.out, f"first_generate_profile_{tag}_{record['commit'][:7]}{variant}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    for c in calls:
        print(f"call {c['call']}: {c['wall_ms']} ms  " + "  ".join(
            f"{k}: {v['steps']} steps mean {v['mean_ms']} first {v['first_ms']} max {v['max_ms']} ms"
            for k, v in c["steps"].items()))
    print(f"first / steady: {record['first_over_steady']}   (warm-up requests served: "
          f"{record['warmup_requests_served']}, token ladder: {record['token_ladder']})")
    for g in record["grew_most"][:15]:
        print(f"  +{g['extra_ms']:8.3f} ms  {g['calls_first']:>6} / {g['calls_steady']:<6} calls  {g['function']}")
    print(path)
    llm.shutdown()
    return record


if __name__ == "__main__":
    main()
