"""Check and time deepinfer_kernels on one GPU against their torch references.

    python benchmarks/kernel_bench.py [--out DIR] [--widths flash,mini] [--only moe,moe_quant,...] [--smoke]

For every kernel, at V4-Flash widths (hidden 4096, 64 heads x 512, 256 experts x 2048
top-6, indexer 64 x 128 top-512) and `mini` widths (hidden 1024, 16 heads, 64 experts x
512): (a) compare with the torch reference on fresh random bf16 inputs, (b) time both
(CUDA events after warm-up, median of N) and print GB/s and TFLOP/s against the H200
ceilings of REFERENCE.md section 5 (copy, bf16 matmul) and the speedup, (c) write
JSON (results appended as they come, so a cut-short run keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # deepinfer and deepinfer_kernels from this checkout

from deepinfer.models.rope import Rotary  # noqa: E402
from deepinfer_kernels.decode_attention import decode_attention, decode_attention_ref  # noqa: E402
from deepinfer_kernels.fused_moe import fused_moe, fused_moe_ref  # noqa: E402
from deepinfer_kernels.indexer_topk import indexer_scores, indexer_topk, indexer_topk_ref  # noqa: E402
from deepinfer_kernels.rms_norm import rms_norm, rms_norm_ref  # noqa: E402
from deepinfer_kernels.rotary import rotary, rotary_ref  # noqa: E402
from deepinfer_kernels.router import router, router_ref  # noqa: E402

PEAK_BW, PEAK_FLOPS = 4.2e12, 800e12
WIDTHS = {
    "flash": dict(hidden=4096, heads=64, head_dim=512, rope=64, experts=256, inter=2048, topk=6,
                  idx_heads=64, idx_dim=128, idx_topk=512),
    "mini": dict(hidden=1024, heads=16, head_dim=512, rope=64, experts=64, inter=512, topk=6,
                 idx_heads=16, idx_dim=128, idx_topk=512),
}
BF = torch.bfloat16
DEV = "cuda"
#: Problem sizes (tokens / requests / positions); --smoke swaps in tiny ones for a CPU run.
SIZES: dict[str, Any] = dict(norm_t=(64, 16384), rope_t=(64, 2048), router_t=(64, 8192), moe_t=(64, 512, 4096),
                             attn=[("csa", 64, 4096, 8192), ("csa", 8, 4096, 8192), ("hca", 64, 4096, 8192),
                                   ("hca", 16, 120000, 131072)], idx_r=(8, 64), idx_p=(4096, 8192))
SMOKE_SIZES: dict[str, Any] = dict(norm_t=(3, 17), rope_t=(3, 5), router_t=(3, 9), moe_t=(5, 40),
                                   attn=[("csa", 3, 100, 300), ("hca", 3, 200, 600)], idx_r=(2,), idx_p=(100, 300))
SMOKE_WIDTHS = dict(hidden=64, heads=4, head_dim=64, rope=16, experts=8, inter=32, topk=2, idx_heads=4,
                    idx_dim=32, idx_topk=8)


def timeit(fn: Callable[[], Any], reps: int = 30, warmup: int = 3) -> float:
    """Median milliseconds of `fn` over `reps` runs, timed with CUDA events."""
    if DEV == "cpu":  # --smoke: the interpreter, wall clock
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in events:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def graph_time(fn: Callable[[], Any], reps: int = 20, inner: int = 10) -> float:
    """Median milliseconds of one `fn` replayed from a CUDA graph of `inner` calls: the
    GPU time without Python's launch overhead (eager timings of small kernels are
    launch-bound)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    return timeit(graph.replay, reps) / inner


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


class Recorder:
    """Collects result rows and rewrites the JSON after each one."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path, self.meta, self.rows = path, meta, []

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self.path.write_text(json.dumps({"meta": self.meta, "results": self.rows}, indent=1))
        k, r = row.get("kernel_ms"), row.get("ref_ms")
        print(f"{row['name']:<34} {row['widths']:<6} {row['shape']:<34} ok={row.get('ok')} "
              f"err={row.get('rel_err', float('nan')):.2e} k={k if k is None else round(k, 4)}ms "
              f"ref={r if r is None else round(r, 4)}ms {row.get('note', '')}", flush=True)

    def case(self, name: str, widths: str, shape: str, run: Callable[[], Any], ref: Callable[[], Any],
             check: Callable[[Any, Any], dict[str, Any]], nbytes: float, flops: float = 0.0,
             reps: int = 30, ref_reps: int = 10, config: dict | None = None,
             ref_graph: bool = False) -> dict[str, Any]:
        """Check `run` against `ref`, then time: eager (launch overhead included) and
        CUDA-graph replay (GPU time; rates and speedups use it). `ref_graph`: the
        reference has no host syncs and can be captured too."""
        row: dict[str, Any] = dict(name=name, widths=widths, shape=shape, config=config or {})
        try:
            row.update(check(run(), ref()))
            row["kernel_ms"] = timeit(run, reps)
            row["ref_ms"] = timeit(ref, ref_reps, warmup=1) if ref_reps else None
            if DEV == "cuda":
                row["kernel_graph_ms"] = graph_time(run)
                if ref_graph and ref_reps:
                    row["ref_graph_ms"] = graph_time(ref)
            best = row.get("kernel_graph_ms") or row["kernel_ms"]
            sec = best * 1e-3
            ref_best = row.get("ref_graph_ms") or row["ref_ms"]
            row.update(gbps=nbytes / sec / 1e9, tflops=flops / sec / 1e12, pct_bw=100 * nbytes / sec / PEAK_BW,
                       pct_flops=100 * flops / sec / PEAK_FLOPS, bytes=nbytes, flops=flops,
                       speedup=(ref_best / best) if ref_best else None,
                       speedup_eager=(row["ref_ms"] / row["kernel_ms"]) if row["ref_ms"] else None)
        except Exception as exc:  # keep going: one failure must not hide the other kernels
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:])
        self.add(row)
        return row


def close(tol: float = 1e-2) -> Callable[[torch.Tensor, torch.Tensor], dict[str, Any]]:
    def check(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
        out, ref = (out[0], ref[0]) if isinstance(out, tuple) else (out, ref)
        err = rel_err(out, ref.to(out.dtype) if out.dtype != ref.dtype else ref)
        return dict(rel_err=err, ok=err <= tol, bitwise_equal_frac=float((out == ref.to(out.dtype)).float().mean()))
    return check


def bench_norm_rope(rec: Recorder, wname: str, w: dict[str, int]) -> None:
    h, nh, d, rd = w["hidden"], w["heads"], w["head_dim"], w["rope"]
    for t in SIZES["norm_t"]:
        x, res = torch.randn(t, h, device=DEV).to(BF), torch.randn(t, h, device=DEV).to(BF)
        wt = torch.rand(h, device=DEV) + 0.5
        nb = 2 * t * h * 2 + h * 4
        rec.case("rms_norm", wname, f"[{t},{h}]", lambda: rms_norm(x, wt, 1e-6), lambda: rms_norm_ref(x, wt, 1e-6),
                 close(), nb, ref_graph=True)
        rec.case("rms_norm+residual", wname, f"[{t},{h}]", lambda: rms_norm(x, wt, 1e-6, residual=res),
                 lambda: rms_norm_ref(x, wt, 1e-6, residual=res), close(), 2 * nb, ref_graph=True)
    for t in SIZES["rope_t"]:
        q = torch.randn(t, nh, d, device=DEV).to(BF)
        rec.case("rms_norm unweighted (q heads)", wname, f"[{t},{nh},{d}]", lambda: rms_norm(q, None, 1e-6),
                 lambda: rms_norm_ref(q, None, 1e-6), close(), 2 * q.numel() * 2, ref_graph=True)
        rope = Rotary(rd, 160000.0, {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536})
        pos = torch.randint(0, 1 << 20, (t,), device=DEV)
        cos, sin = rope.cos_sin(pos, BF)
        freq = rope.inv_freq.to(DEV)
        rec.case("rotary table out-of-place", wname, f"[{t},{nh},{d}] rope {rd}", lambda: rotary(q, cos, sin),
                 lambda: rotary_ref(q, cos, sin), close(), 2 * q.numel() * 2, ref_graph=True)
        qi = q.clone()
        rec.case("rotary positions in-place", wname, f"[{t},{nh},{d}] pos<2^20",
                 lambda: rotary(qi, positions=pos, inv_freq=freq, inplace=True),
                 lambda: rotary_ref(q, positions=pos, inv_freq=freq), close(), 2 * t * nh * rd * 2, ref_graph=True)


def bench_router(rec: Recorder, wname: str, w: dict[str, int]) -> None:
    e, k = w["experts"], w["topk"]

    def check(out: tuple, ref: tuple) -> dict[str, Any]:
        (wk, ik), (wr, ir) = out, ref
        ok_rows = (ik.sort(-1).values == ir.sort(-1).values).all(-1)
        o1, o2 = ik.argsort(-1), ir.argsort(-1)
        err = rel_err(wk.gather(1, o1)[ok_rows], wr.gather(1, o2)[ok_rows])
        frac = float(ok_rows.float().mean())
        return dict(rel_err=err, same_set_frac=frac, ok=err <= 1e-2 and frac >= 0.999)
    for t in SIZES["router_t"]:
        logits = (torch.randn(t, e, device=DEV) * 3).to(BF)
        bias = torch.randn(e, device=DEV) * 0.1
        nb = t * e * 2 + t * k * 6
        rec.case("router topk", wname, f"[{t},{e}] k={k}", lambda: router(logits, bias, k, 1.5),
                 lambda: router_ref(logits, bias, k, 1.5), check, nb, ref_graph=True)
        tab = torch.stack([torch.randperm(e, device=DEV)[:k] for _ in range(1000)])
        ids = torch.randint(0, 1000, (t,), device=DEV)
        rec.case("router hash", wname, f"[{t},{e}] k={k}", lambda: router(logits, None, k, 1.5, tid2eid=tab,
                 input_ids=ids), lambda: router_ref(logits, None, k, 1.5, tid2eid=tab, input_ids=ids), check, nb,
                 ref_graph=True)


def bench_moe(rec: Recorder, wname: str, w: dict[str, int]) -> None:
    h, inter, e, k = w["hidden"], w["inter"], w["experts"], w["topk"]
    w1 = (torch.randn(e, inter, h, device=DEV) * h ** -0.5).to(BF)
    w3 = (torch.randn(e, inter, h, device=DEV) * h ** -0.5).to(BF)
    w2 = (torch.randn(e, h, inter, device=DEV) * inter ** -0.5).to(BF)
    alt = {64: [dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)],
           4096: [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
                  dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
                  dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)]}
    for t in SIZES["moe_t"]:
        x = torch.randn(t, h, device=DEV).to(BF)
        ids = torch.rand(t, e, device=DEV).topk(k, dim=-1).indices.to(torch.int32)
        tw = torch.rand(t, k, device=DEV).to(BF)
        n_active = int(torch.unique(ids).numel())
        nb = n_active * 3 * inter * h * 2 + t * h * 2 * 2
        fl = 2.0 * t * k * 3 * inter * h
        for cfg in [None] + alt.get(t, []):
            rec.case("fused_moe", wname, f"T={t} E={e} I={inter} k={k}",
                     lambda: fused_moe(x, w1, w3, w2, tw, ids, 10.0, config=cfg),
                     lambda: fused_moe_ref(x, w1, w3, w2, tw, ids, 10.0), close(), nb, fl,
                     reps=20, ref_reps=3 if cfg is None else 0, config=cfg or {"default": True})
    del w1, w2, w3
    torch.cuda.empty_cache()


def _attn_inputs(w: dict[str, int], n_req: int, kind: str, lo: int, hi: int) -> dict[str, Any]:
    nh, d, bs, window = w["heads"], w["head_dim"], 128, 128
    ratio = {"csa": 4, "hca": 128 if DEV == "cuda" else 16}[kind]
    pos = torch.randint(lo, hi, (n_req,), device=DEV)
    nblk = hi // bs + 1
    swa_pool = torch.randn(n_req * 2 + 8, bs, d, device=DEV).to(BF)
    swa_table = torch.randint(0, swa_pool.shape[0], (n_req, nblk), device=DEV, dtype=torch.int32)
    comp_pool = torch.randn(n_req * nblk // 2 + 8, bs // ratio, d, device=DEV).to(BF)
    comp_table = torch.randint(0, comp_pool.shape[0], (n_req, nblk), device=DEV, dtype=torch.int32)
    topk = None
    if kind == "csa":
        n_ent = (pos + 1) // ratio
        topk = (torch.rand(n_req, hi // ratio, device=DEV) * (torch.arange(hi // ratio, device=DEV)[None] <
                                                               n_ent[:, None])).topk(w["idx_topk"]).indices
        topk = topk.to(torch.int32)
    q = torch.randn(n_req, nh, d, device=DEV).to(BF)
    return dict(q=q, positions=pos, swa_pool=swa_pool, swa_table=swa_table, window=window,
                sink=torch.randn(nh, device=DEV), comp_pool=comp_pool, comp_table=comp_table, ratio=ratio,
                topk_idx=topk)


def bench_attention(rec: Recorder, wname: str, w: dict[str, int]) -> None:
    nh, d = w["heads"], w["head_dim"]
    configs = [dict(block_h=16, block_n=32, num_warps=4), dict(block_h=16, block_n=64, num_warps=8),
               dict(block_h=32, block_n=32, num_warps=8), dict(block_h=64, block_n=16, num_warps=8)]
    for kind, n_req, lo, hi in SIZES["attn"]:
        a = _attn_inputs(w, n_req, kind, lo, hi)
        n_comp = (a["topk_idx"] >= 0).sum().item() if kind == "csa" else ((a["positions"] + 1) // a["ratio"]).sum().item()
        keys = n_req * 128 + n_comp
        nb = keys * d * 2 + n_req * nh * d * (2 + 4)
        fl = 4.0 * nh * d * keys
        max_keys = 128 + (w["idx_topk"] if kind == "csa" else hi // a["ratio"])
        sweep = configs if wname == "flash" else configs[:1]
        for cfg in sweep:
            for chunk in ((128, 256, 1024) if kind == "csa" and wname == "flash" else (256, 1024)):
                kw = dict(cfg, kv_chunk=chunk, max_keys=max_keys)
                row = rec.case("decode_attention", wname, f"{kind} R={n_req} H={nh} D={d} p~{lo}",
                               lambda: decode_attention(**a, **kw), lambda: decode_attention_ref(**a),
                               close(), nb, fl, ref_reps=3 if (cfg is configs[0] and chunk == 256) else 0,
                               config=kw)
                if row.get("ok") and n_req > 2:  # a request's result must not depend on the batch
                    full = decode_attention(**a, **kw)
                    half = {k2: (v[: n_req // 2] if k2 in ("q", "positions", "swa_table", "comp_table", "topk_idx")
                                 and v is not None else v) for k2, v in a.items()}
                    row["batch_invariant"] = bool(torch.equal(decode_attention(**half, **kw), full[: n_req // 2]))
                    rec.path.write_text(json.dumps({"meta": rec.meta, "results": rec.rows}, indent=1))


def bench_indexer(rec: Recorder, wname: str, w: dict[str, int]) -> None:
    nh, di, k = w["idx_heads"], w["idx_dim"], w["idx_topk"]
    lo, hi = SIZES["idx_p"]
    for n_req in SIZES["idx_r"]:
        pos = torch.randint(lo, hi, (n_req,), device=DEV)
        n_cols, epb = hi // 4, 32
        nblk = -(-n_cols // epb)
        pool = torch.randn(n_req * nblk, epb, di, device=DEV).to(BF)
        table = torch.randperm(pool.shape[0], device=DEV).view(n_req, nblk).to(torch.int32)
        q = torch.randn(n_req, nh, di, device=DEV).to(BF)
        wt = torch.randn(n_req, nh, device=DEV) * nh ** -0.5

        def check(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
            scores = indexer_scores(q, wt, pos, pool, table, 4, n_cols)
            picked, wanted = scores.gather(1, out.clamp(min=0).long()), scores.gather(1, ref.clamp(min=0).long())
            err = rel_err(picked, wanted)
            return dict(rel_err=err, same_id_frac=float((out == ref).float().mean()),
                        ok=err <= 1e-5 and bool(torch.equal(out < 0, ref < 0)))
        nb = n_req * n_cols * di * 2
        fl = 2.0 * n_req * n_cols * nh * di
        rec.case("indexer scores", wname, f"R={n_req} H={nh} Dh={di} n={n_cols}",
                 lambda: indexer_scores(q, wt, pos, pool, table, 4, n_cols), lambda: None,
                 lambda o, r: dict(ok=True), nb, fl, ref_reps=0)
        rec.case("indexer_topk (scores+sort)", wname, f"R={n_req} H={nh} Dh={di} n={n_cols} k={k}",
                 lambda: indexer_topk(q, wt, pos, pool, table, 4, k, n_cols),
                 lambda: indexer_topk_ref(q, wt, pos, pool, table, 4, k, n_cols), check, nb, fl, ref_reps=3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "profiling" / "results")))
    ap.add_argument("--widths", default="flash,mini")
    ap.add_argument("--only", default="norm,router,moe,attention,indexer,mhc,epilogue")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    global DEV
    if args.smoke:
        DEV = "cpu"
        SIZES.update(SMOKE_SIZES)
        WIDTHS["smoke"] = SMOKE_WIDTHS
        args.widths = "smoke"
    import triton
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    meta = dict(device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)", torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, commit=os.environ.get("GIT_COMMIT", "unknown"),
                date=time.strftime("%Y-%m-%d %H:%M:%S"), peak_bw=PEAK_BW, peak_flops=PEAK_FLOPS, widths=WIDTHS,
                timing="CUDA events, median, after warm-up; single launches, no graphs")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(out / "kernel_bench_h200.json", meta)
    sys.path.insert(0, str(ROOT / "profiling"))  # its sections stay with the studies that tuned them
    import kernel_bench_fused  # the decode path's fused kernels (mHC, norm + RoPE, compressor)
    import kernel_bench_moe_quant  # the MoE on FP8 / FP4 expert weights (--only moe_quant)

    kernel_bench_fused.DEV = kernel_bench_moe_quant.DEV = DEV
    sections = dict(norm=bench_norm_rope, router=bench_router, moe=bench_moe, attention=bench_attention,
                    indexer=bench_indexer, **kernel_bench_fused.SECTIONS, **kernel_bench_moe_quant.SECTIONS)
    for wname in args.widths.split(","):
        for sec in args.only.split(","):
            t0 = time.time()
            sections[sec](rec, wname, WIDTHS[wname])
            print(f"-- {sec} {wname}: {time.time() - t0:.1f}s", flush=True)
    print(f"\n{'kernel':<32}{'widths':<7}{'shape':<36}{'ok':<4}{'err':>9}{'ms':>9}{'ref ms':>9}{'x':>7}"
          f"{'GB/s':>8}{'%bw':>5}{'TF/s':>7}")
    for r in rec.rows:
        if "kernel_ms" not in r:
            print(f"{r['name']:<32}{r['widths']:<7}{r['shape']:<36}ERROR {r.get('error', '')[:60]}")
            continue
        sp = f"{r['speedup']:.1f}" if r.get("speedup") else "-"
        rm = f"{r['ref_ms']:.3f}" if r.get("ref_ms") else "-"
        print(f"{r['name'][:31]:<32}{r['widths']:<7}{r['shape'][:35]:<36}{'y' if r['ok'] else 'N':<4}"
              f"{r.get('rel_err', 0):>9.1e}{r['kernel_ms']:>9.4f}{rm:>9}{sp:>7}{r['gbps']:>8.0f}{r['pct_bw']:>5.0f}"
              f"{r['tflops']:>7.1f}")


if __name__ == "__main__":
    main()
