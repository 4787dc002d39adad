"""Fast-path kernel numerics on CPU: each Triton kernel (interpreted, TRITON_INTERPRET=1)
and its torch reference vs a float64 ground truth computed from the SAME bf16 inputs.

For every kernel it prints max / mean relative error (per output row, ||o - o64|| /
||o64||) of the reference and of the kernel against float64, and kernel vs reference,
so it is visible which of the two is closer to the truth and whether the kernel-vs-
reference gap is the size of bf16 rounding (2^-8 = 0.0039 relative per element; the
row-norm error of one final rounding is about 2^-9 / sqrt(3) ~ 0.0011).

Attention also prints the reference math with rounding points toggled (float32
probabilities; float32 logits and probabilities; the kernel's rounding of the
UNnormalised exp(s - max) to bf16, divided at the end) to size each one, and the
fraction of bf16 output elements that differ from the reference.

    TRITON_INTERPRET=1 .venv/bin/python profiling/fastpath_numerics.py [--seeds N] [--only attention,moe,router,indexer]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from deepinfer_kernels.decode_attention import decode_attention, decode_attention_ref  # noqa: E402
from deepinfer_kernels.fused_moe import fused_moe, fused_moe_ref  # noqa: E402
from deepinfer_kernels.router import router, router_ref  # noqa: E402

BF = torch.bfloat16


def row_rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row relative error ||a - b|| / ||b|| over the last dim, float64."""
    a, b = a.double(), b.double()
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-300)


class Stats:
    def __init__(self) -> None:
        self.rows: dict[str, list[torch.Tensor]] = {}

    def add(self, name: str, err: torch.Tensor) -> None:
        self.rows.setdefault(name, []).append(err.flatten())

    def report(self, title: str) -> None:
        print(f"\n== {title}")
        for name, errs in self.rows.items():
            e = torch.cat(errs)
            print(f"  {name:<28s} max {e.max().item():.3e}  mean {e.mean().item():.3e}  (n={e.numel()})")


# ----------------------------------------------------------------------------- attention
def attention_case(g: torch.Generator, d: int, heads: int, kind: str, peaked: float):
    """One decode step. K = V rows as after kv_norm (RMS 1 x a norm weight ~ lognormal),
    q after the unweighted q RMS norm; `peaked` mixes a shared direction into q and k so
    that logits are large (a few keys dominate), as in trained models."""
    bs, window, n_req = 16, 128, 4
    ratio = {"swa": 0, "hca": 16, "csa": 4}[kind]
    positions = torch.tensor([130, 300, 600, 127])[:n_req]
    max_blocks = (int(positions.max()) + 1 + bs - 1) // bs
    norm_w = torch.exp(0.5 * torch.randn(d, generator=g))
    direction = F.normalize(torch.randn(d, generator=g), dim=0) * d ** 0.5

    def rows(n: int) -> torch.Tensor:
        x = torch.randn(n, d, generator=g) + peaked * torch.randn(n, 1, generator=g) * direction
        return (F.rms_norm(x, (d,)) * norm_w).to(BF)

    n_blocks = n_req * max_blocks + 3
    swa_pool = rows(n_blocks * bs).view(n_blocks, bs, d)
    swa_table = torch.randperm(n_blocks, generator=g)[:n_req * max_blocks].view(n_req, max_blocks).int()
    qx = torch.randn(n_req, heads, d, generator=g) + peaked * torch.randn(n_req, heads, 1, generator=g) * direction
    q = F.rms_norm(qx, (d,)).to(BF)
    sink = torch.randn(heads, generator=g) * 2
    comp_pool = comp_table = topk = None
    if ratio:
        epb = bs // ratio
        n_cblocks = n_req * max_blocks + 2
        comp_pool = rows(n_cblocks * epb).view(n_cblocks, epb, d)
        comp_table = torch.randperm(n_cblocks, generator=g)[:n_req * max_blocks].view(n_req, max_blocks).int()
    if kind == "csa":
        k = 64
        topk = torch.full((n_req, k), -1, dtype=torch.int32)
        for r, p in enumerate(positions.tolist()):
            n = (p + 1) // ratio
            pick = torch.randperm(n, generator=g)[:k]
            topk[r, :pick.numel()] = pick.int()
    return dict(q=q, positions=positions, swa_pool=swa_pool, swa_table=swa_table, window=window, sink=sink,
                comp_pool=comp_pool, comp_table=comp_table, ratio=ratio, topk_idx=topk)


def attention_f64(args: dict) -> torch.Tensor:
    """Ground truth: decode_attention_ref's key gathering, all math in float64 from the
    same bf16 inputs (no intermediate rounding)."""
    a = dict(args)
    a["q"] = args["q"].double()
    a["swa_pool"] = args["swa_pool"].double()
    a["sink"] = args["sink"].double()
    if args["comp_pool"] is not None:
        a["comp_pool"] = args["comp_pool"].double()
    return decode_attention_ref(**a)


def attention_variants(args: dict) -> dict[str, torch.Tensor]:
    """Where could the rounding points matter? Re-run the reference math with each
    rounding point toggled (float32 else), to size each one's contribution."""
    from deepinfer.models.paged_batch import gather_rows
    out = {}
    q, pos = args["q"], args["positions"]
    for name, (round_logits, round_probs) in {"ref:f32-probs": (True, False),
                                              "ref:f32-logits+probs": (False, False),
                                              "ref:kernel-style-P": (True, "unnorm")}.items():
        outs = []
        for r in range(q.shape[0]):
            p = int(pos[r])
            lo = max(0, p - args["window"] + 1)
            parts = [gather_rows(args["swa_pool"], args["swa_table"][r].tolist(), lo, p + 1)]
            mask = [torch.ones(p + 1 - lo, dtype=torch.bool)]
            n = (p + 1) // args["ratio"] if args["ratio"] else 0
            if args["comp_pool"] is not None and n:
                parts.append(gather_rows(args["comp_pool"], args["comp_table"][r].tolist(), 0, n))
                if args["topk_idx"] is not None:
                    top = args["topk_idx"][r].long()
                    ch = torch.zeros(n + 1, dtype=torch.bool)
                    ch[torch.where(top >= 0, top, n)] = True
                    mask.append(ch[:n])
                else:
                    mask.append(torch.ones(n, dtype=torch.bool))
            kv, m = torch.cat(parts), torch.cat(mask)
            if round_logits:
                lg = (torch.einsum("hd,kd->hk", q[r], kv) * q.shape[-1] ** -0.5).float()
            else:
                lg = torch.einsum("hd,kd->hk", q[r].float(), kv.float()) * q.shape[-1] ** -0.5
            lg = lg.masked_fill(~m[None], float("-inf"))
            comb = torch.cat([lg, args["sink"].float()[:, None]], dim=-1)
            pr = torch.softmax(comb, dim=-1)[:, :-1]
            if round_probs == "unnorm":  # the kernel: round exp(s - max) to bf16, divide at the end
                mx = comb.amax(dim=-1, keepdim=True)
                ex = torch.exp(comb - mx)
                o = (ex[:, :-1].to(BF).float() @ kv.float()) / ex.sum(-1, keepdim=True)
            else:
                o = pr @ kv.float() if not round_probs else (pr.to(BF) @ kv).float()
            outs.append(o[None])
        out[name] = torch.cat(outs)
    return out


def run_attention(seeds: int) -> None:
    for kind in ("swa", "hca", "csa"):
        for d, heads in ((64, 16), (512, 16)):
            for peaked in (0.0, 1.0, 3.0):
                st = Stats()
                for s in range(seeds):
                    g = torch.Generator().manual_seed(1000 * s + d + int(10 * peaked))
                    args = attention_case(g, d, heads, kind, peaked)
                    truth = attention_f64(args)
                    ref = decode_attention_ref(**args)
                    ker32 = decode_attention(**args)  # float32 [R, H, D]
                    ker_split = decode_attention(**args, kv_chunk=64)
                    ker = ker32.to(BF)  # what attention_decode does
                    st.add("ref (bf16 out)   vs f64", row_rel(ref, truth))
                    st.add("kernel (f32 out) vs f64", row_rel(ker32, truth))
                    st.add("kernel->bf16     vs f64", row_rel(ker, truth))
                    st.add("kernel split64->bf16 vs f64", row_rel(ker_split.to(BF), truth))
                    for name, v in attention_variants(args).items():
                        st.add(f"{name} (f32 out) vs f64", row_rel(v, truth))
                    emu = attention_variants(args)["ref:kernel-style-P"].to(BF)
                    st.add("kernel->bf16 vs ref", row_rel(ker, ref))
                    st.add("kernel->bf16 vs kernel-style-P emu", row_rel(ker, emu))
                    st.add("elements != ref (fraction)", (ker != ref).double().mean(dim=-1))
                    st.add("elements != emu (fraction)", (ker != emu).double().mean(dim=-1))
                st.report(f"decode_attention {kind} D={d} H={heads} peaked={peaked}")


# ----------------------------------------------------------------------------- MoE
def run_moe(seeds: int) -> None:
    st = Stats()
    for s in range(seeds):
        g = torch.Generator().manual_seed(s)
        t, h, inter, e, k, limit = 8, 256, 128, 8, 4, 10.0
        x = (torch.randn(t, h, generator=g)).to(BF)
        w1 = (torch.randn(e, inter, h, generator=g) * h ** -0.5 * 2).to(BF)
        w3 = (torch.randn(e, inter, h, generator=g) * h ** -0.5 * 2).to(BF)
        w2 = (torch.randn(e, h, inter, generator=g) * inter ** -0.5).to(BF)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
        w = torch.rand(t, k, generator=g)
        w = (w / w.sum(-1, keepdim=True) * 1.5).to(BF)
        ker, ref = fused_moe(x, w1, w3, w2, w, ids, limit), fused_moe_ref(x, w1, w3, w2, w, ids, limit)
        xd = x.double()
        truth = torch.zeros(t, h, dtype=torch.float64)
        for tt in range(t):
            for j in range(k):
                ee = int(ids[tt, j])
                gg = (w1[ee].double() @ xd[tt]).clamp(max=limit)
                uu = (w3[ee].double() @ xd[tt]).clamp(-limit, limit)
                truth[tt] += w[tt, j].double() * (w2[ee].double() @ (F.silu(gg) * uu))
        st.add("ref    vs f64", row_rel(ref, truth))
        st.add("kernel vs f64", row_rel(ker, truth))
        st.add("kernel vs ref", row_rel(ker, ref))
    st.report("fused_moe T=8 H=256 I=128 E=8 k=4 (bf16)")


def run_router(seeds: int) -> None:
    st = Stats()
    mism = 0
    for s in range(seeds):
        g = torch.Generator().manual_seed(s)
        t, e, k = 16, 64, 6
        logits = (torch.randn(t, e, generator=g) * 2).to(BF)
        bias = torch.randn(e, generator=g) * 0.1
        wk, ik = router(logits, bias, k, 2.5, True, "sqrtsoftplus")
        wr, ir = router_ref(logits, bias, k, 2.5, True, "sqrtsoftplus")
        # compare as sets per row (order differs: sorted vs topk(sorted=False))
        ok = torch.equal(ik.sort(-1).values, ir.sort(-1).values)
        mism += not ok
        wk_s = wk.gather(1, ik.long().argsort(-1))
        wr_s = wr.gather(1, ir.long().argsort(-1))
        sc = F.softplus(logits.double()).sqrt()
        wt = sc.gather(1, ir.long().sort(-1).values)
        wt = wt / wt.sum(-1, keepdim=True) * 2.5
        st.add("ref    vs f64", row_rel(wr_s, wt))
        st.add("kernel vs f64", row_rel(wk_s, wt))
        st.add("kernel vs ref", row_rel(wk_s, wr_s))
    st.report(f"router sqrtsoftplus T=16 E=64 k=6 (bf16 logits); id-set mismatches: {mism}/{seeds}")


def run_indexer(seeds: int) -> None:
    from deepinfer_kernels.indexer_topk import indexer_scores, indexer_topk, indexer_topk_ref
    import inspect
    st = Stats()
    overlap = []
    for s in range(seeds):
        g = torch.Generator().manual_seed(s)
        n_req, heads, d, bs, ratio, k = 3, 8, 64, 16, 4, 16
        positions = torch.tensor([200, 130, 600])
        epb = bs // ratio
        n_cols = 640 // ratio
        width = n_cols // epb
        n_blocks = n_req * width + 2
        pool = F.rms_norm(torch.randn(n_blocks * epb, d, generator=g), (d,)).to(BF).view(n_blocks, epb, d)
        table = torch.randperm(n_blocks, generator=g)[:n_req * width].view(n_req, width).int()
        q = torch.randn(n_req, heads, d, generator=g).to(BF)
        w = (torch.randn(n_req, heads, generator=g) * heads ** -0.5).to(BF).float()
        tk = indexer_topk(q, w, positions, pool, table, ratio, k, n_cols)
        tr = indexer_topk_ref(q, w, positions, pool, table, ratio, k, n_cols)
        for r in range(n_req):
            a = set(tk[r].tolist()) - {-1}
            b = set(tr[r].tolist()) - {-1}
            overlap.append(len(a & b) / max(1, len(b)))
        # scores vs float64
        from deepinfer.models.paged_batch import gather_rows
        for r in range(n_req):
            keys = gather_rows(pool, table[r].tolist(), 0, n_cols)
            n = (int(positions[r]) + 1) // ratio
            sc64 = (torch.relu(q[r].double() @ keys[:n].double().T) * d ** -0.5 * w[r].double()[:, None]).sum(0)
            sc32 = (torch.relu(q[r].float() @ keys[:n].float().T) * d ** -0.5 * w[r][:, None]).sum(0)
            st.add("ref scores (f32) vs f64", row_rel(sc32[None], sc64[None]))
        if "n_cols" in inspect.signature(indexer_scores).parameters:
            try:
                sk = indexer_scores(q, w, positions, pool, table, ratio, n_cols)
                for r in range(n_req):
                    n = (int(positions[r]) + 1) // ratio
                    keys = gather_rows(pool, table[r].tolist(), 0, n)
                    sc64 = (torch.relu(q[r].double() @ keys.double().T) * d ** -0.5 * w[r].double()[:, None]).sum(0)
                    st.add("kernel scores vs f64", row_rel(sk[r:r + 1, :n], sc64[None]))
            except TypeError:
                pass
    st.report(f"indexer_topk H=8 D=64 ratio=4 k=16; top-k set overlap kernel/ref: "
              f"min {min(overlap):.3f} mean {sum(overlap) / len(overlap):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--only", default="attention,moe,router,indexer")
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    only = a.only.split(",")
    if "attention" in only:
        run_attention(a.seeds)
    if "moe" in only:
        run_moe(a.seeds)
    if "router" in only:
        run_router(a.seeds)
    if "indexer" in only:
        run_indexer(a.seeds)


if __name__ == "__main__":
    main()
