"""Sections of benchmarks/kernel_bench.py for the decode path's fused kernels: mHC
(``hc_pre``, ``hc_post_pre``, ``hc_head``), ``norm_rope`` and ``compressor_decode``, each
checked against its torch reference on fresh random inputs and timed (eager and graphed).

    python benchmarks/kernel_bench.py --only mhc,epilogue [--widths flash,mini]
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

# kernel_bench (whose sections these are) is a benchmark: importable when this file is loaded alone too
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import kernel_bench as kb  # noqa: E402
from deepinfer.models.rope import yarn_inv_freq  # noqa: E402
from deepinfer_kernels.compressor_decode import compressor_decode, compressor_decode_ref  # noqa: E402
from deepinfer_kernels.mhc import hc_head, hc_head_ref, hc_post_pre, hc_post_pre_ref, hc_pre, hc_pre_ref  # noqa: E402
from deepinfer_kernels.norm_rope import norm_rope, norm_rope_ref  # noqa: E402
from deepinfer_kernels.skinny_gemm import skinny_linear, skinny_linear_ref  # noqa: E402

BF = torch.bfloat16
DEV = "cuda"  # kernel_bench.main sets it ("cpu" for --smoke)
N, ITERS = 4, 20
MHC_T = (1, 64, 8192)
SMOKE_MHC_T = (3,)


def _freq(rope: int) -> torch.Tensor:
    return yarn_inv_freq(rope, 160000.0, {"factor": 16, "original_max_position_embeddings": 65536}).to(DEV)


def _check_tuple(tols: tuple[float, ...]):
    """Each output within its tolerance (float32 mixes 1e-5, bf16 outputs 1e-2)."""
    def check(out: Any, ref: Any) -> dict[str, Any]:
        out, ref = (out if isinstance(out, tuple) else (out,)), (ref if isinstance(ref, tuple) else (ref,))
        errs = [kb.rel_err(o.float(), r.float()) for o, r in zip(out, ref)]
        return dict(rel_err=max(errs), ok=all(e <= t for e, t in zip(errs, tols)), errs=errs)
    return check


def bench_mhc(rec: kb.Recorder, wname: str, w: dict[str, int]) -> None:
    h = w["hidden"]
    mix = (2 + N) * N
    fn = torch.randn(mix, N * h, device=DEV) * 0.05
    base, scale = torch.randn(mix, device=DEV) * 0.5, torch.rand(3, device=DEV) + 0.5
    fn_h, base_h, scale_h = torch.randn(N, N * h, device=DEV) * 0.05, torch.randn(N, device=DEV), \
        torch.rand(1, device=DEV) + 0.5
    norm = (torch.rand(h, device=DEV) + 0.5, 1e-6)
    for t in (SMOKE_MHC_T if DEV == "cpu" else MHC_T):
        streams = (torch.randn(t, N, h, device=DEV) * 2).to(BF)
        out = torch.randn(t, h, device=DEV).to(BF)
        post, comb, _ = hc_pre_ref(streams, fn, base, scale, ITERS, 1e-6, 1e-6)
        nb = 2 * t * N * h * 2 + fn.numel() * 4  # streams in + out, the mix weights
        fl = 2 * t * N * h * mix
        rec.case("mhc hc_pre (+norm)", wname, f"T={t} N={N} D={h}",
                 lambda: hc_pre(streams, fn, base, scale, ITERS, 1e-6, 1e-6, norm),
                 lambda: hc_pre_ref(streams, fn, base, scale, ITERS, 1e-6, 1e-6, norm),
                 _check_tuple((1e-5, 1e-5, 1e-2)), nb, fl, ref_graph=True)
        rec.case("mhc hc_post_pre (+norm)", wname, f"T={t} N={N} D={h}",
                 lambda: hc_post_pre(out, streams, post, comb, fn, base, scale, ITERS, 1e-6, 1e-6, norm),
                 lambda: hc_post_pre_ref(out, streams, post, comb, fn, base, scale, ITERS, 1e-6, 1e-6, norm),
                 _check_tuple((1e-2, 1e-5, 1e-5, 1e-2)), nb + 2 * t * N * h * 2, fl, ref_graph=True)
        rec.case("mhc hc_head (post+norm)", wname, f"T={t} N={N} D={h}",
                 lambda: hc_head(streams, fn_h, base_h, scale_h, 1e-6, 1e-6, norm, (out, post, comb)),
                 lambda: hc_head_ref(streams, fn_h, base_h, scale_h, 1e-6, 1e-6, norm, (out, post, comb)),
                 _check_tuple((1e-2,)), nb, 2 * t * N * h * N, ref_graph=True)


def bench_epilogue(rec: kb.Recorder, wname: str, w: dict[str, int]) -> None:
    nh, d, rope = w["heads"], w["head_dim"], w["rope"]
    freq = _freq(rope)
    for r in ((3,) if DEV == "cpu" else (1, 64, 256)):
        q = torch.randn(r, nh, d, device=DEV).to(BF)
        pos = torch.randint(0, 1 << 16, (r,), device=DEV)
        rec.case("norm_rope q (unweighted)", wname, f"R={r} H={nh} D={d}",
                 lambda: norm_rope(q, pos, freq, "unweighted", eps=1e-6),
                 lambda: norm_rope_ref(q, pos, freq, "unweighted", eps=1e-6), kb.close(), 2 * q.numel() * 2,
                 ref_graph=True)
        ratio, dd, bs = 4, d, 128
        ring = torch.randn(r, 2 * ratio, 2, 2 * dd, device=DEV)
        entries = torch.randn(4 * r, bs // ratio, dd, device=DEV).to(BF)
        tail = torch.randn(4 * r, ratio, 2, dd, device=DEV)
        table = torch.arange(4 * r, device=DEV, dtype=torch.int32).view(r, 4)
        kv, sc = torch.randn(r, 2 * dd, device=DEV).to(BF), torch.randn(r, 2 * dd, device=DEV).to(BF)
        ape, nw = torch.randn(ratio, 2 * dd, device=DEV), torch.rand(dd, device=DEV) + 0.5
        closing = torch.full((r,), 2 * bs - 1, device=DEV)  # every window closes, block end: all writes
        slots = torch.arange(r, device=DEV)

        def run(fn, state):
            fn(kv, sc, ape, closing, slots, state[0], state[1], table, state[2], nw, 1e-6, freq, ratio, True, bs)
            return state[1]

        mine, theirs = (ring.clone(), entries.clone(), tail.clone()), (ring.clone(), entries.clone(), tail.clone())
        rec.case("compressor_decode CSA (closing)", wname, f"R={r} d={dd}",
                 lambda: run(compressor_decode, mine), lambda: run(compressor_decode_ref, theirs),
                 kb.close(), r * (2 * ratio * 2 * 2 * dd * 4 + dd * 2), 0.0)


def bench_skinny(rec: kb.Recorder, wname: str, w: dict[str, int]) -> None:
    """The decode LM head (vocab x hidden) and a wide attention projection at a few rows:
    skinny_linear (a few tile shapes) vs cuBLAS (F.linear, the reference, graphed too)."""
    h = w["hidden"]
    vocab = 129280 if DEV == "cuda" else 300
    shapes = {"head": (vocab, h), "wq_b": (w["heads"] * w["head_dim"], 512 if DEV == "cuda" else 32)}
    alts = [dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
            dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3),
            dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=8, num_stages=3)] if DEV == "cuda" else []
    for sname, (n, k) in shapes.items():
        wt = (torch.randn(n, k, device=DEV) * k ** -0.5).to(BF)
        for t in ((1, 4, 16, 64) if DEV == "cuda" else (3,)):
            x = torch.randn(t, k, device=DEV).to(BF)
            nb = n * k * 2 + t * (k + n) * 2
            for cfg in [None] + alts:
                rec.case(f"skinny_linear {sname}", wname, f"M={t} N={n} K={k}",
                         lambda: skinny_linear(x, wt, config=cfg), lambda: skinny_linear_ref(x, wt),
                         kb.close(), nb, 2.0 * t * n * k, ref_reps=10 if cfg is None else 0,
                         config=cfg or {"default": True}, ref_graph=True)
        del wt


SECTIONS = {"mhc": bench_mhc, "epilogue": bench_epilogue, "skinny": bench_skinny}
