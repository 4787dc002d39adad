"""Compile every Triton kernel a fast-path decode step launches for an H200 (sm_90),
on a machine without a GPU: catches compile errors before device time is spent.

A child process runs the decode step of a random model on the ``meta`` device (shapes
and strides only, no data, no GPU) under the Triton interpreter with the kernels'
launches recorded instead of run; this process then compiles each distinct launch
(kernel, constexprs, argument types) with ``triton.compile`` for ``GPUTarget("cuda", 90,
32)`` and the launch's own options (the interpreter's patched language cannot compile,
hence two processes). Prints one line per kernel (compile seconds, shared memory, register spill stores in the SASS) and exits non-zero
on a failure.

    python profiling/kernel_compile_check.py [--size mini|flash4] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

_OPTIONS = {"num_warps", "num_stages", "enable_fp_fusion", "num_ctas"}
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
          torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1"}


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i64" if abs(value) >= 2 ** 31 else "i32"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unsupported kernel argument {value!r}")


class Recorder:
    """Replaces the interpreter's launch with a record of (kernel, signature, constexprs)."""

    def __init__(self) -> None:
        self.launches: dict[tuple, dict] = {}

    def __enter__(self) -> Recorder:
        import triton.runtime.interpreter as interp

        self._interp = interp
        self._run = interp.InterpretedFunction.run
        recorder = self

        def run(fn_self, *args, grid, warmup, **kwargs):
            fn = fn_self.fn
            names = list(fn.__code__.co_varnames[:fn.__code__.co_argcount])
            bound = dict(zip(names, args))
            bound.update({k: v for k, v in kwargs.items() if k not in _OPTIONS})
            options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
            const_names = [n for n in names if "constexpr" in str(fn.__annotations__.get(n, ""))]
            consts = {n: (False if n == "INTERP" else bound[n]) for n in const_names}
            sig = {n: ("constexpr" if n in consts else _arg_type(bound[n])) for n in names}
            key = (fn.__name__, tuple(sorted(consts.items())), tuple(sig.values()))
            recorder.launches.setdefault(key, {"module": fn.__module__, "kernel": fn.__name__, "signature": sig,
                                               "constexprs": consts, "options": options})

        interp.InterpretedFunction.run = run
        return self

    def __exit__(self, *exc) -> None:
        self._interp.InterpretedFunction.run = self._run


def record_decode_step(size: str, batch: int) -> Recorder:
    """One decode step of a random `size` model on the meta device, launches recorded."""
    from deepinfer.models.tiny import flash4_config

    from deepinfer.models.fast.decode import kernel_ops
    from deepinfer.models.fast.runner import FastPath
    from deepinfer.models.paged_batch import ForwardBatch, SeqMeta
    from deepinfer.models.registry import build_model, family_of, new_kv_cache
    from deepinfer.models.tiny import mini_config

    cfg = mini_config() if size == "mini" else flash4_config()
    with torch.device("meta"):
        model = build_model(cfg, torch.bfloat16).eval()
    groups = family_of(cfg).kv_group_names(cfg)
    width, bs = 4, 128
    cache = new_kv_cache(cfg, {g: batch * width for g in groups}, bs, batch, torch.bfloat16, "meta")
    fast = FastPath(model, cache, kernel_ops("triton"), graphs=False)
    pos = 3 * bs + 7
    reqs, seqs = [], []
    for i in range(batch):
        table = {g: list(range(i * width, (i + 1) * width)) for g in groups}
        reqs.append(SimpleNamespace(num_tokens=1, is_new=False, needs_sample=True, start_pos=pos, state_slot=i,
                                    block_table=table))
        seqs.append(SeqMeta(pos, 1, i, table, i))
    ids = torch.zeros(batch, dtype=torch.long, device="meta")
    step = ForwardBatch(ids, torch.full((batch,), pos, device="meta"), seqs)
    recorder = Recorder()
    with recorder, torch.no_grad():
        step.decode = fast.prepare(SimpleNamespace(scheduled=reqs), step)
        fast.eager_logits(step)
    return recorder


def _spill_stores(compiled) -> int | None:
    """Register spills: local-memory stores (STL) in the kernel's SASS (None without cuobjdump)."""
    try:
        from triton.tools.disasm import get_sass

        return sum(1 for line in get_sass(compiled.asm["cubin"]).splitlines() if " STL" in line)
    except Exception:
        return None


def compile_all(launches: list[dict], arch: int = 90) -> list[dict]:
    """Compile recorded launches (a process without TRITON_INTERPRET: real JITFunctions)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    rows = []
    for spec in sorted(launches, key=lambda s: s["kernel"]):
        t = time.time()
        consts = {k: v for k, v in spec["constexprs"].items() if k != "INTERP"}
        row = {"kernel": spec["kernel"], "constexprs": consts}
        try:
            fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
            opts = {k: v for k, v in spec["options"].items() if k in ("num_warps", "num_stages", "enable_fp_fusion")}
            compiled = triton.compile(ASTSource(fn, spec["signature"], spec["constexprs"]), target=target,
                                      options=opts)
            row.update(ok=True, shared=compiled.metadata.shared, seconds=round(time.time() - t, 1),
                       spill_stores=_spill_stores(compiled))
        except Exception as exc:  # report every failing kernel, then fail
            row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:800]}")
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="mini", choices=["mini", "flash4"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--only", default="", help="comma-separated kernel names (default: all)")
    parser.add_argument("--record", help=argparse.SUPPRESS)  # child: write the launches here
    args = parser.parse_args()
    if args.record:
        with open(args.record, "w") as f:
            json.dump(list(record_decode_step(args.size, args.batch).launches.values()), f)
        return
    path = os.path.join(tempfile.mkdtemp(), "launches.json")
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # wrappers accept non-CUDA tensors; launches recorded, not run
    subprocess.run([sys.executable, __file__, "--size", args.size, "--batch", str(args.batch), "--record", path],
                   check=True, env=env)
    env_interp = os.environ.pop("TRITON_INTERPRET", None)
    with open(path) as f:
        launches = [s for s in json.load(f) if not args.only or s["kernel"] in args.only.split(",")]
    rows = compile_all(launches)
    if env_interp is not None:
        os.environ["TRITON_INTERPRET"] = env_interp
    bad = [r["kernel"] for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} kernels compile for sm_90" + (f"; failed: {bad}" if bad else ""))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
