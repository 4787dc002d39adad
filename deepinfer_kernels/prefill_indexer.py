"""Lightning-indexer scores and top-k for prefill chunks (many query rows per request).

Math of ``deepinfer.models.v4.compressor.Indexer.select`` for every row at once: a row at
position p scores the compressed index keys n < (p + 1) // ratio of its request (paged
pool [blocks, block_size / ratio, Dh] via its ``table`` row) with
``score_n = sum_h w_h * relu(q_h . k_n) * Dh^-0.5`` in float32 (``w`` =
``weights_proj(x) * n_heads^-0.5``, passed in); later entries score -inf. Then the top
``k`` entries, highest first, lowest entry id among equal scores (exact ties are common:
an entry every head scores <= 0 gets 0); slots past the visible entries are -1.

Programs take a query tile (``BLOCK_T`` consecutive rows of one request, see
``prefill_attention.query_tiles``) times ``BLOCK_N`` entries: the entry block is loaded
once for the tile and each head is one [BLOCK_T, Dh] x [Dh, BLOCK_N] MMA, heads added in
order. The selection is a stable device sort, done over row chunks so the float32 score
buffer stays bounded (``max_score_elems``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, interpreting, next_pow2


# vary with the chunk / context; the chunk's first tile is an argument, not a pointer offset:
# Triton specialises on pointer alignment, and a tile slice at an odd offset compiled again
@triton.jit(do_not_specialize=["tile_base", "row_base", "n_cols", "stride_t", "stride_ot"])
def _prefill_index_kernel(q_ptr, w_ptr, pos_ptr, req_ptr, tile_ptr, tile_base, pool_ptr, tab_ptr, out_ptr, row_base,
                          H, EPB, RATIO, n_cols, scale, stride_qt, stride_qh, stride_wt, stride_t, stride_ot,
                          IEEE: tl.constexpr, INTERP: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    tile, nb = tile_base + tl.program_id(0), tl.program_id(1)
    row0 = tl.load(tile_ptr + 2 * tile).to(tl.int64)
    nrows = tl.load(tile_ptr + 2 * tile + 1)
    req = tl.load(req_ptr + row0).to(tl.int64)
    p0 = tl.load(pos_ptr + row0).to(tl.int32)
    t = tl.arange(0, BLOCK_T)
    row_ok = t < nrows
    rows = row0 + t.to(tl.int64)
    limit = (p0 + t + 1) // RATIO  # entries each row may see
    n_lim = (p0 + nrows) // RATIO  # ... and the tile's last row
    ent = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    score = tl.full([BLOCK_T, BLOCK_N], float("-inf"), dtype=tl.float32)
    if nb * BLOCK_N < n_lim:
        kval = ent < n_lim
        blk = tl.load(tab_ptr + req * stride_t + ent // EPB, mask=kval, other=0).to(tl.int64)
        k = tl.load(pool_ptr + (blk * EPB + ent % EPB)[:, None] * D + d[None, :], mask=kval[:, None], other=0.0)
        if INTERP:
            k = k.to(tl.float32)
        kt = tl.trans(k)
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for hh in range(0, H):
            qh = tl.load(q_ptr + rows[:, None] * stride_qt + hh * stride_qh + d[None, :], mask=row_ok[:, None],
                         other=0.0)
            if INTERP:
                qh = qh.to(tl.float32)
            wh = tl.load(w_ptr + rows * stride_wt + hh, mask=row_ok, other=0.0).to(tl.float32)
            if IEEE:
                s = tl.dot(qh, kt, input_precision="ieee")
            else:
                s = tl.dot(qh, kt)
            acc += tl.maximum(s, 0.0) * scale * wh[:, None]
        score = tl.where(ent[None, :] < limit[:, None], acc, float("-inf"))
    tl.store(out_ptr + (rows - row_base)[:, None] * stride_ot + ent[None, :], score,
             mask=row_ok[:, None] & (ent[None, :] < n_cols))


def select_topk(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Top-k ids per row of float32 scores, highest first, ties to the lowest id, -1 where
    the score is -inf; [rows, top_k] int32."""
    k = min(top_k, scores.shape[1])
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    top = torch.where(vals[:, :k] == float("-inf"), -1, idx[:, :k])
    if k < top_k:
        top = torch.nn.functional.pad(top, (0, top_k - k), value=-1)
    return top.to(torch.int32)


def prefill_indexer_topk(q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, row_req: torch.Tensor,
                         pool: torch.Tensor, table: torch.Tensor, ratio: int, top_k: int, n_cols: int,
                         tiles: torch.Tensor, block_n: int = 64, max_score_elems: int = 1 << 26,
                         host_tiles: torch.Tensor | None = None) -> torch.Tensor:
    """Selected entry ids [T, top_k] int32 (-1 = none). q [T, H, Dh] (rope applied),
    weights [T, H], row_req [T] int32, table [R, width] int32, ``n_cols`` >= the most
    entries any row sees, ``tiles`` [n, 2] int32 (first row, rows) of at most 64 rows,
    ordered by row (``prefill_attention.query_tiles``); ``host_tiles``: the same on the
    host, if the caller has it (saves a device-to-host copy)."""
    check_device(q)
    n_rows, n_heads, d = q.shape
    assert d == next_pow2(d) and q.stride(2) == 1 and pool.is_contiguous()
    out = torch.full((n_rows, top_k), -1, dtype=torch.int32, device=q.device)
    if n_rows == 0 or n_cols == 0:
        return out
    # Python ints: indexing a host tensor per tile cost milliseconds per 8k-token prefill
    starts, counts = (tiles.cpu() if host_tiles is None else host_tiles).T.tolist()
    ends = [a + n for a, n in zip(starts, counts)]
    block_t = max(16, next_pow2(max(counts)))
    # tile chunks whose rows x n_cols fit the score buffer
    budget_rows = max(block_t, max_score_elems // n_cols)
    first = 0
    while first < len(starts):
        row_lo = starts[first]
        last = first
        while last + 1 < len(starts) and ends[last + 1] - row_lo <= budget_rows:
            last += 1
        row_hi = ends[last]
        scores = torch.empty(row_hi - row_lo, n_cols, dtype=torch.float32, device=q.device)
        _prefill_index_kernel[(last + 1 - first, triton.cdiv(n_cols, block_n))](
            q, weights, positions, row_req, tiles, first, pool, table, scores, row_lo,
            n_heads, pool.shape[1], ratio, n_cols, float(d ** -0.5),
            q.stride(0), q.stride(1), weights.stride(0), table.stride(0), scores.stride(0),
            IEEE=q.dtype == torch.float32, INTERP=interpreting(), D=d, BLOCK_T=block_t, BLOCK_N=block_n,
            num_warps=4)
        out[row_lo:row_hi] = select_topk(scores, top_k)
        first = last + 1
    return out


def prefill_indexer_topk_ref(q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, row_req: torch.Tensor,
                             pool: torch.Tensor, table: torch.Tensor, ratio: int, top_k: int, n_cols: int,
                             tiles: torch.Tensor | None = None, block_n: int = 64,
                             max_score_elems: int = 1 << 26, host_tiles: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference with the signature of :func:`prefill_indexer_topk`: per request the
    scoring of ``Indexer.select`` (float32) over its keys, then the same selection."""
    from deepinfer.models.paged_batch import gather_rows

    from .prefill_attention import _request_rows

    scores = torch.full((q.shape[0], n_cols), float("-inf"), dtype=torch.float32, device=q.device)
    for r, first, n in _request_rows(row_req):
        rows = slice(first, first + n)
        pos = positions[rows]
        n_entries = (int(pos[-1]) + 1) // ratio
        if not n_entries:
            continue
        keys = gather_rows(pool, table[r].tolist(), 0, n_entries).float()
        s = torch.relu(torch.einsum("lhd,nd->lhn", q[rows].float(), keys)) * q.shape[-1] ** -0.5
        index_scores = (s * weights[rows].float().unsqueeze(-1)).sum(dim=1)
        future = torch.arange(n_entries, device=q.device)[None, :] >= ((pos + 1) // ratio)[:, None]
        scores[rows, :n_entries] = index_scores.masked_fill(future, float("-inf"))
    return select_topk(scores, top_k)
