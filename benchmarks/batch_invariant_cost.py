#!/usr/bin/env python
"""Throughput cost of batch-invariant mode: the same fixed workload with the mode off and on.

    .venv/bin/python benchmarks/batch_invariant_cost.py                     # tiny model, CPU
    .venv/bin/python benchmarks/batch_invariant_cost.py --vocab 512         # small-vocab tiny model
    .venv/bin/python benchmarks/batch_invariant_cost.py --model /ckpt --dtype bfloat16 --device-note h200

Two workloads (seeded, identical for both modes): ``prefill`` (long prompts, 1 new token)
and ``decode`` (short prompts, many new tokens), sampled at temperature 1 with fixed
seq_seeds. Each point is the best of ``--repeats`` runs (a shared machine is noisy).
Prints a table and writes profiling/results/<name>.json with the commit, hardware and
full engine config. On a GPU the mode runs whatever batch-invariant kernels are
registered (deepinfer.batch_invariant.register_kernel), else the torch references.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.batch_invariant import registered_kernels  # noqa: E402
from deepinfer.profiling.records import run_metadata  # noqa: E402

WORKLOADS: dict[str, dict[str, int]] = {
    "prefill": {"requests": 16, "prompt_min": 200, "prompt_max": 400, "new_tokens": 1},
    "decode": {"requests": 32, "prompt_min": 8, "prompt_max": 32, "new_tokens": 32},
}


def workload(name: str, vocab: int, scale: float) -> tuple[list[list[int]], list[SamplingParams]]:
    """Seeded prompts and sampling params of one workload (`scale` multiplies the request count)."""
    spec, rng = WORKLOADS[name], random.Random(name)
    n = max(1, int(spec["requests"] * scale))
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(spec["prompt_min"], spec["prompt_max"]))]
               for _ in range(n)]
    params = [SamplingParams(temperature=1.0, seq_seed=1000 + i, max_tokens=spec["new_tokens"], ignore_eos=True)
              for i in range(n)]
    return prompts, params


def measure(llms: dict[bool, LLM], name: str, scale: float, repeats: int) -> list[dict]:
    """Best-of-`repeats` wall and process-CPU time of one workload for each engine, the
    engines interleaved run by run so load changes on a shared host hit both alike (CPU
    time is the steadier figure there); prefix caching is off so repeats redo the work."""
    first = next(iter(llms.values()))
    prompts, params = workload(name, first.model_config.vocab_size, scale)
    best = {k: [float("inf"), float("inf"), 0] for k in llms}
    for _ in range(repeats):
        for key, llm in llms.items():
            t0, c0 = time.perf_counter(), time.process_time()
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            best[key] = [min(best[key][0], wall), min(best[key][1], cpu), sum(len(o.token_ids) for o in outs)]
    n_in = sum(len(p) for p in prompts)
    return [{"workload": name, "batch_invariant": key, "seconds": wall, "cpu_seconds": cpu,
             "prompt_tokens": n_in, "output_tokens": n_out, "tok_per_s": (n_in + n_out) / wall,
             "out_tok_per_s": n_out / wall, "tok_per_cpu_s": (n_in + n_out) / cpu}
            for key, (wall, cpu, n_out) in best.items()]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the embedded tiny model)")
    p.add_argument("--vocab", type=int, default=None, help="write a tiny checkpoint with this vocab instead")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--scale", type=float, default=1.0, help="multiply every workload's request count")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device-note", default="", help="free text stored in the JSON (e.g. 'h200')")
    p.add_argument("--name", default=None)
    p.add_argument("--out-dir", default=str(ROOT / "profiling" / "results"))
    args = p.parse_args(argv)
    model = args.model
    if args.vocab is not None:
        from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint
        model = write_tiny_checkpoint(str(Path(tempfile.mkdtemp()) / f"deepinfer-tiny-v{args.vocab}"), seed=0,
                                      cfg=tiny_config(vocab_size=args.vocab))

    llms = {inv: LLM(model, dtype=args.dtype, batch_invariant=inv, enable_prefix_caching=False,
                     max_model_len=1024, max_num_batched_tokens=args.max_num_batched_tokens) for inv in (False, True)}
    for llm in llms.values():  # warm-up
        llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
    meta = run_metadata(llms[False], script="benchmarks/batch_invariant_cost.py", workloads=WORKLOADS,
                        scale=args.scale, repeats=args.repeats, device_note=args.device_note,
                        kernels={f"{k}@{d}": v for (k, d), v in registered_kernels().items()})
    meta["engine_config"].pop("batch_invariant", None)  # rows say which
    rows = [row for name in WORKLOADS for row in measure(llms, name, args.scale, args.repeats)]
    off = {r["workload"]: r for r in rows if not r["batch_invariant"]}
    for r in rows:
        r["relative_throughput"] = r["tok_per_s"] / off[r["workload"]]["tok_per_s"]
        r["relative_cpu_throughput"] = r["tok_per_cpu_s"] / off[r["workload"]]["tok_per_cpu_s"]

    print(f"batch-invariant cost: {meta['model']} {meta['dtype']} on {meta['device']} ({meta['hardware']}), "
          f"commit {meta['commit'][:10]}{'-dirty' if meta['dirty'] else ''}")
    print(f"{'workload':>9} {'mode':>5} {'seconds':>8} {'tok/s':>9} {'out tok/s':>10} {'vs off':>7} "
          f"{'cpu s':>7} {'tok/cpu-s':>10} {'vs off':>7}")
    for r in rows:
        print(f"{r['workload']:>9} {'on' if r['batch_invariant'] else 'off':>5} {r['seconds']:>8.3f} "
              f"{r['tok_per_s']:>9.1f} {r['out_tok_per_s']:>10.1f} {r['relative_throughput']:>7.2f} "
              f"{r['cpu_seconds']:>7.3f} {r['tok_per_cpu_s']:>10.1f} {r['relative_cpu_throughput']:>7.2f}")
    name = args.name or f"batch_invariant_cost_{meta['device'].replace(' ', '_').lower()}_{meta['model']}"
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(args.out_dir) / f"{name}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
