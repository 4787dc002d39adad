"""indexer_topk (CSA lightning-indexer scores + top-k) vs Indexer.select's math."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from kernel_testutil import DEVICE, assert_close, gen  # noqa: E402

from deepinfer_kernels.indexer_topk import indexer_scores, indexer_topk, indexer_topk_ref  # noqa: E402


def _case(seed: int, n_heads: int = 6, d: int = 32, ratio: int = 4):
    g = gen(seed)
    n_req, epb, n_blocks = 4, 4, 12
    positions = torch.tensor([3, 30, 101, 180])[torch.randperm(n_req, generator=g)]
    pool = torch.randn(n_req * n_blocks, epb, d, generator=g).to(torch.bfloat16)
    table = torch.randperm(pool.shape[0], generator=g).view(n_req, n_blocks).int()
    q = torch.randn(n_req, n_heads, d, generator=g).to(torch.bfloat16)
    w = torch.randn(n_req, n_heads, generator=g) * n_heads ** -0.5
    n_cols = (181 // ratio)
    return [t.to(DEVICE) for t in (q, w, positions, pool, table)] + [ratio, n_cols]


def test_indexer_topk(fresh_seed: int) -> None:
    q, w, pos, pool, table, ratio, n_cols = _case(fresh_seed)
    top = indexer_topk(q, w, pos, pool, table, ratio, 8, n_cols)
    ref = indexer_topk_ref(q, w, pos, pool, table, ratio, 8, n_cols)
    assert top.shape == ref.shape == (4, 8)
    assert torch.equal(top < 0, ref < 0)  # same number of visible entries
    # ids agree except where two scores are within float32 rounding of each other:
    # compare the reference's own scores of both picks
    scores = indexer_scores(q, w, pos, pool, table, ratio, n_cols)
    picked = scores.gather(1, top.clamp(min=0).long())
    wanted = scores.gather(1, ref.clamp(min=0).long())
    assert torch.allclose(picked, wanted, rtol=1e-5, atol=1e-6)
    assert (top == ref).float().mean() > 0.9


def test_indexer_ties_lowest_id(fresh_seed: int) -> None:
    """Entries whose every head scores negative tie at exactly 0: lowest ids first."""
    q, w, pos, pool, table, ratio, n_cols = _case(fresh_seed, n_heads=1)
    w = w.abs() + 0.1
    top = indexer_topk(q, w, pos, pool, table, ratio, 45, n_cols)
    assert torch.equal(top, indexer_topk_ref(q, w, pos, pool, table, ratio, 45, n_cols))
    scores = indexer_scores(q, w, pos, pool, table, ratio, n_cols)
    for r in range(4):
        zero_ids = [int(i) for i in top[r] if i >= 0 and scores[r, i] == 0]
        assert zero_ids == sorted(zero_ids)


def test_indexer_bf16_weights_scaled_in_kernel(fresh_seed: int) -> None:
    """weights_proj's bf16 output (a row-strided slice) with n_heads^-0.5 applied in the kernel
    scores exactly like the float32 product the reference forms first."""
    q, w, pos, pool, table, ratio, n_cols = _case(fresh_seed)
    wide = torch.randn(4, 3 * w.shape[1], generator=gen(fresh_seed + 1)).to(torch.bfloat16).to(DEVICE)
    w16 = wide[:, 5:5 + w.shape[1]]
    scale = w.shape[1] ** -0.5
    got = indexer_scores(q, w16, pos, pool, table, ratio, n_cols, weight_scale=scale)
    want = indexer_scores(q, w16.float() * scale, pos, pool, table, ratio, n_cols)
    assert torch.equal(got, want)
    top = indexer_topk(q, w16, pos, pool, table, ratio, 8, n_cols, weight_scale=scale)
    ref = indexer_topk_ref(q, w16, pos, pool, table, ratio, 8, n_cols, weight_scale=scale)
    assert torch.equal(top < 0, ref < 0) and (top == ref).float().mean() > 0.9  # near-ties may swap


def test_indexer_query_rope_in_kernel(fresh_seed: int) -> None:
    """rope_inv_freq: the kernel rotates the query itself, exactly as rotating it first does."""
    from deepinfer.models.rope import Rotary, apply_rope, yarn_inv_freq
    from types import SimpleNamespace

    q, w, pos, pool, table, ratio, n_cols = _case(fresh_seed)
    inv = yarn_inv_freq(16, 160000.0, {"factor": 16, "original_max_position_embeddings": 65536}).to(DEVICE)
    cos, sin = Rotary.cos_sin(SimpleNamespace(inv_freq=inv), pos, q.dtype)
    got = indexer_scores(q, w, pos, pool, table, ratio, n_cols, rope_inv_freq=inv)
    want = indexer_scores(apply_rope(q, cos, sin), w, pos, pool, table, ratio, n_cols)
    seen = torch.isfinite(want)
    assert torch.equal(seen, torch.isfinite(got))
    assert_close(got[seen], want[seen], torch.float32)  # equal but where a cos/sin last bit differs
    assert not torch.allclose(got[seen], indexer_scores(q, w, pos, pool, table, ratio, n_cols)[seen])
    top = indexer_topk(q, w, pos, pool, table, ratio, 8, n_cols, rope_inv_freq=inv)
    ref = indexer_topk_ref(q, w, pos, pool, table, ratio, 8, n_cols, rope_inv_freq=inv)
    assert torch.equal(top < 0, ref < 0) and (top == ref).float().mean() > 0.9
