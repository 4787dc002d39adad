#!/usr/bin/env python
"""The index of benchmarks/ and profiling/: the supported command-line benchmarks (every
script in benchmarks/), the one-off studies and GPU checks (every script in profiling/), and
the current result of each benchmark. Results of all of them live in profiling/results.

    python3 profiling/results_index.py            # rewrites profiling/results/INDEX.md
    python3 profiling/results_index.py --check    # exit 1 if INDEX.md is out of date

"Current" = the result file whose recorded commit is the newest in git history (commit
date); files whose commit git does not know (a device tree without history) rank by file
name after those. Every file stays: older ones are the history the notebooks plot.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
BENCH_DIR = HERE.parent / "benchmarks"  # where BENCHMARKS' scripts are (the test checks both folders)
RESULTS = HERE / "results"
INDEX = RESULTS / "INDEX.md"


@dataclass(frozen=True)
class Bench:
    script: str
    what: str
    results: tuple[str, ...]  # glob patterns under profiling/results


#: Supported command-line benchmarks (benchmarks/): stable options, results the notebooks and README read.
BENCHMARKS = (
    Bench("sweep.py", "batch sweep: prefill ms/step vs tok/s, decode tok/s per user vs per device",
          ("tiny-cpu.json", "mini-h200.json")),
    Bench("mini_sweep.py", "writes the `mini` checkpoint, then sweep.py's GPU sweep on it", ("mini-h200.json",)),
    Bench("fastpath_bench.py", "compiled decode / prefill vs transformers, GB/s and TFLOP/s per step",
          ("fastpath_bench_h200*.json",)),
    Bench("compiled_engine_bench.py", "V4 vs V4.1 mini through the whole engine on the compiled path",
          ("compiled_engine_h200_*.json",)),
    Bench("prefill_bench.py", "prefill tok/s of `mini`, bf16 and FP8", ("prefill_bench_h200_mini*.json",)),
    Bench("kernel_bench.py", "per-kernel time vs its torch reference", ("kernel_bench_h200.json",)),
    Bench("async_overlap.py", "sync vs async loop: device idle between steps, host time per step",
          ("async_overlap_*.json",)),
    Bench("host_phases.py", "host time of each engine step function per decode step", ("host_phases_mini*.json",)),
    Bench("spec_host_phases.py", "host time of each speculative step function (verify, draft, copies) per engine step, "
          "beside off", ("spec_host_phases_*.json",)),
    Bench("ep_bench.py", "expert parallel: tok/s per rank, rank load imbalance, all-to-all, before/after EPLB",
          ("ep_bench_*.json",)),
    Bench("spec_step_curve.py", "verify step time curve T(tokens) for DEEPINFER_SPEC_STEP_CURVE",
          ("spec_step_curve_*.json",)),
    Bench("structured_mask_overhead.py", "grammar bitmask fill / apply / accept per step",
          ("structured_mask_overhead_*.json",)),
    Bench("structured_corpus_bench.py", "structured output on the pinned JSONSchemaBench corpus: outcomes, compile time",
          ("structured_corpus_*.json",)),
    Bench("batch_invariant_cost.py", "throughput cost of batch-invariant mode", ("batch_invariant_cost_*.json",)),
    Bench("v41_bounded_replay.py", "V4.1 SWA bounded replay: prefill tok/s and quality, off vs compact",
          ("v41_bounded_replay_*.json",)),
    Bench("notebooks_gpu.py", "every workbench notebook run on a GPU with injected parameters",
          ("notebooks_gpu_*.json",)),
    Bench("serve_h200.py", "deepinfer serve vs LLM.generate: saturation throughput ratio, added TTFT / TPOT at low load",
          ("serve_h200_*.json",)),
    Bench("invariant_compiled_bench.py", "batch-invariant mode on the compiled executor: bitwise across batches, "
          "decode / prefill vs default", ("invariant_compiled_*.json",)),
    Bench("spec_draft_h200.py", "graphed vs eager DSpark draft step: same drafts, draft-step ms, e2e tok/s",
          ("spec_draft_h200_*.json",)),
    Bench("spec_h200.py", "speculative decoding of the trained default (off / MTP / DSpark fixed / scheduled): tok/s "
          "per user and total, acceptance per position, verify + draft step profile, invariant bitwise check",
          ("spec_h200_*.json", "spec_h100_*.json")),
    Bench("v41_prefill_h200.py", "V4.1 compiled prefill / mixed steps vs the reference path, 8k prefill tok/s per "
          "bounded-replay mode", ("v41_prefill_*.json",)),
)
#: One-off studies (profiling/): answered one question at one commit; kept to rerun, not maintained as tools.
STUDIES = ("batch_invariance_probe.py", "compiled_quality.py", "decode_grid.py", "decode_grid_analysis.py", "decode_host_step.py",
           "first_generate_profile.py", "gemm_first_use.py", "fastpath_hf.py", "fastpath_layers.py", "fastpath_numerics.py", "fastpath_roofline.py",
           "fp8_prefill_tuning.py", "kernel_bench_fused.py", "kernel_bench_moe_quant.py", "mhc_tuning.py", "offline_waves.py",
           "prefill_attention_tuning.py", "prefill_host_profile.py", "prefill_profile.py", "prompt_host_cost.py",
           "serve_host_cost.py", "serve_latency_probe.py", "spec_decode_chart.py", "spec_host_profile.py", "trace.py")
#: GPU checks (profiling/): pass / fail runs for a lent device (compile, correctness), plus the session scripts.
CHECKS = ("batch_invariant_compile_check.py", "batch_invariant_gpu.py", "ep_gpu_check.py", "fastpath_check.py",
          "kernel_compile_check.py", "reference_path_gpu.py", "h200_session.sh", "train_default_h200.sh",
          "results_index.py")


def _commit_time(commit: str) -> int | None:
    if not commit:
        return None
    out = subprocess.run(["git", "log", "-1", "--format=%ct", commit], cwd=HERE, capture_output=True, text=True)
    return int(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip().isdigit() else None


def _load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _record(path: Path) -> dict:
    data = _load(path)
    meta = data.get("meta", data) if isinstance(data, dict) else {}
    if not isinstance(meta, dict):
        return {}
    hw = meta.get("device") or meta.get("hardware") or ""
    if isinstance(hw, dict):  # some benches record a hardware dict
        hw = hw.get("gpu") or hw.get("cpu") or hw.get("device") or ""
    return {"commit": str(meta.get("commit") or "")[:10], "hardware": str(hw)}


def newest(files: list[Path], keep: Callable[[dict], bool] | None = None) -> Path | None:
    """The file whose recorded commit is the newest in git history (unknown commits rank
    below known ones, then by name), among those whose parsed JSON ``keep`` accepts."""
    if keep is not None:
        files = [p for p in files if keep(_load(p))]
    if not files:
        return None
    times = {p: _commit_time(_record(p).get("commit", "")) for p in files}
    return max(files, key=lambda p: (times[p] is not None, times[p] or 0, p.name))


def current(bench: Bench) -> tuple[Path | None, int, dict]:
    """(current result file, number of result files, its commit / hardware)."""
    files = sorted({p for pat in bench.results for p in RESULTS.glob(pat)})
    best = newest(files)
    return best, len(files), _record(best) if best else {}


def render() -> str:
    lines = ["# benchmarks/ and profiling/: benchmarks, studies, checks and their current results",
             "", "Generated by `python3 profiling/results_index.py` (do not edit by hand).", "",
             "## Supported command-line benchmarks", "",
             "| script | measures | current result | commit | hardware | files |", "|---|---|---|---|---|---|"]
    for b in BENCHMARKS:
        path, n, rec = current(b)
        res = f"`results/{path.name}`" if path else "none yet"
        lines.append(f"| `benchmarks/{b.script}` | {b.what} | {res} | {rec.get('commit', '')} | {rec.get('hardware', '')} | {n} |")
    lines += ["", "## One-off studies (profiling/)", "", ", ".join(f"`{s}`" for s in STUDIES),
              "", "## GPU checks and session scripts (profiling/)", "", ", ".join(f"`{s}`" for s in CHECKS), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if INDEX.md differs from what would be written")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        ok = INDEX.exists() and INDEX.read_text() == text
        print("INDEX.md is up to date" if ok else "INDEX.md is out of date: run python3 profiling/results_index.py")
        return 0 if ok else 1
    INDEX.write_text(text)
    print(f"wrote {INDEX}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
