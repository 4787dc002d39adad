"""Structured-output mask overhead per engine step (fill + apply + accept), by batch size.

    .venv/bin/python benchmarks/structured_mask_overhead.py                 # CPU, batches 1/16/64
    .venv/bin/python benchmarks/structured_mask_overhead.py --device cuda   # on a GPU machine

Real V4 vocabulary (129,280-wide logits), a JSON Schema with nested objects, arrays,
enums, formats and patterns (``deepinfer.structured.bench.BENCH_SCHEMA``); every row
constrained. Prints a table and writes JSON under profiling/results/ with the commit,
the hardware and the full config.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from deepinfer.structured.bench import BENCH_SCHEMA, mask_overhead  # noqa: E402
from deepinfer.structured.manager import StructuredOutputManager  # noqa: E402
from deepinfer.tokenizer import load_tokenizer  # noqa: E402

VOCAB, EOS = 129280, 1


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    sha = git("rev-parse", "HEAD") or "unknown"
    return sha + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default=str(ROOT / "profiling" / "results"))
    args = parser.parse_args(argv)
    batches = tuple(int(b) for b in args.batch_sizes.split(","))
    manager = StructuredOutputManager(load_tokenizer(), VOCAB, EOS, args.device, max_rows=max(batches))
    rows = mask_overhead(manager, batches, steps=args.steps, device=args.device)

    print(f"structured-output overhead per step, {args.device}, vocab {VOCAB}, "
          f"grammar compile {rows[0]['compile_ms']:.1f} ms")
    print(f"{'batch':>6} {'fill ms':>9} {'apply ms':>9} {'accept ms':>10} {'total ms':>9} {'us/row':>8}")
    for r in rows:
        print(f"{r['batch']:>6} {r['fill_ms']:>9.3f} {r['apply_ms']:>9.3f} {r['accept_ms']:>10.3f} "
              f"{r['total_ms']:>9.3f} {1e3 * r['total_ms'] / r['batch']:>8.1f}")

    from importlib.metadata import version
    record = {
        "benchmark": "structured_mask_overhead", "commit": _commit(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hardware": {"device": args.device, "cpu": platform.processor() or platform.machine(),
                     "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                     "load_avg_1min": os.getloadavg()[0],  # shared hosts: other work inflates apply
                     "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None},
        "config": {"batch_sizes": list(batches), "steps": args.steps, "vocab_size": VOCAB,
                   "schema": BENCH_SCHEMA, "torch": torch.__version__, "xgrammar": version("xgrammar"),
                   "python": platform.python_version()},
        "results": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"structured_mask_overhead_{args.device.split(':')[0]}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
