#!/usr/bin/env python
"""The batch sweep CLI (DeepInfer users know it as the sweep script).

    python benchmarks/sweep.py                                   # tiny model on CPU, < 2 min
    python benchmarks/sweep.py --model /ckpt --dtype bfloat16 --max-model-len 4096 \\
        --workload datasets/workloads/mini_chat.jsonl --prefill-budgets 1024,2048,4096,8192 \\
        --decode-batch-sizes 1,4,16,64 --concurrency 8,32 --name mini-h200

Writes profiling/results/<name>.csv / .json and <name>_prefill.html / <name>_decode.html.
From Python: ``from deepinfer.profiling.sweep import run_sweep, SweepSpec``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from deepinfer.profiling.sweep import SweepSpec, run_sweep
from deepinfer.profiling.workload import DEFAULT_WORKLOAD

__all__ = ["main", "run_sweep", "SweepSpec"]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _value(text: str) -> object:
    """Engine argument values: JSON when it parses (ints, floats, true/false), else a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def build_parser() -> argparse.ArgumentParser:
    """The CLI's arguments; defaults are the tiny-model CPU sweep."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir (default: embedded tiny model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--workload", default=DEFAULT_WORKLOAD, help="JSONL of prompt_len / output_len")
    p.add_argument("--prefill-budgets", type=_ints, default=SweepSpec.prefill_budgets,
                   help="max_num_batched_tokens values for prefill points, comma separated")
    p.add_argument("--decode-batch-sizes", type=_ints, default=SweepSpec.decode_batch_sizes,
                   help="max_num_seqs values for decode points")
    p.add_argument("--concurrency", type=_ints, default=SweepSpec.concurrency,
                   help="max_num_seqs values for closed-loop workload points")
    p.add_argument("--num-requests", type=int, default=SweepSpec.num_workload_requests)
    p.add_argument("--warmup-steps", type=int, default=SweepSpec.warmup_steps)
    p.add_argument("--measure-steps", type=int, default=SweepSpec.measure_steps)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra LLM(...) argument, repeatable (e.g. enable_prefix_caching=false)")
    p.add_argument("--name", default=None, help="result file stem (default: model-device-timestamp)")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "profiling" / "results"))
    p.add_argument("--time-budget", type=float, default=None, help="skip points not started after this many s")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--png", action="store_true", help="also write the charts as PNG (kaleido + a system chromium)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the sweep, write its files, print where they are and the headline rows."""
    args = build_parser().parse_args(argv)
    engine = {"model": args.model, "dtype": args.dtype, "max_model_len": args.max_model_len}
    for item in args.engine_arg:
        key, sep, val = item.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg expects KEY=VALUE, got {item!r}")
        engine[key] = _value(val)
    spec = SweepSpec(workload=args.workload, prefill_budgets=args.prefill_budgets,
                     decode_batch_sizes=args.decode_batch_sizes, concurrency=args.concurrency,
                     num_workload_requests=args.num_requests, warmup_steps=args.warmup_steps,
                     measure_steps=args.measure_steps, seed=args.seed)
    res = run_sweep(spec=spec, engine_kwargs=engine, name=args.name, out_dir=args.out_dir,
                    progress=not args.no_progress, time_budget_s=args.time_budget, write_png=args.png)
    cols = ["kind", "max_num_seqs", "max_num_batched_tokens", "prefill_ms_per_step", "prefill_tok_s_per_device",
            "decode_step_ms", "tok_s_per_user", "tok_s_per_device", "mean_ttft_ms", "mean_tpot_ms"]
    sys.stdout.write(res.df[[c for c in cols if c in res.df]].to_string(index=False, float_format="%.2f") + "\n")
    if res.meta.get("skipped"):
        sys.stdout.write(f"skipped (time budget): {', '.join(res.meta['skipped'])}\n")
    for key, path in res.paths.items():
        sys.stdout.write(f"{key}: {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
