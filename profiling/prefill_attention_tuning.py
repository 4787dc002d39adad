"""Sweep the launch shape of the prefill attention kernel (kernels/prefill_attention.py) on
a GPU, on one 8k-token prefill at V4-Flash widths (64 heads x 512, window 128): an HCA
layer (ratio 128, every entry) and a CSA layer (ratio 4, 512 selected entries per row).

    PYTHONPATH=. python3 profiling/prefill_attention_tuning.py [--tokens 8192] [--out DIR]

For each (rows x heads per program, keys per block, warps, stages) candidate it checks the
output against the shipped launch shape (rel err; the key blocks change only the float32
summation order) and times it (CUDA graph replays, kernel_bench.graph_time), with the TFLOP/s of the
attention FLOPs (4 x heads x D per visible key) against the bf16 ceiling (REFERENCE.md section 5).
Prints a table; writes prefill_attention_tuning.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))  # kernel_bench is a benchmark

import kernel_bench  # noqa: E402  (also makes kernels/ importable as deepinfer_kernels)
import torch  # noqa: E402

from deepinfer_kernels.prefill_attention import prefill_attention, query_tiles  # noqa: E402

H, D, W, BS, TOPK = 64, 512, 128, 128, 512
PEAK = 800e12


def layer_inputs(tokens: int, ratio: int, csa: bool, dev: str = "cuda") -> tuple[dict, float]:
    """Kernel arguments of one request's prefill of ``tokens`` rows, and its FLOPs."""
    g = torch.Generator(device="cpu").manual_seed(tokens + ratio)
    n_blocks = tokens // BS + 2
    epb = BS // ratio
    q = (torch.randn(tokens, H, D, generator=g) * 0.5).to(torch.bfloat16).to(dev)
    swa = (torch.randn(n_blocks, BS, D, generator=g) * 0.5).to(torch.bfloat16).to(dev)
    comp = (torch.randn(n_blocks, epb, D, generator=g) * 0.5).to(torch.bfloat16).to(dev)
    table = torch.randperm(n_blocks, generator=g)[None, :].to(torch.int32).to(dev)
    pos = torch.arange(tokens, device=dev)
    row_req = torch.zeros(tokens, dtype=torch.int32, device=dev)
    sink = torch.randn(H, generator=g).to(dev)
    kw = dict(q=q, positions=pos, row_req=row_req, swa_pool=swa, swa_table=table, window=W, sink=sink,
              comp_pool=comp, comp_table=table, ratio=ratio)
    p = torch.arange(tokens)
    n_ent = (p + 1) // ratio
    if csa:  # every row's own entries among those it may see, -1 padded
        scores = torch.rand(tokens, tokens // ratio, generator=g).masked_fill(
            torch.arange(tokens // ratio)[None, :] >= n_ent[:, None], -1.0)
        top = scores.topk(min(TOPK, tokens // ratio), dim=1)
        idx = torch.where(top.values >= 0, top.indices, torch.full_like(top.indices, -1))
        kw["topk_idx"] = torch.nn.functional.pad(idx, (0, TOPK - idx.shape[1]), value=-1).to(torch.int32).to(dev)
        keys = torch.clamp(n_ent, max=TOPK)
    else:
        keys = n_ent
    keys = keys + torch.clamp(p + 1, max=W)
    return kw, float(4 * H * D * keys.sum())


def run(kw: dict, tokens: int, cand: dict) -> torch.Tensor:
    bt = cand.get("block_t", 1)
    tiles = query_tiles([0], [tokens], [0], bt, "cuda") if bt > 1 else None
    return prefill_attention(**kw, tiles=tiles, block_t=bt, block_h=cand["block_h"], block_n=cand["block_n"],
                             num_warps=cand.get("warps"), num_stages=cand.get("stages", 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", default=os.environ.get("OUT", "profiling/results"))
    args = ap.parse_args()
    t0 = time.time()
    shipped = dict(block_h=32, block_n=32)  # deepinfer/models/v4/fast/prefill_attention.py's launch
    cands = [shipped] + [dict(block_h=bh, block_n=bn, warps=w, stages=st, block_t=bt)
                         for bh, bt in ((32, 1), (64, 1), (32, 2)) for bn in (32, 64) for w in (4, 8)
                         for st in (2, 3)]
    rows = []
    for layer, ratio, csa in (("hca", 128, False), ("csa", 4, True)):
        kw, flops = layer_inputs(args.tokens, ratio, csa)
        want = run(kw, args.tokens, shipped).float()
        for cand in cands:
            if csa and cand.get("block_t", 1) > 1:
                continue  # CSA rows have their own entries: one row per program
            try:
                err = float((run(kw, args.tokens, cand).float() - want).norm() / want.norm())
                ms = kernel_bench.graph_time(lambda: run(kw, args.tokens, cand), reps=5, inner=2)
            except Exception as e:  # a shape Triton cannot compile or fit: recorded, not fatal
                rows.append({"layer": layer, **cand, "error": repr(e)[:200]})
                continue
            rows.append({"layer": layer, **cand, "ms": round(ms, 3), "rel_err_vs_shipped": err,
                         "tflop_s": round(flops / ms / 1e9, 1), "peak_frac": round(flops / ms / 1e-3 / PEAK, 3),
                         "ok": err < 1e-2})
            print(json.dumps(rows[-1]), flush=True)
    res = {"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens,
                    "commit": os.environ.get("DEEPINFER_COMMIT", "unknown"), "wall_s": round(time.time() - t0, 1)},
           "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "prefill_attention_tuning.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n{'layer':5s} {'shape':34s} {'ms':>8s} {'TFLOP/s':>8s} {'%peak':>6s}")
    for layer in ("hca", "csa"):
        ok = sorted((r for r in rows if r["layer"] == layer and r.get("ok")), key=lambda r: r["ms"])
        for r in [x for x in rows if x["layer"] == layer and "warps" not in x and "ms" in x] + ok[:4]:
            shape = {k: r[k] for k in ("block_t", "block_h", "block_n", "warps", "stages") if k in r}
            print(f"{layer:5s} {json.dumps(shape):34s} {r['ms']:8.3f} {r['tflop_s']:8.1f} {100 * r['peak_frac']:5.1f}%")


if __name__ == "__main__":
    main()
