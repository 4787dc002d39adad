"""Prefill kernels (kernels/prefill_attention.py, kernels/prefill_indexer.py) against their
torch references on fresh random paged pools, in Triton's CPU interpreter: several
requests per call, chunks that start mid-window / mid-compression-window, sliding-only,
HCA and CSA (indexer-selected entries with -1 padding), tiled and untiled rows."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any deepinfer_kernels module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from deepinfer_kernels.prefill_attention import prefill_attention, prefill_attention_ref, query_tiles  # noqa: E402
from deepinfer_kernels.prefill_indexer import prefill_indexer_topk, prefill_indexer_topk_ref  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
BS = 16  # token block size of the tiny pools
# (start, length) of each request's chunk: a fresh prompt, a chunk resuming mid-block
# past the window, a single decode row and one crossing several blocks
CHUNKS = [(0, 13), (37, 6), (50, 1), (9, 12)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _batch(g: torch.Generator, dtype: torch.dtype, d: int, ratio: int):
    """Random pools with every request's rows at shuffled physical blocks."""
    n_req = len(CHUNKS)
    width = max(s + n for s, n in CHUNKS) // BS + 1
    perm = torch.randperm(n_req * width, generator=g)
    swa_table = perm.view(n_req, width).to(torch.int32)
    comp_table = torch.randperm(n_req * width, generator=g).view(n_req, width).to(torch.int32)
    swa_pool = torch.randn(n_req * width, BS, d, generator=g).to(dtype)
    epb = BS // ratio if ratio else 1
    comp_pool = torch.randn(n_req * width, epb, d, generator=g).to(dtype)
    positions = torch.cat([torch.arange(s, s + n) for s, n in CHUNKS])
    row_req = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, (_, n) in enumerate(CHUNKS)])
    return swa_pool, swa_table, comp_pool, comp_table, positions, row_req


def _topk(g: torch.Generator, positions: torch.Tensor, ratio: int, k: int) -> torch.Tensor:
    """Distinct visible entry ids per row in random order, -1 past the visible ones."""
    rows = []
    for p in positions.tolist():
        n = (p + 1) // ratio
        ids = torch.randperm(max(n, 1), generator=g)[:k] if n else torch.zeros(0, dtype=torch.long)
        rows.append(torch.cat([ids, torch.full((k - len(ids),), -1)]))
    return torch.stack(rows).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
# heads 40 -> 64-head programs with masked heads (the launch V4-Flash's 64 heads take)
@pytest.mark.parametrize("kind,block_t,heads", [("swa", 1, 5), ("swa", 4, 5), ("hca", 2, 5), ("csa", 1, 5),
                                                ("hca", 1, 40), ("csa", 1, 40)])
def test_prefill_attention_matches_reference(fresh_seed, dtype, kind, block_t, heads):
    g = torch.Generator().manual_seed(fresh_seed)
    d, window = 32, 8
    ratio = {"swa": 0, "hca": 8, "csa": 4}[kind]
    swa_pool, swa_table, comp_pool, comp_table, positions, row_req = _batch(g, dtype, d, ratio or 4)
    q = torch.randn(len(positions), heads, d, generator=g).to(dtype)
    sink = torch.randn(heads, generator=g) * 2
    topk = _topk(g, positions, ratio, 6) if kind == "csa" else None
    comp = dict(comp_pool=comp_pool, comp_table=comp_table, ratio=ratio, topk_idx=topk) if ratio else {}
    tiles = query_tiles([s for s, _ in CHUNKS], [n for _, n in CHUNKS],
                        torch.tensor([0] + [n for _, n in CHUNKS]).cumsum(0).tolist(), block_t, "cpu")
    dev = lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) else t  # noqa: E731
    out = prefill_attention(dev(q), dev(positions), dev(row_req), dev(swa_pool), dev(swa_table), window, dev(sink),
                            **{k: dev(v) for k, v in comp.items()}, tiles=dev(tiles), block_t=block_t,
                            block_h=64 if heads > 16 else 16, block_n=8).cpu()
    ref = prefill_attention_ref(q, positions, row_req, swa_pool, swa_table, window, sink, **comp)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2  # bf16: the kernel rounds unnormalised probabilities
    assert _rel(out, ref) < tol, _rel(out, ref)
    per_row = ((out.double() - ref.double()).norm(dim=(1, 2)) / ref.double().norm(dim=(1, 2)))
    assert per_row.max() < 4 * tol, "no single row may be wrong"


def test_query_tiles_cut_at_absolute_positions():
    tiles = query_tiles([6, 0], [7, 3], [0, 7], 4, "cpu").tolist()
    # request 0 holds positions 6..12 in rows 0..6: tiles [6,8), [8,12), [12,13); request 1: [0,3)
    assert tiles == [[0, 2], [2, 4], [6, 1], [7, 3]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_indexer_topk_matches_reference(fresh_seed, dtype):
    g = torch.Generator().manual_seed(fresh_seed)
    heads, d, ratio, k = 3, 16, 4, 5
    _, _, pool, table, positions, row_req = _batch(g, dtype, d, ratio)
    q = torch.randn(len(positions), heads, d, generator=g).to(dtype)
    w = torch.randn(len(positions), heads, generator=g)
    # exact ties: an entry every head scores <= 0 gets 0, so ties at 0 are common; force some
    pool[::3] = -pool[::3].abs()
    n_cols = max(s + n for s, n in CHUNKS) // ratio
    starts, lengths = [s for s, _ in CHUNKS], [n for _, n in CHUNKS]
    offsets = torch.tensor([0] + lengths).cumsum(0).tolist()
    tiles = query_tiles(starts, lengths, offsets, 8, "cpu")
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    out = prefill_indexer_topk(dev(q), dev(w), dev(positions), dev(row_req), dev(pool), dev(table), ratio, k,
                               n_cols, dev(tiles), block_n=8).cpu()
    ref = prefill_indexer_topk_ref(q, w, positions, row_req, pool, table, ratio, k, n_cols, tiles)
    assert out.dtype == torch.int32 and out.shape == (len(positions), k)
    limit = (positions + 1) // ratio
    assert ((out >= 0) == (torch.arange(k)[None, :] < limit[:, None])).all(), "-1 exactly past the visible entries"
    if dtype == torch.float32:
        assert torch.equal(out, ref)
    else:  # bf16 products are exact in float32; only the head-sum order can flip a near-tie
        assert (out == ref).float().mean() > 0.97
    # tiny row chunks (the wrapper bounds its score buffer) give the same picks
    small = prefill_indexer_topk(dev(q), dev(w), dev(positions), dev(row_req), dev(pool), dev(table), ratio, k,
                                 n_cols, dev(tiles), block_n=8, max_score_elems=64).cpu()
    assert torch.equal(small, out)
