"""CPU seconds each process of a served load spends per streamed token: the API server, the
engine process and the benchmark client, measured apart.

At saturation on an H200 (`benchmarks/serve_h200.py`, batch 64) the engine steps every ~3 ms,
so the server must stream ~20k tokens a second: its event loop (HTTP, SSE, one delta per
stream per step) and the client's have a budget of ~50 us per token each. These costs do not
depend on the model's speed, so a CPU run measures them: the processes' own CPU clocks
(user + system, from /proc through psutil) over one load, divided by the tokens streamed.
The engine process's share includes its model on CPU here and is reported for completeness.
With ``--profile`` the server's process runs under cProfile (its top functions by own
time are written beside the result).

    python3 profiling/serve_host_cost.py [--num-prompts 128] [--concurrency 64] [--output-len 48]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import psutil  # noqa: E402

from deepinfer.profiling.records import git_commit, hardware_name  # noqa: E402
from deepinfer.serve.bench import BenchConfig, run_bench, summarize  # noqa: E402
from deepinfer.serve.launch import start_server  # noqa: E402

SERVER_UNDER_PROFILE = r"""
import cProfile, pstats, signal, sys
from deepinfer.cli import main
prof = cProfile.Profile()
def stop(*_):
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").dump_stats(sys.argv[1])
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
prof.enable()
main(["serve"] + sys.argv[2:])
"""


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def bench(url: str, args: argparse.Namespace, n: int) -> tuple[dict, float, float]:
    """One `deepinfer bench serve` run in this process: (its summary, client CPU s, wall s).
    This process's clock covers the client alone: the server and engine are other processes."""
    cfg = BenchConfig(base_url=url, num_prompts=n, random_input_len=args.input_len,
                      random_output_len=args.output_len, max_concurrency=args.concurrency)
    cpu0, t0 = time.process_time(), time.perf_counter()
    results, wall, _ = asyncio.run(run_bench(cfg))
    cpu = time.process_time() - cpu0
    summary = summarize(cfg, results, wall)
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed: {summary['errors']}")
    return summary, cpu, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    ap.add_argument("--model", default=None, help="default: the embedded deepinfer-tiny")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--profile", action="store_true", help="run the server's process under cProfile")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    flags = ["--max-num-seqs", str(args.concurrency), "--max-model-len", "256",
             "--log-level", "warning"] + (["--model", args.model] if args.model else [])
    prof_path = os.path.join(args.out, "serve_host_cost_server.prof")
    server = start_server(flags, cwd=ROOT, command=[sys.executable, "-c", SERVER_UNDER_PROFILE, prof_path]
                          if args.profile else None)
    url = server.url
    try:
        api = psutil.Process(server.pid)
        # the engine process: the child that built a model (multiprocessing's resource tracker is one too)
        engine = max(api.children(recursive=True), key=cpu_s)
        bench(url, args, 8)
        api0, eng0 = cpu_s(api), cpu_s(engine)
        result, client_cpu, wall = bench(url, args, args.num_prompts)
        api_cpu, eng_cpu = cpu_s(api) - api0, cpu_s(engine) - eng0
    finally:
        server.stop(timeout=60)
    tokens = result["total_output_tokens"]
    rows = {"api_server": api_cpu, "engine_process": eng_cpu, "bench_client": client_cpu}
    record = {"study": "serve_host_cost", "commit": git_commit(ROOT)[0], "hardware": hardware_name(),
              "args": vars(args), "wall_s": wall, "output_tokens": tokens,
              "bench": {k: result[k] for k in ("output_throughput", "ttft_ms", "itl_ms", "tpot_ms")},
              "cpu_s": rows, "cpu_us_per_token": {k: v / tokens * 1e6 for k, v in rows.items()}}
    path = os.path.join(args.out, f"serve_host_cost_{record['commit'][:7]}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"{'process':16s} {'CPU s':>8s} {'us/token':>9s}")
    for k, v in rows.items():
        print(f"{k:16s} {v:8.2f} {v / tokens * 1e6:9.1f}")
    print(f"{tokens} tokens in {wall:.1f} s; {path}")


if __name__ == "__main__":
    main()
