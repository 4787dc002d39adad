#!/usr/bin/env python
"""Which ops of the reference path vary with the batch on this machine, with the mode off and on.

    .venv/bin/python profiling/batch_invariance_probe.py [--threads 1] [--dtype float32]
    python3 profiling/batch_invariance_probe.py --device cuda --wide --dtype bfloat16   # a GPU, mini widths

For each op: a target row computed alone vs inside batches of 1..256 random rows at the
first / middle / last position (several targets), counted bitwise; attention: each query
of a request computed in one chunk vs alone (a decode step) vs in other chunkings. Also
(CPU) the element-wise ops whose vectorised and scalar-tail loops disagree (the cause of
their variance). tests/test_batch_invariance*.py assert the "on" column; this script
shows the "off" one. On CUDA "on" runs the Triton kernels of kernels/batch_invariant_*.py
and "on, torch" the mode's torch references (fixed-shape cuBLAS calls), for comparison.
profiling/batch_invariant_gpu.py runs this table as its first part.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinfer import batch_invariant as bi  # noqa: E402
from deepinfer.batch_invariant import batch_invariant_mode  # noqa: E402
from deepinfer.engine.sampler import Sampler, SamplingTensors  # noqa: E402
from deepinfer.models import invariant_ops  # noqa: E402
from deepinfer.models.invariant_attention import attend  # noqa: E402
from deepinfer.models.mhc import hc_head, hc_post, hc_pre  # noqa: E402
from deepinfer.models.moe import MoE  # noqa: E402
from deepinfer.models.norm import RMSNorm, unweighted_rms_norm  # noqa: E402
from deepinfer.sampling_params import SamplingParams  # noqa: E402

SIZES = [1, 2, 3, 7, 16, 64, 256]
Make = Callable[[int], tuple[torch.Tensor, ...]]


def count_variance(fn: Callable[..., torch.Tensor], make: Make, targets: int = 4) -> tuple[int, int]:
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


def ops(dtype: torch.dtype, device: str = "cpu", wide: bool = False
        ) -> dict[str, tuple[Callable[..., torch.Tensor], Make]]:
    """Name -> (fn, make rows) for the ops the model runs over a flattened batch; ``wide``
    uses the `mini` model's widths (hidden 1024, 16 x 512 heads, 64 experts x 512, top-6)."""
    def rnd(*shape: int, scale: float = 1.0, dt: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*shape, device=device) * scale).to(dt)

    def rows(*shape: int) -> Make:
        return lambda m: (rnd(m, *shape),)

    hidden, heads, head_dim, experts, inter, top_k = (1024, 16, 512, 64, 512, 6) if wide else (64, 4, 64, 8, 32, 2)
    out: dict[str, tuple[Callable[..., torch.Tensor], Make]] = {}
    shapes = [(hidden, 512), (hidden, 4 * hidden), (4 * hidden, hidden)] if wide else \
        [(64, 32), (64, 512), (256, 24), (1024, 4096), (4096, 1024)]
    for k, n in shapes:
        w = rnd(n, k, scale=k ** -0.5)
        out[f"linear {k}->{n}"] = (lambda x, w=w: invariant_ops.linear(x, w), rows(k))
    wg = rnd(2, 16, 64, scale=0.125)
    out["grouped linear (bmm)"] = (lambda x: invariant_ops.grouped_linear(x, wg), rows(2, 64))
    norm = RMSNorm(hidden).to(device)
    out[f"rms norm {hidden}"] = (norm, rows(hidden))
    out[f"unweighted rms norm {head_dim}"] = (lambda x: unweighted_rms_norm(x, 1e-6), rows(head_dim))
    out["softmax rows"] = (lambda x: torch.softmax(x.float(), -1), rows(4, 37))
    for name in ("sigmoid", "silu", "softplus"):
        out[f"{name} width 8"] = (getattr(invariant_ops, name), rows(8))
    d = hidden if wide else 64
    fn, base, scale = rnd(24, 4 * d, scale=0.05, dt=torch.float32), rnd(24, scale=0.5, dt=torch.float32), \
        1 + rnd(3, scale=0.2, dt=torch.float32)
    out["hc_pre (collapsed)"] = (lambda s: hc_pre(s, fn, base, scale, 20, 1e-6, 1e-6)[2], rows(4, d))
    out["hc_head"] = (lambda s: hc_head(s, fn[:4], base[:4], scale[:1], 1e-6, 1e-6), rows(4, d))
    comb = torch.rand(4, 4, device=device)
    out["hc_post"] = (lambda o, s: hc_post(o, s, torch.ones(o.shape[0], 4, device=device),
                                           comb.expand(o.shape[0], 4, 4)),
                      lambda m: (rnd(m, d), rnd(m, 4, d)))
    moe = MoE(hidden, inter, experts, top_k, 1, False, 100, "sqrtsoftplus", 1.5, True, 10.0, dtype).to(device)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_((torch.randn(p.shape, device=device) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.5)).to(p.dtype))
    out["MoE (routed + shared)"] = (moe, lambda m: (rnd(m, hidden), torch.randint(0, 100, (m,), device=device)))
    vocab = 129280 if wide else 512
    sampler = Sampler()

    def sample(logits: torch.Tensor) -> torch.Tensor:  # top-p + top-k rows, seeded
        params = SamplingTensors.from_params([SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seq_seed=7)]
                                             * logits.shape[0], [11] * logits.shape[0], device)
        res = sampler.sample(logits, params)
        return torch.stack([res.token_ids.float(), res.logprobs], dim=1)

    out[f"sampler top-p, vocab {vocab}"] = (sample, lambda m: (rnd(m, vocab, scale=3.0, dt=torch.float32),))
    return out


def attention_variance(dtype: torch.dtype, device: str = "cpu", wide: bool = False) -> tuple[int, int]:
    """(queries whose output differs, queries checked): each query of one request
    computed in one chunk vs alone vs in two other chunkings, through the mode's attend
    (mode on) or the default path's softmax over the chunk's keys (mode off)."""
    heads, dim, window, ratio, length = (16, 512, 128, 4, 600) if wide else (4, 32, 32, 4, 150)
    q = torch.randn(length, heads, dim, device=device).to(dtype)
    keys = torch.randn(length, dim, device=device).to(dtype)
    entries = torch.randn(length // ratio, dim, device=device).to(dtype)
    sink = torch.randn(heads, device=device)
    select = torch.rand(length, length // ratio, device=device) < 0.3

    def chunk(s: int, e: int) -> torch.Tensor:
        pos = torch.arange(s, e, device=device)
        k_lo, n = max(0, s - window + 1), e // ratio
        mask = select[s:e, :n] & (torch.arange(n, device=device)[None, :] < ((pos + 1) // ratio)[:, None])
        if bi.enabled():
            return attend(q[s:e], pos, keys[k_lo:e], k_lo, window, entries[:n] if n else None, mask if n else None,
                          sink, dim ** -0.5)
        key_pos = torch.arange(k_lo, e, device=device)
        visible = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - window)
        kv, vis = torch.cat([keys[k_lo:e], entries[:n]]), torch.cat([visible, mask], dim=1)
        logits = torch.einsum("lhd,kd->lhk", q[s:e], kv).float() * dim ** -0.5
        logits = torch.cat([logits.masked_fill(~vis[:, None], float("-inf")),
                            sink[None, :, None].expand(e - s, -1, 1)], dim=-1)
        return torch.einsum("lhk,kd->lhd", torch.softmax(logits, -1)[..., :-1].to(kv.dtype), kv)

    full = chunk(0, length)
    singles = [p for p in range(0, length, max(1, length // 12))]
    bad = sum(not torch.equal(chunk(p, p + 1), full[p:p + 1]) for p in singles)
    for bounds in ([0, 3, length // 3, length // 3 + 1, length], [0, window, 2 * window, length]):
        parts = torch.cat([chunk(a, b) for a, b in zip(bounds, bounds[1:])])
        bad += int((parts != full).flatten(1).any(dim=1).sum())
    return bad, len(singles) + 2 * length


@contextlib.contextmanager
def torch_references(device: str) -> Iterator[None]:
    """Inside: the mode runs its torch references on ``device`` (kernels unregistered;
    the first lookup loads the built-in ones, so they come back afterwards)."""
    saved = {op: bi.get_kernel(op, device) for op in bi.OPS}
    for op in bi.OPS:
        bi.register_kernel(op, device, None)
    try:
        yield
    finally:
        for op, fn in saved.items():
            bi.register_kernel(op, device, fn)


def probe_table(dtype: torch.dtype, device: str, wide: bool, targets: int = 2) -> list[dict]:
    """One row per op: placements differing with the mode off / on (/ on with the torch
    references, on CUDA)."""
    columns = {"off": (False, False), "on": (True, False)}
    if device != "cpu":
        columns["on, torch"] = (True, True)
    table = []
    named = {**ops(dtype, device, wide), "attention (chunks)": None}
    for name, op in named.items():
        row: dict = {"op": name, "dtype": str(dtype).replace("torch.", "")}
        for col, (mode, refs) in columns.items():
            with torch.no_grad(), batch_invariant_mode(mode), (torch_references(device) if refs else
                                                              contextlib.nullcontext()):
                bad, total = attention_variance(dtype, device, wide) if op is None else count_variance(*op, targets)
            row[col] = f"{bad}/{total}"
        table.append(row)
    return table


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32,bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--wide", action="store_true", help="the mini model's widths")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__} on {args.device}, {torch.get_num_threads()} thread(s)")
    for dtype in (getattr(torch, d) for d in args.dtype.split(",")):
        table = probe_table(dtype, args.device, args.wide, targets=4)
        cols = [c for c in table[0] if c not in ("op", "dtype")]
        print(f"\n{dtype}: mismatches / placements (target row alone vs in batches {SIZES})")
        print(f"{'op':>30} " + " ".join(f"{c:>10}" for c in cols))
        for row in table:
            print(f"{row['op']:>30} " + " ".join(f"{row[c]:>10}" for c in cols))
        if args.device != "cpu":
            continue
        print("vectorised loop vs scalar tail, elements differing of 4096:")
        for name, op in {"sigmoid": torch.sigmoid, "silu": F.silu, "softplus": F.softplus, "exp": torch.exp,
                         "log": lambda x: torch.log(x.abs() + 1e-3), "cos": torch.cos,
                         "rsqrt": lambda x: torch.rsqrt(x.abs() + 1e-3)}.items():
            print(f"{name:>30} {vector_vs_scalar(op, dtype):>10}")


if __name__ == "__main__":
    main()
