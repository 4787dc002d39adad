"""Issue 23's batch-invariant target on one GPU: V4 `mini` (random bf16 weights) through
`LLM.generate`, the default engine and the batch-invariant engine (compiled executor:
decode graphs + prefill path in the mode, deepinfer/models/fast/invariant.py,
models/v4/fast/invariant_prefill.py) in one run.

Correctness first (invariant engine): one greedy and one seeded sampled request, alone
and among 6 and 63 other requests (chunked prefill through a 512-token budget, so its
rows land in decode graphs of different buckets, prefill and mixed steps): tokens and
log-probs bitwise equal across batch sizes 1 / 7 / 64; the invariant compiled engine's
greedy tokens against the invariant reference engine (DEEPINFER_FASTPATH=0 and
DEEPINFER_FAST_PREFILL=0) on a few short prompts. Then timing: decode at batch 1 and
64, one 8k-token prefill, default vs invariant. Writes
``invariant_compiled_<hardware>_<commit>.json`` under --out (default $OUT or
profiling/results) with a ``targets`` list of {name, value, target, met}.

    python3 benchmarks/invariant_compiled_bench.py [--out DIR] [--tiny] [--size mini|mini_v41]

``--size mini_v41``: DeepSeek-V4.1 at `mini` widths (benchmarks/v41_bounded_replay.py's
``mini_v41_config``; V4.1's compiled prefill / mixed steps run the mode's rows too:
v41/fast/prefill.py), written as ``invariant_compiled_v41_<hardware>_<commit>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(ROOT, "profiling", "results")  # every run's record lives there, studies' too
sys.path.insert(0, os.path.join(ROOT, "profiling"))  # fastpath_check / fastpath_roofline: checks and studies live there
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from fastpath_bench import PrebuiltLLM, build, commit, decode_speed, prefill_speed, sync  # noqa: E402
from fastpath_check import token_ids  # noqa: E402
from fastpath_roofline import ModelCosts  # noqa: E402

from deepinfer import SamplingParams  # noqa: E402
from deepinfer.models.tiny import mini_config, tiny_config, tiny_v41_config  # noqa: E402
from deepinfer.profiling.records import result_tag  # noqa: E402


def engine(model, cfg_dir: str, invariant: bool, args, budget: int | None = None, compiled: bool = True):
    """An engine over the model in memory; ``compiled=False``: the reference path."""
    for name in ("DEEPINFER_FASTPATH", "DEEPINFER_FAST_PREFILL"):
        if compiled:
            os.environ.pop(name, None)
        else:
            os.environ[name] = "0"
    return PrebuiltLLM(model, cfg_dir, dtype="bfloat16", max_model_len=args.prefill + 64, max_num_seqs=64,
                       max_num_batched_tokens=budget or max(args.prefill, 2048), enable_prefix_caching=False,
                       batch_invariant=invariant)


def free(llm) -> None:
    """Drop an engine's graphs and KV cache; the model (shared by every engine here) stays."""
    fast = llm.runner.fast
    if fast is not None:
        fast._graphs.clear()
    for value in vars(llm.kv_cache).values():
        if isinstance(value, dict):
            value.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def target_runs(llm, vocab: int, new: int, longest: int) -> dict:
    """(tokens, log-probs) of the two target requests alone and among 6 / 63 others."""
    greedy = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seq_seed=4242, max_tokens=new, ignore_eos=True)
    targets = [token_ids(77, min(300, longest), vocab), token_ids(78, min(45, longest), vocab)]
    runs: dict = {}
    for n in (1, 7, 64):
        others = [token_ids(900 + n * 100 + i, 1 + (37 * i) % min(400, longest), vocab) for i in range(max(0, n - 2))]
        prompts = others[: len(others) // 2] + targets + others[len(others) // 2:]
        params = [SamplingParams(temperature=0.7, seq_seed=i, max_tokens=new, ignore_eos=True)
                  for i in range(len(prompts))]
        at = len(others) // 2
        params[at], params[at + 1] = greedy, seeded
        if n == 1:  # alone: each target by itself
            outs = [llm.generate(prompt_token_ids=[p], sampling_params=sp, use_tqdm=False)[0]
                    for p, sp in zip(targets, (greedy, seeded))]
        else:
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)[at:at + 2]
        runs[n] = [(list(o.token_ids), [float(x).hex() for x in o.logprobs]) for o in outs]
    return runs


def check(model, cfg_dir: str, args) -> dict:
    llm = engine(model, cfg_dir, True, args, budget=512)
    res: dict = {"fast_path": {"decode": llm.runner.fast is not None, "prefill": llm.runner.fast_prefill is not None}}
    runs = target_runs(llm, llm.model_config.vocab_size, args.check_tokens, args.prefill // 2)
    res["bitwise_1_7_64"] = all(runs[n] == runs[1] for n in (7, 64))
    res["runs"] = {str(n): v for n, v in runs.items()}
    if llm.runner.fast is not None:
        res["decode_stats"] = dict(llm.runner.fast.stats)
    if llm.runner.fast_prefill is not None:
        res["prefill_stats"] = dict(llm.runner.fast_prefill.stats)
    prompts = [token_ids(300 + i, min(24 + 40 * i, args.prefill // 2), llm.model_config.vocab_size) for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    compiled = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    free(llm)
    ref_llm = engine(model, cfg_dir, True, args, budget=512, compiled=False)
    ref = ref_llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    free(ref_llm)
    res["compiled_vs_reference_tokens_equal"] = [a.token_ids == b.token_ids for a, b in zip(compiled, ref)]
    res["compiled_vs_reference_max_logprob_diff"] = max(
        abs(x - y) for a, b in zip(compiled, ref) for x, y in zip(a.logprobs, b.logprobs))
    return res


def timing(model, cfg_dir: str, invariant: bool, costs: ModelCosts, args) -> dict:
    t = time.time()
    llm = engine(model, cfg_dir, invariant, args)
    res: dict = {"engine_init_s": round(time.time() - t, 1), "graphs_warmed": llm.graphs_warmed}
    res["decode"] = [decode_speed(llm, costs, b, args.new_tokens) for b in args.batches]
    res["prefill"] = prefill_speed(llm, costs, args.prefill)
    if llm.runner.fast is not None:
        res["decode_stats"] = dict(llm.runner.fast.stats)
    free(llm)
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or RESULTS)
    ap.add_argument("--tiny", action="store_true", help="CPU stand-in (a test of this script)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--check-tokens", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--size", choices=("mini", "mini_v41"), default="mini", help="V4 or V4.1 at mini widths")
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.size == "mini_v41":
        from v41_bounded_replay import mini_v41_config

        cfg = tiny_v41_config(vocab_size=512, sliding_window=32, index_topk=8, candidate_topk_blocks=4) \
            if args.tiny else mini_v41_config()
    else:
        cfg = tiny_config() if args.tiny else mini_config()
    hw = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.tiny else "cpu"
    out: dict = {"commit": os.environ.get("DEEPINFER_COMMIT") or commit(), "hardware": hw, "torch": torch.__version__,
                 "config": cfg.to_official_json(), "args": vars(args) | {"out": None}}
    model = build(cfg, "cpu" if args.tiny else "cuda")
    costs = ModelCosts.of(model)
    cfg_dir = tempfile.mkdtemp(prefix="invariant_cfg_")
    with open(os.path.join(cfg_dir, "config.json"), "w") as f:
        json.dump({**cfg.to_official_json(), "deepinfer_tokenizer": "bundled"}, f)  # random ids: the bundled tokenizer, on purpose
    out["check"] = check(model, cfg_dir, args)
    sync()
    out["default"] = timing(model, cfg_dir, False, costs, args)
    gc.collect()
    out["invariant"] = timing(model, cfg_dir, True, costs, args)
    d, i = out["default"], out["invariant"]
    big = max(args.batches)
    dec = {x["batch"]: x["tok_s"] for x in d["decode"]}
    inv = {x["batch"]: x["tok_s"] for x in i["decode"]}
    out["targets"] = [
        {"name": "invariant greedy + seeded outputs bitwise across batches 1/7/64",
         "value": out["check"]["bitwise_1_7_64"], "target": True, "met": out["check"]["bitwise_1_7_64"]},
        {"name": f"invariant decode b{big} / default", "value": round(inv[big] / dec[big], 3), "target": 0.4,
         "met": inv[big] / dec[big] >= 0.4},
        {"name": f"invariant {args.prefill}-token prefill / default",
         "value": round(i["prefill"]["tok_s"] / d["prefill"]["tok_s"], 3), "target": 0.4,
         "met": i["prefill"]["tok_s"] / d["prefill"]["tok_s"] >= 0.4},
    ]
    os.makedirs(args.out, exist_ok=True)
    tag = result_tag(hw)
    size = "v41_" if args.size == "mini_v41" else ""
    path = os.path.join(args.out, f"invariant_compiled_{size}{tag}_{out['commit'][:7]}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{'mode':10} {'what':>8} {'tok/s':>10}")
    for mode in ("default", "invariant"):
        for x in out[mode]["decode"]:
            print(f"{mode:10} {'b' + str(x['batch']):>8} {x['tok_s']:>10}")
        print(f"{mode:10} {'prefill':>8} {out[mode]['prefill']['tok_s']:>10}")
    print("compiled vs reference tokens equal:", out["check"]["compiled_vs_reference_tokens_equal"])
    for t in out["targets"]:
        print(f"{'MET ' if t['met'] else 'MISS'} {t['name']}: {t['value']} (target {t['target']})")
    print(path)
    return out


if __name__ == "__main__":
    main()
