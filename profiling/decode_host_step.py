#!/usr/bin/env python
"""Host time of one decode step at a batch x context, with no model: schedule, the step's
device-input layout (block tables at the step's width class), update.

    PYTHONPATH=. python3 profiling/decode_host_step.py [--cells 64x128,64x16384,256x2048,256x16384] [--out DIR]

decode_grid.py found the large-context cells host-bound (the graph's device time far below
the step time, host time per step growing with context). This runs the real Scheduler,
HybridKVCacheManager (V4's three groups, block 128, a 128-token window) and the fast path's
host-input builder on hand-made runner outputs (one sampled token per request per step),
so it isolates the engine's per-step host work from the model and the device. The JSON goes
to ``--out`` as ``decode_host_step_cpu_<commit>.json``; run it at two commits to compare.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

import numpy as np  # noqa: E402
from fastpath_bench import commit  # noqa: E402

from deepinfer.engine.kv_cache_manager import HybridKVCacheManager, KVCacheGroupSpec  # noqa: E402
from deepinfer.engine.outputs import ModelRunnerOutput  # noqa: E402
from deepinfer.engine.request import Request  # noqa: E402
from deepinfer.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from deepinfer.models.fast.decode_graphs import width_class  # noqa: E402
from deepinfer.models.fast.runner import FastPath  # noqa: E402
from deepinfer.profiling.records import save_json  # noqa: E402
from deepinfer.sampling_params import SamplingParams  # noqa: E402

BLOCK = 128
GROUPS = [KVCacheGroupSpec("swa", 128), KVCacheGroupSpec("csa", None), KVCacheGroupSpec("hca", None)]


def host_layout():
    """The fast path's host-input builder, bound to this engine's groups (no device, no model)."""
    names = [g.name for g in GROUPS]
    fields = SimpleNamespace(groups=names)
    try:  # the per-slot table rows, where this commit has them
        from deepinfer.models.fast.table_rows import TableRows
        fields.table_rows = TableRows(names)
    except ImportError:
        pass
    return lambda so, width, rows: FastPath._host_inputs(fields, so, width, rows)


def cell(batch: int, context: int, steps: int) -> dict:
    blocks = {g.name: batch * (context // BLOCK + 4) + 16 for g in GROUPS}
    kv = HybridKVCacheManager(GROUPS, blocks, BLOCK, batch, True)
    sched = Scheduler(SchedulerConfig(batch, 1 << 30, context + steps + 64, BLOCK, True, True), kv)
    rng = np.random.default_rng(0)
    for i in range(batch):
        sched.add_request(Request(str(i), rng.integers(0, 1000, context).tolist(),
                                  SamplingParams(max_tokens=steps + 16, ignore_eos=True)))
    layout = host_layout()

    def step() -> None:
        so = sched.schedule()
        if all(r.num_tokens == 1 for r in so.scheduled):  # decode steps: what the fast path lays out
            layout(so, width_class(max(len(t) for r in so.scheduled for t in r.block_table.values())),
                   len(so.scheduled))
        sched.update(so, ModelRunnerOutput([r.req_id for r in so.scheduled],
                                           [[7] if r.needs_sample else [] for r in so.scheduled]))
    step()  # the prefill (the whole prompt in one chunk)
    for _ in range(5):
        step()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return {"batch": batch, "context": context, "host_ms_per_step": round((time.perf_counter() - t) / steps * 1e3, 3)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default="64x128,64x16384,256x2048,256x16384", help="batch x context, comma-separated")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    cells = [tuple(int(v) for v in c.split("x")) for c in args.cells.split(",")]
    record = {"commit": commit(), "hardware": "cpu", "block_size": BLOCK, "groups": [g.name for g in GROUPS],
              "steps": args.steps, "cells": [cell(b, c, args.steps) for b, c in cells]}
    for c in record["cells"]:
        print(f"batch {c['batch']:>4} x context {c['context']:>6}: {c['host_ms_per_step']:.3f} ms host per step")
    save_json(args.out, f"decode_host_step_cpu_{record['commit'][:7]}.json", record)
    return record


if __name__ == "__main__":
    main()
