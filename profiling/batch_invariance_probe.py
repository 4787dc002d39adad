#!/usr/bin/env python
"""Which ops of the reference path vary with the batch on this machine, with the mode off and on.

    .venv/bin/python profiling/batch_invariance_probe.py [--threads 1] [--dtype float32]

For each op: a target row computed alone vs inside batches of 1..256 random rows at the
first / middle / last position (several targets), counted bitwise. Also the element-wise
ops whose vectorised and scalar-tail CPU loops disagree (the cause of their variance).
tests/test_batch_invariance*.py assert the "on" column; this script shows the "off" one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinfer.batch_invariant import batch_invariant_mode  # noqa: E402
from deepinfer.models import invariant_ops  # noqa: E402
from deepinfer.models.mhc import hc_head, hc_post, hc_pre  # noqa: E402
from deepinfer.models.moe import MoE  # noqa: E402
from deepinfer.models.norm import unweighted_rms_norm  # noqa: E402

SIZES = [1, 2, 3, 7, 16, 64, 256]


def count_variance(fn: Callable[..., torch.Tensor], make: Callable[[int], tuple[torch.Tensor, ...]],
                   targets: int = 4) -> tuple[int, int]:
    """(mismatching placements, placements tried) of target rows alone vs in batches."""
    bad = total = 0
    for _ in range(targets):
        target = make(1)
        ref = fn(*target)
        for n in SIZES:
            for pos in sorted({0, n // 2, n - 1}):
                batch = make(n)
                for t, b in zip(target, batch):
                    b[pos] = t[0]
                total += 1
                bad += not torch.equal(fn(*batch)[pos:pos + 1], ref)
    return bad, total


def vector_vs_scalar(fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype, n: int = 4096) -> int:
    """Elements where the op over a long tensor (vector loop) differs from one element at a
    time (scalar tail)."""
    x = (torch.randn(n) * 4).to(dtype)
    one = torch.stack([fn(x[i:i + 1])[0] for i in range(n)])
    return int(((fn(x) != one) & ~(one.isnan())).sum())


def ops(dtype: torch.dtype) -> dict[str, tuple[Callable[..., torch.Tensor], Callable[[int], tuple[torch.Tensor, ...]]]]:
    """Name -> (fn, make rows) for the ops the model runs over a flattened batch."""
    def rows(*shape: int) -> Callable[[int], tuple[torch.Tensor, ...]]:
        return lambda m: (torch.randn(m, *shape).to(dtype),)

    out: dict[str, tuple[Callable[..., torch.Tensor], Callable[[int], tuple[torch.Tensor, ...]]]] = {}
    for k, n in [(64, 32), (64, 512), (256, 24), (1024, 4096), (4096, 1024)]:
        w = (torch.randn(n, k) * k ** -0.5).to(dtype)
        out[f"linear {k}->{n}"] = (lambda x, w=w: invariant_ops.linear(x, w), rows(k))
    wg = (torch.randn(2, 16, 64) * 0.125).to(dtype)
    out["grouped linear (bmm)"] = (lambda x: invariant_ops.grouped_linear(x, wg), rows(2, 64))
    out["unweighted rms norm"] = (lambda x: unweighted_rms_norm(x, 1e-6), rows(64))
    out["softmax rows"] = (lambda x: torch.softmax(x.float(), -1), rows(4, 37))
    for name in ("sigmoid", "silu", "softplus"):
        out[f"{name} width 8"] = (getattr(invariant_ops, name), rows(8))
    fn, base, scale = torch.randn(24, 256) * 0.05, torch.randn(24) * 0.5, 1 + 0.2 * torch.randn(3)
    out["hc_pre (collapsed)"] = (lambda s: hc_pre(s, fn, base, scale, 20, 1e-6, 1e-6)[2], rows(4, 64))
    out["hc_head"] = (lambda s: hc_head(s, fn[:4], base[:4], scale[:1], 1e-6, 1e-6), rows(4, 64))
    comb = torch.rand(4, 4)
    out["hc_post"] = (lambda o, s: hc_post(o, s, torch.ones(o.shape[0], 4), comb.expand(o.shape[0], 4, 4)),
                      lambda m: (torch.randn(m, 64).to(dtype), torch.randn(m, 4, 64).to(dtype)))
    moe = MoE(64, 32, 8, 2, 1, False, 100, "sqrtsoftplus", 1.5, True, 10.0, dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_((torch.randn(p.shape) * 0.2).to(p.dtype))
    out["MoE (routed + shared)"] = (moe, lambda m: (torch.randn(m, 64).to(dtype), torch.randint(0, 100, (m,))))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32,bfloat16")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    for dtype in (getattr(torch, d) for d in args.dtype.split(",")):
        print(f"\n{dtype}: mismatches / placements (target row alone vs in batches {SIZES})")
        print(f"{'op':>24} {'mode off':>10} {'mode on':>10}")
        for name, (fn, make) in ops(dtype).items():
            with torch.no_grad():
                off = count_variance(fn, make)
                with batch_invariant_mode(True):
                    on = count_variance(fn, make)
            print(f"{name:>24} {off[0]:>4}/{off[1]:<5} {on[0]:>4}/{on[1]:<5}")
        print("vectorised loop vs scalar tail, elements differing of 4096:")
        for name, op in {"sigmoid": torch.sigmoid, "silu": F.silu, "softplus": F.softplus, "exp": torch.exp,
                         "log": lambda x: torch.log(x.abs() + 1e-3), "cos": torch.cos,
                         "rsqrt": lambda x: torch.rsqrt(x.abs() + 1e-3)}.items():
            print(f"{name:>24} {vector_vs_scalar(op, dtype):>10}")


if __name__ == "__main__":
    main()
