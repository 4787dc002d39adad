"""Issue 23's decode grid: decode tok/s over batch x context on engines with mini's default
``max_model_len`` (65,536) and with 1M, each fresh and again after other traffic, through
``LLM.generate`` (random bf16 weights at `mini` widths, one model in memory for both engines).

Per engine: the greedy tokens of fixed prompts (prefix caching off while they run), fresh
and again once warmed, which must be identical on every engine and state (the compiled
path against itself: in bf16 with random weights the reference path flips near-ties, so
the compiled-vs-reference numerics are benchmarks/fastpath_bench.py's per-layer study); then the grid.
A cell (batch b, context c) primes a shared prefix of c - 32 tokens (rounded down to a
block) once, then runs b requests of that prefix plus tokens of their own 1 + ``--steady-repeats``
times (different tails, prefix-cache hits on the shared part), ``--new`` tokens each: the
first call is the cell's first generate, the median of the others its steady state (each
recorded). Cells with b * c above
``--max-cell-tokens`` are left out (their prefill dominates the run's time). Per cell:
decode tok/s and step ms (the requests' first-token -> finished times), the first call's
wall over the steady call's, and the steady call's probes: the device time of one replay of the
step's graph, host time per step outside device waits, allocator retries / device mallocs,
GC time, Triton compiles. Analysis (decode_grid_analysis.py): cliffs against each row's
affine trend and against the same cell on the other engine / fresh, and a diagnosis of
each warmed cell slower than fresh, with the slowest re-run after ``empty_cache`` and
``gc.collect`` (which of them, if any, gives the fresh time back). Also recorded: the decode
graph set (shapes, captures after start) and its memory (accounted by the memory profile
before the KV cache was sized vs what the warm-up measured).

    python3 profiling/decode_grid.py [--out DIR] [--budget-s 150] [--tiny]   # --tiny: CPU stand-in
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))  # fastpath_bench is a benchmark

import numpy as np  # noqa: E402
import torch  # noqa: E402
from decode_grid_analysis import analyse  # noqa: E402
from fastpath_bench import PrebuiltLLM, build, commit, sync  # noqa: E402
from fastpath_check import token_ids  # noqa: E402

from deepinfer import SamplingParams  # noqa: E402
from deepinfer.models.tiny import mini_config, tiny_config  # noqa: E402
from deepinfer.profiling.compiles import TritonCompiles  # noqa: E402
from deepinfer.profiling.records import result_tag  # noqa: E402

TAIL = 32  # tokens of its own per request (at least; the prefix is whole blocks)
REMEDY_MAX_TOKENS = 1 << 20  # the remedies re-run the worst warmed cell only when it is this cheap


class Probe:
    """Host / device counters around one generate call: GC time and collections, CUDA
    allocator retries and device (de)allocations, the async loop's steps and host seconds
    blocked on results, Triton compiles (kernel names), decode graph replays per shape."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def __enter__(self) -> Probe:
        self.gc_s, self._t = 0.0, 0.0
        gc.callbacks.append(self._gc)
        self._compiles = TritonCompiles().__enter__()
        self.compiles = self._compiles.names
        self.mem0 = _alloc_counters()
        loop = getattr(self.llm, "async_loop", None)
        self.loop0 = (loop.stats.steps, loop.stats.wait_s) if loop is not None else None
        fast = self.llm.runner.fast
        self.replays0 = Counter(fast.graphs.replays) if fast is not None else Counter()
        return self

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._t

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._gc)
        self._compiles.__exit__()
        mem1, loop = _alloc_counters(), getattr(self.llm, "async_loop", None)
        self.alloc = {k: mem1[k] - self.mem0[k] for k in mem1} if mem1 and self.mem0 else {}
        self.steps = self.wait_s = None
        if loop is not None and self.loop0 is not None:
            self.steps, self.wait_s = loop.stats.steps - self.loop0[0], loop.stats.wait_s - self.loop0[1]
        fast = self.llm.runner.fast
        self.replays = (Counter(fast.graphs.replays) - self.replays0) if fast is not None else Counter()

    def summary(self, wall: float) -> dict:
        steps = self.steps or 0
        out = {"gc_ms": round(self.gc_s * 1e3, 3), "compiles": len(self.compiles),
               "compiled": sorted(set(self.compiles))[:12], "signatures": self._compiles.signatures[:6],
               "steps": steps,
               "alloc_retries": self.alloc.get("num_alloc_retries"), "device_mallocs": self.alloc.get("num_device_alloc"),
               "device_frees": self.alloc.get("num_device_free"), "pinned_allocs": self.alloc.get("num_host_alloc"),
               "staging_blocks": self.alloc.get("staging_blocks"), "graph_keys": [list(k) for k, _ in
                                                                               self.replays.most_common(2)]}
        out.update(_gpu_state())
        if steps:
            out["wait_ms_per_step"] = round(self.wait_s * 1e3 / steps, 4)
            out["host_busy_ms_per_step"] = round((wall - self.wait_s) * 1e3 / steps, 4)
        return out


def _gpu_state() -> dict:
    """SM clock (MHz), temperature (C) and power draw (W) now, where NVML answers (a
    throttled GPU shows in them); empty otherwise."""
    if not torch.cuda.is_available():
        return {}
    out = {}
    for key, read in (("sm_clock_mhz", torch.cuda.clock_rate), ("temperature_c", torch.cuda.temperature),
                      ("power_w", lambda: torch.cuda.power_draw() / 1000)):
        try:
            out[key] = round(float(read()), 1)
        except Exception:  # no pynvml / NVML on this host: not recorded
            pass
    return out


def _alloc_counters() -> dict:
    """Device allocator counters, pinned host allocations (torch's caching host allocator, and
    our staging rings' own blocks) so far; empty off CUDA."""
    if not torch.cuda.is_available():
        return {}
    from deepinfer.engine.transfer import PinnedRing

    stats = torch.cuda.memory_stats()
    out = {k: int(stats.get(k, 0)) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}
    host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    out["num_host_alloc"] = int(host.get("num_host_alloc", 0))
    out["staging_blocks"] = PinnedRing.allocations
    return out


def _generate(llm, prompts, new: int, probe: bool = False) -> tuple[float, float, dict | None]:
    """(wall s of the call, decode step s from the requests' first-token -> finished times,
    the call's :class:`Probe` summary when asked)."""
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    sync()
    with Probe(llm) as p:
        t = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        sync()
        wall = time.perf_counter() - t
    decode = max(o.metrics.finished_time for o in outs) - max(o.metrics.first_token_time for o in outs)
    return wall, decode / max(new - 1, 1), p.summary(wall) if probe else None


def graph_gpu_ms(llm, key: list | None, reps: int = 10) -> float | None:
    """Device ms of one replay of the decode graph ``key`` on the inputs its last step left
    in its buffer (a decode step rewrites what it wrote: nothing else changes); None off CUDA."""
    fast = llm.runner.fast
    if key is None or fast is None or not torch.cuda.is_available():
        return None
    entry = fast._graphs.get(tuple(key))
    if entry is None:
        return None
    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        entry[0].replay()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / reps, 4)


def block_spread(llm, key: list | None) -> dict | None:
    """The window-group block ids the last step of graph ``key`` read (its persistent
    input buffer): how many, their id span, and the 2 MiB pages of one layer's window pool
    they fall on (a step over blocks scattered through a pool of ~100 GB touches more
    pages than one over neighbouring blocks)."""
    fast = llm.runner.fast
    if key is None or fast is None or tuple(key) not in fast._inputs:
        return None
    pool = next(iter(llm.kv_cache.swa.values()))
    per_block = pool[0].numel() * pool.element_size()
    ids = fast._inputs[tuple(key)].tables["swa"].flatten().tolist()
    used = sorted({b for b in ids if b > 0})
    if not used:
        return None
    return {"blocks": len(used), "id_span": used[-1] - used[0] + 1,
            "pages_2mib": len({b * per_block >> 21 for b in used}), "block_bytes": per_block}


def run_cell(llm, batch: int, ctx: int, new: int, seed: int, steady: int = 3) -> dict:
    """One cell: a first call, then ``steady`` calls of other prompts of the same shape; the
    step time and steady call are the steady calls' medians (one call alone varied widely on
    a lent host: the remedy probe's rerun of a slow warmed cell came back at fresh speed)."""
    vocab, bs = llm.model_config.vocab_size, llm.config.block_size
    prefix = token_ids(seed, max(0, (ctx - TAIL) // bs * bs), vocab)
    if prefix:  # the shared part's blocks computed once: the cell's requests hit them
        llm.generate(prompt_token_ids=[prefix], sampling_params=SamplingParams(max_tokens=1), use_tqdm=False)
    tail = ctx - len(prefix)
    runs = []
    for rep in range(1 + steady):
        # int64 arrays, not lists: a full GC walks every element of a live list, and the cell's
        # own prompts would be charged to the engine's GC time
        prompts = [np.array(prefix + token_ids(seed * 1000 + rep * 500 + i, tail, vocab)) for i in range(batch)]
        runs.append(_generate(llm, prompts, new, probe=True))
    (wall0, _, first), rest = runs[0], runs[1:]
    wall1, step1, diag = sorted(rest, key=lambda r: r[1])[len(rest) // 2]  # the median steady call
    keys = diag.get("graph_keys") or [None]
    diag["graph_gpu_ms"] = graph_gpu_ms(llm, keys[0])
    diag["window_blocks"] = block_spread(llm, keys[0])
    return {"batch": batch, "context": ctx, "tok_s": round(batch / step1, 1), "step_ms": round(step1 * 1e3, 3),
            "steady_step_ms_repeats": [round(r[1] * 1e3, 3) for r in rest],
            # to the microsecond, with every steady call: one first call is weighed against their spread
            "first_call_s": round(wall0, 6), "steady_call_s": round(wall1, 6),
            "steady_call_s_repeats": [round(r[0], 6) for r in rest],
            "first_over_steady": round(wall0 / wall1, 3), "diag": diag,
            "first_call_compiles": {k: first[k] for k in ("compiles", "compiled", "signatures", "gc_ms")}}


def other_traffic(llm, long_len: int, mixed: int = 48, seed: int = 99) -> dict:
    """Serving that is not the grid: one long prompt, then a mixed batch (sampled, top
    log-probs, prompts of many lengths)."""
    vocab = llm.model_config.vocab_size
    t = time.perf_counter()
    llm.generate(prompt_token_ids=[token_ids(seed, long_len, vocab)],
                 sampling_params=SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    cap = min(3000, llm.config.max_model_len - 64)
    prompts = [token_ids(seed + i, 5 + 97 * i % cap, vocab) for i in range(mixed)]
    params = [SamplingParams(temperature=0.8 if i % 2 else 0, top_p=0.9, top_logprobs=i % 3, seq_seed=i,
                             max_tokens=4 + i % 29, ignore_eos=True) for i in range(mixed)]
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    sync()
    return {"long_prompt": long_len, "mixed_requests": len(prompts), "s": round(time.perf_counter() - t, 1)}


def greedy_tokens(llm, new: int, limit: int) -> list[list[int]]:
    """Greedy tokens of fixed prompts (one batch; those that fit ``limit``, the smallest
    engine's max_model_len) with prefix caching off: what they compute depends on nothing
    the engine served before, so every engine and state must agree."""
    vocab = llm.model_config.vocab_size
    prompts = [token_ids(77 + i, n, vocab) for i, n in enumerate((5, 300, 1000)) if n + new < limit]
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    kv = llm.kv_manager
    kv.enable_prefix_caching = False
    try:
        return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)]
    finally:
        kv.enable_prefix_caching = True


def graph_report(llm) -> dict:
    fast, prof = llm.runner.fast, llm.memory_profile
    if fast is None:
        return {"fast_path": False}
    mem = prof.graph if prof is not None else None
    return {"shapes": len(fast.warmed), "largest": list(fast.warmed[0]) if fast.warmed else None,
            "sealed": fast.graphs.sealed, "stats": fast.stats, "measured_bytes": fast.graph_bytes,
            "accounted_bytes": prof.graph_bytes if prof is not None else None,
            "probe_left_bytes": mem.left_bytes if mem is not None else None,
            "probe_eager_peak_bytes": mem.eager_peak_bytes if mem is not None else None,
            "kept_free_bytes": llm.step_peak_bytes, "kv_blocks": dict(llm.kv_cache.num_blocks)}


def remedies(llm, fresh: list[dict], warmed: list[dict], new: int) -> dict | None:
    """The warmed cell slowest against fresh (among cheap ones) run again as is, after
    ``torch.cuda.empty_cache()``, after ``gc.collect()`` and after sorting every block
    pool's free queue by block id (new requests then get neighbouring blocks, as on a fresh
    engine; the LRU order of cached blocks is lost, so it comes last): which one, if any,
    gives the fresh step time back names what the warmed state carries."""
    pairs = [(w["step_ms"] / f["step_ms"], f, w) for f in fresh for w in warmed
             if "step_ms" in f and "step_ms" in w and (f["batch"], f["context"]) == (w["batch"], w["context"])
             and f["batch"] * f["context"] <= REMEDY_MAX_TOKENS]
    if not pairs:
        return None
    ratio, f, w = max(pairs, key=lambda p: p[0])
    out = {"batch": f["batch"], "context": f["context"], "fresh_step_ms": f["step_ms"], "warmed_step_ms": w["step_ms"]}
    vocab, bs = llm.model_config.vocab_size, llm.config.block_size
    seed = f["context"] + f["batch"]  # run_cell's steady call again (its prefix is cached)
    prefix = token_ids(seed, max(0, (f["context"] - TAIL) // bs * bs), vocab)
    prompts = [np.array(prefix + token_ids(seed * 1000 + 500 + i, f["context"] - len(prefix), vocab))
               for i in range(f["batch"])]
    for name, act in (("again", lambda: None), ("after_empty_cache", torch.cuda.empty_cache if torch.cuda.is_available()
                                                else (lambda: None)), ("after_gc_collect", gc.collect),
                      ("after_sorting_free_blocks", lambda: _sort_free_blocks(llm))):
        act()
        out[name] = round(_generate(llm, prompts, new)[1] * 1e3, 3)
    return out


def _sort_free_blocks(llm) -> None:
    """Reorder each pool's free queue by block id (a diagnostic: see :func:`remedies`)."""
    for pool in llm.kv_manager.pools.values():
        pool._free = type(pool._free)((b, None) for b in sorted(pool._free))


def run_engine(model, cfg_dir: str, max_model_len: int, args, budget_end: float, reference: list | None) -> dict:
    t = time.time()
    llm = PrebuiltLLM(model, cfg_dir, dtype="bfloat16", max_model_len=max_model_len, max_num_seqs=max(args.batches))
    res: dict = {"max_model_len": max_model_len, "init_s": round(time.time() - t, 1)}
    captures_at_start = llm.runner.fast.stats["captures"] if llm.runner.fast else 0
    # the first generate after start against the same call again (other prompts of the same shape)
    vocab = llm.model_config.vocab_size
    calls = [_generate(llm, [token_ids(seed + i, args.first_prompt, vocab) for i in range(8)], args.new, probe=True)
             for seed in (11, 12)]
    res["first_generate"] = {"batch": 8, "prompt": args.first_prompt, "first_s": round(calls[0][0], 3),
                             "steady_s": round(calls[1][0], 3), "ratio": round(calls[0][0] / calls[1][0], 3),
                             "first_probe": calls[0][2], "steady_probe": calls[1][2]}
    tokens = {"fresh": greedy_tokens(llm, args.check_tokens, min(args.lens))}
    contexts = [c for c in args.contexts if c + args.new + 1 <= max_model_len]
    for state in ("fresh", "warmed"):
        if state == "warmed":
            res["other_traffic"] = other_traffic(llm, min(args.long, max_model_len - 64), args.mixed)
        cells = []
        for ctx in contexts:
            for b in args.batches:
                if b * ctx > args.max_cell_tokens:
                    continue
                if time.time() > budget_end:
                    cells.append({"batch": b, "context": ctx, "skipped": "time budget"})
                    continue
                cells.append(run_cell(llm, b, ctx, args.new, seed=ctx + b, steady=args.steady_repeats))
        res[state] = cells
    if time.time() < budget_end:
        res["remedies"] = remedies(llm, res["fresh"], res["warmed"], args.new)
    tokens["warmed"] = greedy_tokens(llm, args.check_tokens, min(args.lens))
    reference = reference or tokens["fresh"]
    res["check"] = {"tokens": args.check_tokens, "equal": all(t == reference for t in tokens.values()),
                    "agree_prefix": {s: [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                                         for x, y in zip(t, reference)] for s, t in tokens.items()}}
    res["graphs"] = graph_report(llm)
    res["graphs"]["captures_after_start"] = res["graphs"].get("stats", {}).get("captures", 0) - captures_at_start
    res["_tokens"] = reference
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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    ap.add_argument("--tiny", action="store_true", help="CPU stand-in (tests of this script)")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--contexts", default="128,2048,16384,131072")
    ap.add_argument("--max-model-lens", default="65536,1048576")
    ap.add_argument("--max-cell-tokens", type=int, default=256 * 16384,
                    help="cells with batch x context above this are left out (prefill-bound)")
    ap.add_argument("--new", type=int, default=16, help="tokens per request and cell")
    ap.add_argument("--long", type=int, default=131072, help="the other traffic's long prompt")
    ap.add_argument("--mixed", type=int, default=48, help="the other traffic's mixed requests")
    ap.add_argument("--first-prompt", type=int, default=100, help="prompt tokens of the first generate's 8 requests")
    ap.add_argument("--check-tokens", type=int, default=16)
    ap.add_argument("--budget-s", type=float, default=140, help="cells after this much wall time are skipped")
    ap.add_argument("--steady-repeats", type=int, default=3, help="steady calls per cell (their median counts)")
    args = ap.parse_args(argv)
    if args.steady_repeats < 1:
        ap.error(f"--steady-repeats must be >= 1, got {args.steady_repeats}")
    start = time.time()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.contexts = [int(c) for c in args.contexts.split(",")]
    lens = args.lens = [int(n) for n in args.max_model_lens.split(",")]
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
    reference = None
    for i, n in enumerate(lens):  # the budget is shared: the first engine keeps its share for the second
        share = start + args.budget_s * (i + 1) / len(lens)
        eng = out["engines"][f"max_model_len={n}"] = run_engine(model, cfg_dir, n, args, share, reference)
        reference = eng.pop("_tokens")
    out["flags"], out["targets"], out["diagnoses"] = analyse(out["engines"])
    out["wall_s"] = round(time.time() - start, 1)
    os.makedirs(args.out, exist_ok=True)
    tag = result_tag(hw)
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
    for d in out["diagnoses"]:
        print(f"warmed b{d['batch']} ctx{d['context']} on {d['engine']}: {d['step_ratio']}x fresh; {d['verdict']}")
    for t in out["targets"]:
        print(f"{'ok ' if t['met'] else 'MISS'} {t['name']}: {t['value']} (target {t['target']})")
    print(path)
    return out


if __name__ == "__main__":
    main()
