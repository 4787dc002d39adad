"""DSpark's greedy draws of a draft block: n sequential argmaxes over the vocabulary, each
with the Markov bias of the token drawn before it, in n + 1 launches.

For block r with the last accepted token ``first[r]`` and draft logits ``logits[r, j]``
(float32, no bias yet), draw j is

    x_j = argmax nan_to_num(logits[r, j] + round(W2 . W1[x_{j-1}]))     (x_{-1} = first[r])

with the bias rounded to W2's dtype (what ``MarkovHead.bias``'s ``F.linear`` stores) and
``nan_to_num`` as the draft sampler applies it (NaN and +inf -> 0, -inf -> -1e30); ties go
to the lowest index (torch.argmax's rule).

Why a kernel: each draw of the reference is an embedding gather, the bias GEMM, its cast,
the add, ``nan_to_num`` and ``argmax``: six small launches a draw that a graphed draft step
pays one by one. Here launch j's programs each take a block of rows and a fixed
``SPLIT``-column slice of the vocabulary (the bias as one GEMM tile, so W2 is read once per
row block; add, partial max / first index); launch j + 1 first folds draw j's
partials to its token (so no host and no extra launch sits between two draws) and a last
launch folds draw n - 1. The vocabulary slices are fixed, never derived from the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, next_pow2, round_to

#: Vocabulary columns per program (fixed: a row's result must not depend on the batch).
SPLIT = 2048


@triton.jit
def _fold(pmax_ptr, pidx_ptr, base, live, n_splits, BLOCK_S: tl.constexpr):
    """The tokens of a row block's partials at ``base`` [BLOCK_R]: per row the first index of
    the largest maximum over its vocabulary slices."""
    sp = tl.arange(0, BLOCK_S)
    ok = live[:, None] & (sp < n_splits)[None, :]
    pm = tl.load(pmax_ptr + base[:, None] + sp[None, :], mask=ok, other=float("-inf"))
    pi = tl.load(pidx_ptr + base[:, None] + sp[None, :], mask=ok, other=0)
    m = tl.max(pm, axis=1)
    first = tl.min(tl.where(ok & (pm == m[:, None]), sp[None, :], BLOCK_S), axis=1)  # the lowest slice holding it
    return tl.sum(tl.where(sp[None, :] == first[:, None], pi, 0), axis=1).to(tl.int64)


@triton.jit(do_not_specialize=["R", "j"])
def _draw_kernel(logits_ptr, first_ptr, w1_ptr, w2_ptr, pmax_ptr, pidx_ptr, tok_ptr, R, V, j, n_splits,
                 stride_lr, stride_lj, N: tl.constexpr, RANK: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr, CODE: tl.constexpr,
                 INTERP: tl.constexpr):
    # a block of rows per program: W2's slice is read once for all of them (one GEMM tile)
    rb, sp = tl.program_id(0), tl.program_id(1)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    rlive = rows < R
    if j == 0:
        prev = tl.load(first_ptr + rows, mask=rlive, other=0).to(tl.int64)
    else:  # fold the previous draw (every program of these rows does, slice 0 records it)
        prev = _fold(pmax_ptr, pidx_ptr, ((j - 1) * R + rows) * n_splits, rlive, n_splits, BLOCK_S)
        if sp == 0:
            tl.store(tok_ptr + rows * N + j - 1, prev, mask=rlive)
    k = tl.arange(0, RANK)
    emb = tl.load(w1_ptr + prev[:, None] * RANK + k[None, :], mask=rlive[:, None], other=0.0)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    idx = tl.zeros([BLOCK_R], dtype=tl.int32)
    row_ptr = logits_ptr + rows.to(tl.int64)[:, None] * stride_lr + j * stride_lj
    for c0 in range(sp * SPLIT, sp * SPLIT + SPLIT, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        live = cols < V
        w = tl.load(w2_ptr + cols.to(tl.int64)[None, :] * RANK + k[:, None], mask=live[None, :], other=0.0)
        zero = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
        if CODE == 0:  # float32 weights: full-precision products, as torch's float32 GEMM
            bias = tl.dot(emb, w, zero, input_precision="ieee")
        elif INTERP:
            bias = tl.dot(emb.to(tl.float32), w.to(tl.float32), zero)
        else:
            bias = tl.dot(emb, w, zero)
        x = tl.load(row_ptr + cols[None, :], mask=rlive[:, None] & live[None, :], other=0.0)
        x = x + round_to(bias, CODE, INTERP)
        x = tl.where(x != x, 0.0, x)
        x = tl.where(x == float("inf"), 0.0, x)
        x = tl.where(x == float("-inf"), -1e30, x)
        x = tl.where(live[None, :], x, float("-inf"))
        bm = tl.max(x, axis=1)
        bi = tl.argmax(x, axis=1, tie_break_left=True).to(tl.int32)
        idx = tl.where(bm > m, c0 + bi, idx)  # strictly greater: the first maximum wins
        m = tl.maximum(m, bm)
    out = (j * R + rows) * n_splits + sp
    tl.store(pmax_ptr + out, m, mask=rlive)
    tl.store(pidx_ptr + out, idx, mask=rlive)


@triton.jit(do_not_specialize=["R", "j"])
def _last_kernel(pmax_ptr, pidx_ptr, tok_ptr, R, j, n_splits, N: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_S: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rlive = rows < R
    tok = _fold(pmax_ptr, pidx_ptr, (j * R + rows) * n_splits, rlive, n_splits, BLOCK_S)
    tl.store(tok_ptr + rows * N + j, tok, mask=rlive)


def _check(logits: torch.Tensor, first: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, n: int) -> None:
    if logits.dim() != 3 or logits.dtype != torch.float32 or logits.stride(2) != 1:
        raise ValueError(f"markov_greedy_draws: logits must be float32 [R, G, V] with contiguous rows, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    r, g, v = logits.shape
    if not 1 <= n <= g:
        raise ValueError(f"markov_greedy_draws: n={n} draws must be in [1, {g}] (the block's rows)")
    if first.shape != (r,):
        raise ValueError(f"markov_greedy_draws: first must be [{r}], got {tuple(first.shape)}")
    if w1.dim() != 2 or w1.shape != w2.shape or w1.shape[0] != v or w1.dtype != w2.dtype:
        raise ValueError(f"markov_greedy_draws: W1 {tuple(w1.shape)} and W2 {tuple(w2.shape)} must both be "
                         f"[{v}, rank] of one dtype")


def markov_greedy_draws(logits: torch.Tensor, first: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, n: int,
                        split: int = SPLIT) -> torch.Tensor:
    """tokens int64 [R, n]: the greedy draws of R blocks (see the module doc). logits float32
    [R, G, V]; first [R] int (each block's last token); w1, w2 [V, rank] (rank a power of
    two >= 16); ``split``: columns per program (a power of two; tests shrink it)."""
    check_device(logits, first, w1, w2)
    _check(logits, first, w1, w2, n)
    if split < 16 or split & (split - 1):
        raise ValueError(f"markov_greedy_draws: split={split} must be a power of two >= 16")
    r, _, v = logits.shape
    rank = w1.shape[1]
    if rank != next_pow2(rank) or rank < 16:
        raise ValueError(f"markov_greedy_draws: rank {rank} must be a power of two >= 16")
    tok = torch.empty(r, n, dtype=torch.int64, device=logits.device)
    if r == 0:
        return tok
    n_splits = triton.cdiv(v, split)
    pmax = torch.empty(n, r, n_splits, dtype=torch.float32, device=logits.device)
    pidx = torch.empty(n, r, n_splits, dtype=torch.int32, device=logits.device)
    w1, w2, first = w1.contiguous(), w2.contiguous(), first.contiguous()
    block_r = 16 if r <= 16 else 32
    block_v = max(16, min(split, 128, 8192 // rank))
    block_s = max(16, next_pow2(n_splits))
    grid = (triton.cdiv(r, block_r), n_splits)
    for j in range(n):
        _draw_kernel[grid](logits, first, w1, w2, pmax, pidx, tok, r, v, j, n_splits,
                           logits.stride(0), logits.stride(1), N=n, RANK=rank, SPLIT=split, BLOCK_R=block_r,
                           BLOCK_V=block_v, BLOCK_S=block_s, CODE=dtype_code(w2.dtype), INTERP=interpreting(),
                           num_warps=4)
    _last_kernel[(grid[0],)](pmax, pidx, tok, r, n - 1, n_splits, N=n, BLOCK_R=block_r, BLOCK_S=block_s,
                             num_warps=1)
    return tok


def markov_greedy_draws_ref(logits: torch.Tensor, first: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, n: int,
                            split: int = SPLIT) -> torch.Tensor:
    """Torch reference: ``MarkovHead.bias`` and the draft sampler's greedy draw, draw by draw."""
    _check(logits, first, w1, w2, n)
    prev, toks = first.long(), []
    for j in range(n):
        z = logits[:, j] + torch.nn.functional.linear(w1[prev], w2).float()
        prev = torch.nan_to_num(z, nan=0.0, posinf=0.0, neginf=-1e30).argmax(dim=-1)
        toks.append(prev)
    return torch.stack(toks, dim=1)


__all__ = ["markov_greedy_draws", "markov_greedy_draws_ref"]
