"""Issue 23's decode grid: decode tok/s over batch x context on engines with mini's default
``max_model_len`` (65,536) and with 1M, each fresh and again after other traffic, through
``LLM.generate`` (random bf16 weights at `mini` widths, one model in memory for both engines).

Per engine: a greedy check of the compiled path against the reference path first; then the
grid. A cell (batch b, context c) primes a shared prefix of c - 32 tokens (rounded down to a
block) once, then runs b requests of that prefix plus 32 tokens of their own twice (different
tails, prefix-cache hits on the shared part: the contexts are real for attention, the
prefill is cheap), ``--new`` tokens each: the first call is the cell's first generate, the
second its steady state. Reported per cell: decode tok/s and step ms (from the requests'
first-token -> finished times), the first call's wall over the second's. A cell is flagged
when its step time is > 1.5x its row's trend (a least-squares line of log step time over
log context through the row's other cells), or > 1.5x the same cell on the other engine or
fresh state. Also recorded: the decode graph set (shapes, captures after start, eager /
uncaptured steps) and its memory (bound accounted before the KV cache was sized against
what the warm-up measured).

    python3 profiling/decode_grid.py [--out DIR] [--budget-s 420] [--tiny]   # --tiny: CPU stand-in
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
from fastpath_bench import PrebuiltLLM, build, commit, sync  # noqa: E402
from fastpath_check import token_ids  # noqa: E402

from deepinfer import SamplingParams  # noqa: E402
from deepinfer.engine.memory_profile import decode_graph_memory  # noqa: E402
from deepinfer.models.tiny import mini_config, tiny_config  # noqa: E402

TAIL = 32  # tokens of its own per request
SLOW = 1.5  # a cell this much slower than its trend / its twin is flagged


def trend_flags(xs: list[float], ys: list[float], limit: float = SLOW) -> list[float | None]:
    """For each point, y over the trend of the others (a least-squares line of log y over
    log x through them); None where fewer than two others exist. A cliff is a ratio > limit."""
    out: list[float | None] = []
    for i in range(len(xs)):
        pts = [(math.log(x), math.log(y)) for j, (x, y) in enumerate(zip(xs, ys)) if j != i and y > 0]
        if len(pts) < 2 or ys[i] <= 0:
            out.append(None)
            continue
        mx, my = sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts)
        var = sum((p[0] - mx) ** 2 for p in pts)
        slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / var if var > 0 else 0.0
        out.append(round(ys[i] / math.exp(my + slope * (math.log(xs[i]) - mx)), 3))
    return out


def _generate(llm, prompts, new: int) -> tuple[float, float]:
    """(wall s of the call, decode step s from the requests' first-token -> finished times)."""
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    sync()
    t = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    sync()
    wall = time.perf_counter() - t
    decode = max(o.metrics.finished_time for o in outs) - max(o.metrics.first_token_time for o in outs)
    return wall, decode / max(new - 1, 1)


def run_cell(llm, batch: int, ctx: int, new: int, seed: int) -> dict:
    vocab, bs = llm.model_config.vocab_size, llm.config.block_size
    prefix = token_ids(seed, max(0, (ctx - TAIL) // bs * bs), vocab)
    if prefix:  # the shared part's blocks computed once: the cell's requests hit them
        llm.generate(prompt_token_ids=[prefix], sampling_params=SamplingParams(max_tokens=1), use_tqdm=False)
    tail = ctx - len(prefix)
    runs = []
    for rep in range(2):
        prompts = [prefix + token_ids(seed * 1000 + rep * 500 + i, tail, vocab) for i in range(batch)]
        runs.append(_generate(llm, prompts, new))
    (wall0, _), (wall1, step1) = runs
    return {"batch": batch, "context": ctx, "tok_s": round(batch / step1, 1), "step_ms": round(step1 * 1e3, 3),
            "first_call_s": round(wall0, 3), "steady_call_s": round(wall1, 3),
            "first_over_steady": round(wall0 / wall1, 3)}


def other_traffic(llm, long_len: int, seed: int = 99) -> dict:
    """Serving that is not the grid: one long prompt, then a mixed batch (sampled, top
    log-probs, prompts of many lengths)."""
    vocab = llm.model_config.vocab_size
    t = time.perf_counter()
    llm.generate(prompt_token_ids=[token_ids(seed, long_len, vocab)],
                 sampling_params=SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    cap = min(3000, llm.config.max_model_len - 64)
    prompts = [token_ids(seed + i, 5 + 97 * i % cap, vocab) for i in range(48)]
    params = [SamplingParams(temperature=0.8 if i % 2 else 0, top_p=0.9, top_logprobs=i % 3, seq_seed=i,
                             max_tokens=4 + i % 29, ignore_eos=True) for i in range(48)]
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    sync()
    return {"long_prompt": long_len, "mixed_requests": len(prompts), "s": round(time.perf_counter() - t, 1)}


def greedy_check(llm, new: int) -> dict:
    """Greedy tokens of the compiled path against the reference path on the same engine."""
    vocab = llm.model_config.vocab_size
    prompts = [token_ids(77 + i, n, vocab) for i, n in enumerate((5, 300))]
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    fast = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)]
    saved = llm.runner.fast, llm.runner.fast_prefill
    llm.runner.fast = llm.runner.fast_prefill = None
    try:
        ref = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)]
    finally:
        llm.runner.fast, llm.runner.fast_prefill = saved
    agree = [next((i for i, (a, b) in enumerate(zip(f, r)) if a != b), len(f)) for f, r in zip(fast, ref)]
    return {"tokens": new, "agree_prefix": agree, "exact": all(a == new for a in agree)}


def graph_report(llm, accounted: dict) -> dict:
    fast = llm.runner.fast
    if fast is None:
        return {"fast_path": False}
    return {"shapes": len(fast.warmed), "largest": list(fast.warmed[0]) if fast.warmed else None,
            "sealed": fast.graphs.sealed, "stats": fast.stats, "measured_bytes": fast.graph_bytes,
            "accounted_bytes": accounted.get("bytes"), "kept_free_bytes": llm.step_peak_bytes,
            "kv_blocks": dict(llm.kv_cache.num_blocks)}


def run_engine(model, cfg_dir: str, max_model_len: int, args, budget_end: float) -> dict:
    t = time.time()
    llm = PrebuiltLLM(model, cfg_dir, dtype="bfloat16", max_model_len=max_model_len, max_num_seqs=max(args.batches))
    res: dict = {"max_model_len": max_model_len, "init_s": round(time.time() - t, 1)}
    captures_at_start = llm.runner.fast.stats["captures"] if llm.runner.fast else 0
    # the first generate after start against the same call again (other prompts of the same shape)
    vocab = llm.model_config.vocab_size
    calls = [_generate(llm, [token_ids(seed + i, 100, vocab) for i in range(8)], args.new) for seed in (11, 12)]
    res["first_generate"] = {"batch": 8, "prompt": 100, "first_s": round(calls[0][0], 3),
                             "steady_s": round(calls[1][0], 3), "ratio": round(calls[0][0] / calls[1][0], 3)}
    try:  # what the engine accounted for its graphs before sizing the cache (the same probe again)
        graph, bound = decode_graph_memory(llm.model, llm.config, llm.device)
        res["graph_accounted"] = {"bytes": bound, "probe_pool_bytes": graph.pool_bytes if graph else None,
                                  "probe_eager_peak_bytes": graph.eager_peak_bytes if graph else None}
    except Exception as exc:  # recorded (e.g. no memory left for the probe next to the cache)
        res["graph_accounted"] = {"error": repr(exc)}
    res["check"] = greedy_check(llm, args.check_tokens)
    contexts = [c for c in args.contexts if c + args.new + 1 <= max_model_len]
    for state in ("fresh", "warmed"):
        if state == "warmed":
            res["other_traffic"] = other_traffic(llm, min(args.long, max_model_len - 64))
        cells = []
        for ctx in contexts:
            for b in args.batches:
                if time.time() > budget_end:
                    cells.append({"batch": b, "context": ctx, "skipped": "time budget"})
                    continue
                cells.append(run_cell(llm, b, ctx, args.new, seed=ctx + b))
        res[state] = cells
    res["graphs"] = graph_report(llm, res["graph_accounted"])
    res["graphs"]["captures_after_start"] = res["graphs"].get("stats", {}).get("captures", 0) - captures_at_start
    fast = llm.runner.fast
    if fast is not None:
        fast.graphs.release()
    for value in vars(llm.kv_cache).values():  # free the cache even if something still refers to the engine
        if isinstance(value, (dict, list)):
            value.clear()
    del llm, fast
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def analyse(engines: dict) -> tuple[list[dict], list[dict]]:
    """(flagged cells, targets)."""
    flags, firsts, twins = [], [], []
    for name, eng in engines.items():
        for state in ("fresh", "warmed"):
            cells = [c for c in eng.get(state, []) if "step_ms" in c]
            for b in sorted({c["batch"] for c in cells}):
                row = sorted((c for c in cells if c["batch"] == b), key=lambda c: c["context"])
                ratios = trend_flags([c["context"] for c in row], [c["step_ms"] for c in row])
                for c, r in zip(row, ratios):
                    c["over_row_trend"] = r
                    if r is not None and r > SLOW:
                        flags.append({"engine": name, "state": state, "why": "row trend", **c})
            firsts += [c["first_over_steady"] for c in cells]
    # the same cell on the other engine / the other state
    index = {(n, s, c["batch"], c["context"]): c for n, e in engines.items() for s in ("fresh", "warmed")
             for c in e.get(s, []) if "step_ms" in c}
    for (n, s, b, ctx), c in index.items():
        for other in [(m, s, b, ctx) for m in engines if m != n] + [(n, "fresh", b, ctx)] * (s == "warmed"):
            if other in index:
                r = c["step_ms"] / index[other]["step_ms"]
                twins.append(r)
                if r > SLOW:
                    flags.append({"engine": n, "state": s, "why": f"vs {other[0]} {other[1]}", "ratio": round(r, 3),
                                  **c})
    first_call = [e["first_generate"]["ratio"] for e in engines.values() if "first_generate" in e]
    mem = [e["graphs"]["measured_bytes"] / e["graphs"]["accounted_bytes"] for e in engines.values()
           if e.get("graphs", {}).get("measured_bytes") and e["graphs"].get("accounted_bytes")]
    rows = [("cells slower than 1.5x their row trend or twin", len(flags), 0, len(flags) == 0),
            ("worst step-time ratio vs the same cell on the other engine / fresh", max(twins, default=float("nan")),
             SLOW, bool(twins) and max(twins) <= SLOW),
            ("first generate after start / steady state", max(first_call, default=float("nan")), 1.1,
             bool(first_call) and max(first_call) <= 1.1),
            ("worst first / steady call of any cell", max(firsts, default=float("nan")), 1.1,
             bool(firsts) and max(firsts) <= 1.1),
            ("graph captures after start", sum(e.get("graphs", {}).get("captures_after_start", 0)
                                               for e in engines.values()), 0, None),
            ("graph memory measured / accounted", max(mem, default=float("nan")), 1.0, bool(mem) and max(mem) <= 1.0),
            ("greedy check exact on every engine", float(all(e.get("check", {}).get("exact") for e in engines.values())),
             1.0, all(e.get("check", {}).get("exact") for e in engines.values()))]
    targets = [{"name": n, "value": round(v, 3) if isinstance(v, float) else v, "target": t,
                "met": m if m is not None else v == t} for n, v, t, m in rows]
    return flags, targets


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    ap.add_argument("--tiny", action="store_true", help="CPU stand-in (tests of this script)")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--contexts", default="128,2048,16384,131072")
    ap.add_argument("--max-model-lens", default="65536,1048576")
    ap.add_argument("--new", type=int, default=16, help="tokens per request and cell")
    ap.add_argument("--long", type=int, default=131072, help="the other traffic's long prompt")
    ap.add_argument("--check-tokens", type=int, default=16)
    ap.add_argument("--budget-s", type=float, default=420, help="cells after this much wall time are skipped")
    args = ap.parse_args(argv)
    start = time.time()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.contexts = [int(c) for c in args.contexts.split(",")]
    lens = [int(n) for n in args.max_model_lens.split(",")]
    if args.tiny:
        cfg = tiny_config(vocab_size=512, sliding_window=32, index_topk=4, max_position_embeddings=max(lens))
    else:
        cfg = mini_config(max_position_embeddings=max(lens))  # one model: both engines, the same weights
    device = "cpu" if args.tiny else "cuda"
    hw = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    model = build(cfg, device)
    cfg_dir = tempfile.mkdtemp(prefix="decode_grid_cfg_")
    with open(os.path.join(cfg_dir, "config.json"), "w") as f:
        json.dump({**cfg.to_official_json(), "deepinfer_tokenizer": "bundled"}, f)  # random ids: the bundled tokenizer, on purpose
    out: dict = {"commit": os.environ.get("DEEPINFER_COMMIT") or commit(), "hardware": hw,
                 "torch": torch.__version__, "config": cfg.to_official_json(), "args": vars(args) | {"out": None},
                 "engines": {}}
    for i, n in enumerate(lens):  # the budget is shared: the first engine keeps its share for the second
        share = start + args.budget_s * (i + 1) / len(lens)
        out["engines"][f"max_model_len={n}"] = run_engine(model, cfg_dir, n, args, share)
    out["flags"], out["targets"] = analyse(out["engines"])
    out["wall_s"] = round(time.time() - start, 1)
    os.makedirs(args.out, exist_ok=True)
    tag = "h200" if "H200" in hw else ("cpu" if hw == "cpu" else hw.replace(" ", "_").lower())
    path = os.path.join(args.out, f"decode_grid_{tag}_{out['commit'][:7]}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    for name, eng in out["engines"].items():
        for state in ("fresh", "warmed"):
            print(f"{name} {state}: decode tok/s (rows: batch; columns: context {args.contexts})")
            for b in args.batches:
                cells = {c["context"]: c for c in eng.get(state, []) if c["batch"] == b and "tok_s" in c}
                print(f"  b{b:<4}" + "".join(f"{cells[c]['tok_s']:>10.0f}" if c in cells else f"{'-':>10}"
                                           for c in args.contexts))
    for t in out["targets"]:
        print(f"{'ok ' if t['met'] else 'MISS'} {t['name']}: {t['value']} (target {t['target']})")
    print(path)
    return out


if __name__ == "__main__":
    main()
