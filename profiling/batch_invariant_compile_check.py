"""Compile the batch-invariant kernels (kernels/batch_invariant_*.py) for an H200 (sm_90) on
a machine without a GPU, with the launch configurations a GPU run uses.

A child process calls every kernel wrapper at the `mini` model's widths (bf16 and the
float32 GEMMs of mHC / the indexer / V4.1's router) under the Triton interpreter with
the launches recorded instead of run (profiling/kernel_compile_check.py's Recorder) and
the wrappers' ``interpreting()`` switched off, so the tile sizes, warps and stages are
the GPU ones; this process compiles each distinct launch with ``triton.compile`` for
``GPUTarget("cuda", 90, 32)``. One line per kernel; exits non-zero on a failure.

    .venv/bin/python profiling/batch_invariant_compile_check.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

MODULES = ("batch_invariant_matmul", "batch_invariant_attention", "batch_invariant_moe", "batch_invariant_row_sum",
           "batch_invariant_cumsum")


def record() -> list[dict]:
    """Every wrapper once per dtype / width the mini model uses, launches recorded."""
    import importlib

    from kernel_compile_check import Recorder

    from deepinfer import batch_invariant as bi
    from deepinfer.models.moe import MoE

    bi.load_builtin_kernels("cpu")
    for name in MODULES:  # GPU tilings: the wrappers ask interpreting() for their configuration
        importlib.import_module(f"deepinfer_kernels.{name}").interpreting = lambda: False
    k = {op: bi.get_kernel(op, "cpu") for op in bi.OPS}
    bf, f32 = torch.bfloat16, torch.float32
    moe = MoE(1024, 512, 64, 6, 1, False, 100, "sqrtsoftplus", 1.5, True, 10.0, bf)
    for p in moe.parameters():
        p.data.normal_()
    with Recorder() as rec, torch.no_grad():
        for kk, dt in ((1024, bf), (512, bf), (4096, bf), (1000, bf), (4096, f32), (1024, f32), (128, f32)):
            k["linear"](torch.zeros(3, kk, dtype=dt), torch.zeros(64, kk, dtype=dt))
        q, keys = torch.zeros(5, 16, 512, dtype=bf), torch.zeros(5, 512, dtype=bf)
        pos, sink = torch.arange(5), torch.zeros(16)
        k["attention"](q, pos, keys, 0, 128, torch.zeros(2, 512, dtype=bf), torch.ones(5, 2, dtype=torch.bool),
                       sink, 512 ** -0.5)
        k["attention"](q, pos, keys, 0, 128, None, None, sink, 512 ** -0.5)
        k["moe"](moe, torch.zeros(7, 1024, dtype=bf), torch.zeros(7, dtype=torch.long))
        for d, dt in ((1024, f32), (512, bf), (4096, f32), (128, bf)):
            for square in (False, True):
                k["row_sum"](torch.zeros(3, d, dtype=dt), square)
        k["row_cumsum"](torch.zeros(2, 129280))
    return list(rec.launches.values())


def main() -> None:
    if "--record" in sys.argv:
        with open(sys.argv[sys.argv.index("--record") + 1], "w") as f:
            json.dump(record(), f)
        return
    from kernel_compile_check import compile_all

    path = os.path.join(tempfile.mkdtemp(), "launches.json")
    subprocess.run([sys.executable, __file__, "--record", path], check=True, env={**os.environ, "TRITON_INTERPRET": "1"})
    os.environ.pop("TRITON_INTERPRET", None)
    with open(path) as f:
        launches = json.load(f)
    rows = compile_all(launches)
    bad = [r["kernel"] for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} batch-invariant launches compile for sm_90"
          + (f"; failed: {bad}" if bad else ""))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
