"""Lightning-indexer scores and top-k for CSA decode (one query per request).

Math of ``deepinfer.models.v4.compressor.Indexer.select`` for one query row at position
p, in float32: ``score_n = sum_h w_h * relu(q_h . k_n) * Dh^-0.5`` over the compressed
index keys n < (p + 1) // ratio (later entries are -inf), where ``w`` is
``float(weights) * weight_scale`` (``weights_proj(x)`` and ``n_heads^-0.5``, passed in)
and the keys come from the paged index pool [blocks, block_size / ratio, Dh] via ``table``. Then the top ``k`` entries by
score, highest first, lowest entry id among equal scores (exact ties are common: an
entry whose every head's q.k is negative scores 0); slots past the visible entries
are -1.

The scores are a Triton kernel (one program per request and block of entries, heads
reduced in registers); the selection is a stable device sort (no host sync) for now.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, mma, next_pow2, rope_tile, round_to


@triton.jit(do_not_specialize=["n_cols", "stride_t"])
def _index_score_kernel(q_ptr, w_ptr, pos_ptr, pool_ptr, tab_ptr, out_ptr, freq_ptr, H, EPB, RATIO, n_cols, scale,
                        w_scale, stride_qr, stride_qh, stride_wr, stride_t, stride_or,
                        INTERP: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                        ROPE: tl.constexpr, HALF: tl.constexpr, CODE: tl.constexpr):
    r, nb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, D)
    q = tl.load(q_ptr + r * stride_qr + heads[:, None] * stride_qh + d[None, :], mask=hmask[:, None], other=0.0)
    p = tl.load(pos_ptr + r)
    if ROPE:  # the query's RoPE, as Indexer.select applies it (rounded values: the cast back is exact)
        q = rope_tile(round_to(q.to(tl.float32), CODE, INTERP), p, freq_ptr, BLOCK_H, D, HALF, False, CODE,
                      INTERP).to(q_ptr.dtype.element_ty)
    w = tl.load(w_ptr + r * stride_wr + heads, mask=hmask, other=0.0).to(tl.float32) * w_scale
    limit = (p.to(tl.int32) + 1) // RATIO
    ent = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = ent < limit
    blk = tl.load(tab_ptr + r * stride_t + ent // EPB, mask=valid, other=0).to(tl.int64)
    k = tl.load(pool_ptr + (blk * EPB + ent % EPB)[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
    s = mma(k, tl.trans(q), tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32), INTERP)  # [N, H]
    s = tl.maximum(s, 0.0) * scale
    score = tl.sum(s * w[None, :], axis=1)
    score = tl.where(valid, score, float("-inf"))
    tl.store(out_ptr + r * stride_or + ent, score, mask=ent < n_cols)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, pool: torch.Tensor,
                   table: torch.Tensor, ratio: int, n_cols: int, block_n: int = 64,
                   weight_scale: float = 1.0, rope_inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """Scores [R, n_cols] float32 (-inf past each request's (p + 1) // ratio entries).
    q [R, H, Dh] (rope applied, or applied here from ``rope_inv_freq`` [rope_dim / 2] and the
    positions), weights [R, H] (any float dtype, row-strided views allowed), pool
    [blocks, per_block, Dh]."""
    check_device(q)
    n_req, n_heads, d = q.shape
    assert d == next_pow2(d) and q.stride(2) == 1 and pool.is_contiguous()
    out = torch.empty(n_req, n_cols, dtype=torch.float32, device=q.device)
    freq = rope_inv_freq.float().contiguous() if rope_inv_freq is not None else out
    if n_req and n_cols:
        _index_score_kernel[(n_req, triton.cdiv(n_cols, block_n))](
            q, weights, positions, pool, table, out, freq, n_heads, pool.shape[1], ratio, n_cols, float(d ** -0.5),
            float(weight_scale), q.stride(0), q.stride(1), weights.stride(0), table.stride(0), out.stride(0),
            INTERP=interpreting(), D=d, BLOCK_H=max(16, next_pow2(n_heads)), BLOCK_N=block_n,
            ROPE=rope_inv_freq is not None, HALF=freq.numel() if rope_inv_freq is not None else 1,
            CODE=dtype_code(q.dtype), num_warps=4)
    return out


def select_topk(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Top-k ids per row, ties to the lowest id, -1 where the score is -inf."""
    k = min(top_k, scores.shape[1])
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    top = torch.where(vals[:, :k] == float("-inf"), -1, idx[:, :k])
    if k < top_k:
        top = torch.nn.functional.pad(top, (0, top_k - k), value=-1)
    return top.to(torch.int32)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, pool: torch.Tensor,
                 table: torch.Tensor, ratio: int, top_k: int, n_cols: int, weight_scale: float = 1.0,
                 rope_inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """Selected compressed-entry ids [R, top_k] int32 (-1 = none) for CSA decode.
    `n_cols` >= the most entries any request sees (e.g. (max_pos + 1) // ratio)."""
    scores = indexer_scores(q, weights, positions, pool, table, ratio, n_cols, weight_scale=weight_scale,
                            rope_inv_freq=rope_inv_freq)
    return select_topk(scores, top_k)


def indexer_topk_ref(q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, pool: torch.Tensor,
                     table: torch.Tensor, ratio: int, top_k: int, n_cols: int, weight_scale: float = 1.0,
                     rope_inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference with the signature of :func:`indexer_topk`: the query RoPE, scoring
    and stable sort of ``Indexer.select`` per request, keys read with ``gather_rows``."""
    from types import SimpleNamespace

    from deepinfer.models.paged_batch import gather_rows
    from deepinfer.models.rope import Rotary, apply_rope

    if rope_inv_freq is not None:
        cos, sin = Rotary.cos_sin(SimpleNamespace(inv_freq=rope_inv_freq), positions, q.dtype)
        q = apply_rope(q, cos, sin)

    rows = []
    for r in range(q.shape[0]):
        p = int(positions[r])
        n_entries = (p + 1) // ratio
        keys = gather_rows(pool, table[r].tolist(), 0, n_cols).float()
        qr = q[r:r + 1].float()
        scores = torch.relu(torch.einsum("lhd,nd->lhn", qr, keys)) * q.shape[-1] ** -0.5
        w = weights[r:r + 1].float() * weight_scale
        index_scores = (scores * w.unsqueeze(-1)).sum(dim=1)  # [1, n]
        future = torch.arange(n_cols, device=q.device)[None, :] >= n_entries
        index_scores = index_scores.masked_fill(future, float("-inf"))
        k = min(top_k, n_cols)
        top = torch.sort(index_scores, dim=-1, descending=True, stable=True).indices[:, :k]
        top = torch.where(top < n_entries, top, -1)
        rows.append(torch.nn.functional.pad(top, (0, top_k - k), value=-1))
    return torch.cat(rows).to(torch.int32)


def indexer_scores_ref(q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, pool: torch.Tensor,
                       table: torch.Tensor, ratio: int, n_cols: int, block_n: int = 64,
                       weight_scale: float = 1.0, rope_inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference with the signature of :func:`indexer_scores`, every row at once: the
    keys gathered through the table, ``Indexer.select``'s scoring, -inf past each row's
    (p + 1) // ratio entries. No host read (usable inside a CUDA graph)."""
    from types import SimpleNamespace

    from deepinfer.models.rope import Rotary, apply_rope

    if rope_inv_freq is not None:
        cos, sin = Rotary.cos_sin(SimpleNamespace(inv_freq=rope_inv_freq), positions, q.dtype)
        q = apply_rope(q, cos, sin)
    per = pool.shape[1]
    ent = torch.arange(n_cols, device=q.device)
    blk = table.long().gather(1, (ent // per).expand(q.shape[0], -1))
    keys = pool[blk, ent % per].float()  # [R, n_cols, Dh]
    scores = torch.relu(torch.einsum("rhd,rnd->rhn", q.float(), keys)) * q.shape[-1] ** -0.5
    out = (scores * (weights.float() * weight_scale).unsqueeze(-1)).sum(dim=1)
    limit = (positions.long() + 1) // ratio
    return out.masked_fill(ent[None, :] >= limit[:, None], float("-inf"))
