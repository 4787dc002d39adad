#!/usr/bin/env python
"""Run every workbench notebook unchanged on a GPU, through the compiled path, and record it.

    PYTHONPATH=. python3 benchmarks/notebooks_gpu.py [--out DIR] [--only 01,02] [--ckpt /tmp/deepinfer-mini]

Each notebook runs in a fresh kernel with its tagged parameters cell overridden
(``deepinfer.workbench.execute.run_notebook``): the engine notebooks (01-03, 06, and 09's
server) on the `mini` checkpoint (random bf16 weights, written first, as
benchmarks/mini_sweep.py does), 04 on the trained default and its DSpark twin, 07 and 08 on
their own tiny models, all with ``DEVICE="nvidia"`` and ``DTYPE="bfloat16"``; 05 gets the
GPUs only when there are two or more (else its gloo ranks stay on the CPU). Correctness
first: a notebook passes only when every cell, its assert cells included, ran. Then the
wall time per notebook, a short table, and the full JSON (commit, hardware, per-notebook
result, ``targets``) plus the executed notebooks under ``--out`` (default $OUT or
artifacts/notebooks_gpu).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import nbformat
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deepinfer.profiling.records import device_name, git_commit, hardware_name  # noqa: E402
from deepinfer.workbench.execute import run_notebook  # noqa: E402

ENGINE_NOTEBOOKS = ("01", "02", "03", "06", "09")


def params_for(stem: str, ckpt: str, gpus: int, smoke: bool = False) -> dict:
    """The parameters one notebook runs with on this machine (see the module docstring)."""
    gpu = {"DEVICE": "cpu", "DTYPE": "float32"} if smoke else {"DEVICE": "nvidia", "DTYPE": "bfloat16"}
    num = stem[:2]
    if num in ENGINE_NOTEBOOKS:
        return {"MODEL": ckpt, **gpu}
    if num in ("04", "07", "08"):
        return gpu
    if num == "05":
        return gpu if gpus >= 2 else {}
    return {}


def write_record(out: Path, dev: torch.device, gpus: int, ckpt: str, results: list[dict]) -> str:
    """Write the run's JSON (commit, hardware, per-notebook results so far, targets); its name."""
    commit, dirty = git_commit()
    targets = [{"name": f"{r['notebook']} runs top to bottom (asserts included)", "value": int(r["ok"]),
                "target": 1, "met": r["ok"]} for r in results]
    targets += [{"name": f"{r['notebook']} engine on the compiled path", "value": int(bool(r["compiled_path"])),
                 "target": 1, "met": bool(r["compiled_path"])} for r in results if r["compiled_path"] is not None]
    record = {"commit": commit, "dirty": dirty, "hardware": device_name(dev), "host": hardware_name(),
              "num_gpus": gpus, "torch": torch.__version__, "ckpt": ckpt, "notebooks": results, "targets": targets}
    name = f"notebooks_gpu_{device_name(dev).lower().replace(' ', '_')}_{commit[:7]}.json"
    (out / name).write_text(json.dumps(record, indent=1))
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "artifacts" / "notebooks_gpu"))
    parser.add_argument("--only", default="", help="comma-separated notebook numbers, run in this order, e.g. 09,01")
    parser.add_argument("--ckpt", default="/tmp/deepinfer-mini")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="check this script on a CPU: tiny-width mini, DEVICE=cpu, float32 (records nothing)")
    args = parser.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    known = sorted(p.name[:2] for p in (REPO / "notebooks").glob("0[1-9]_*.ipynb"))
    unknown = [n for n in only if n not in known]
    if unknown:
        parser.error(f"--only {','.join(unknown)}: no such notebook; the numbers are {','.join(known)}")
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("notebooks_gpu: no CUDA device; this script records the GPU run (CPU runs are nbval's)")
        return 2
    out = Path(args.out)
    (out / "notebooks").mkdir(parents=True, exist_ok=True)
    if not (Path(args.ckpt) / "model.safetensors.index.json").exists():
        sys.path.insert(0, str(REPO / "benchmarks"))
        from mini_sweep import mini_config

        from deepinfer.models.tiny import write_tiny_checkpoint

        write_tiny_checkpoint(args.ckpt, seed=0, cfg=mini_config(smoke=args.cpu_smoke),
                              dtype=torch.float32 if args.cpu_smoke else torch.bfloat16)
    paths = sorted((p for p in (REPO / "notebooks").glob("0[1-9]_*.ipynb") if not only or p.name[:2] in only),
                   key=lambda p: (only.index(p.name[:2]) if only else 0, p.name))  # --only's order: a short lease runs those first
    gpus = torch.cuda.device_count()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results: list[dict] = []
    name = write_record(out, dev, gpus, args.ckpt, results)
    for path in paths:
        params = params_for(path.stem, args.ckpt, gpus, smoke=args.cpu_smoke)
        t0 = time.perf_counter()
        run = run_notebook(path, params, out_path=out / "notebooks" / path.name, timeout_s=args.timeout)
        executed = nbformat.read(out / "notebooks" / path.name, as_version=4)
        text = "".join(o.get("text", "") for c in executed.cells if c.cell_type == "code"
                       for o in c.get("outputs", []) if o.get("output_type") == "stream")
        compiled = re.search(r"compiled path: (True|False)", text)
        results.append({"notebook": path.stem, "params": params, "ok": run.ok, "wall_s": round(time.perf_counter() - t0, 1),
                        "compiled_path": None if compiled is None else compiled.group(1) == "True",
                        "error": run.error})
        print(f"{path.stem}: {'ok' if run.ok else 'FAILED'} in {results[-1]['wall_s']} s", flush=True)
        name = write_record(out, dev, gpus, args.ckpt, results)  # after each: a killed run keeps what finished
    print(f"\n{'notebook':28} {'ok':>4} {'wall s':>8} compiled")
    for r in results:
        print(f"{r['notebook']:28} {str(r['ok']):>4} {r['wall_s']:8.1f} {r['compiled_path']}")
    print(f"-> {out / name}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
