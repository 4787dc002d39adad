"""DSpark's sequential greedy sampling of a draft block in one launch.

Per block r and draft j < n (``deepinfer.models.fast.draft_dspark.sample_block`` for
greedy rows): the Markov bias ``W2 . W1[x_j]`` (rounded to the weights' dtype, as the
module's GEMM returns it) is added to the stage's float32 logits, the argmax (after
``nan_to_num``: NaN and +inf -> 0, -inf -> -1e30; ties to the lowest index) is draft
``x_{j+1}``, and the confidence is ``sigmoid(w . [h_j ; W1[x_j]] / T_j)`` (the dot rounded
likewise). ``x_0`` is the block's last real token.

Why a kernel: as torch ops each draft is ~17 launches (the bias GEMM, the cast, the add,
the argmax, the confidence's cat / GEMV / sigmoid and the sampling tensors), ~85 of a
DSpark k = 5 step's ~900 at batch 1, for a few kilobytes of work. One program per block
walks its n drafts, the vocabulary in ``BLOCK_V`` slices.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, next_pow2, round_to


@triton.jit(do_not_specialize=["V", "D", "RANK"])
def _dspark_block_kernel(prev_ptr, stride_prev, logits_ptr, h_ptr, w1_ptr, w2_ptr, wc_ptr, temp_ptr, out_ptr, V, D, RANK,
                         N: tl.constexpr, G: tl.constexpr, CODE: tl.constexpr, INTERP: tl.constexpr,
                         BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < RANK
    prev = tl.load(prev_ptr + r * stride_prev).to(tl.int64)
    for j in tl.static_range(N):
        e = tl.load(w1_ptr + prev * RANK + ks, mask=k_ok, other=0.0).to(tl.float32)
        row = (r * G + j).to(tl.int64)
        best = tl.full([], float("-inf"), tl.float32)
        idx = tl.zeros([], dtype=tl.int64)
        for v0 in range(0, V, BLOCK_V):
            vs = v0 + tl.arange(0, BLOCK_V)
            v_ok = vs < V
            w2 = tl.load(w2_ptr + vs[:, None].to(tl.int64) * RANK + ks[None, :], mask=v_ok[:, None] & k_ok[None, :],
                         other=0.0).to(tl.float32)
            bias = round_to(tl.sum(w2 * e[None, :], axis=1), CODE, INTERP)
            z = tl.load(logits_ptr + row * V + vs, mask=v_ok, other=0.0) + bias
            z = tl.where(z != z, 0.0, z)  # nan_to_num: NaN -> 0, +inf -> 0, -inf -> -1e30
            z = tl.where(z == float("inf"), 0.0, z)
            z = tl.where(z == float("-inf"), -1e30, z)
            z = tl.where(v_ok, z, float("-inf"))
            m = tl.max(z, axis=0)
            i = tl.argmax(z, axis=0, tie_break_left=True).to(tl.int64)
            idx = tl.where(m > best, v0 + i, idx)  # strictly greater: the first maximum wins
            best = tl.maximum(m, best)
        acc = tl.sum(e * tl.load(wc_ptr + D + ks, mask=k_ok, other=0.0).to(tl.float32), axis=0)
        for d0 in range(0, D, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            d_ok = ds < D
            hv = tl.load(h_ptr + row * D + ds, mask=d_ok, other=0.0).to(tl.float32)
            acc += tl.sum(hv * tl.load(wc_ptr + ds, mask=d_ok, other=0.0).to(tl.float32), axis=0)
        zc = round_to(acc, CODE, INTERP) / tl.load(temp_ptr + j)
        conf = 1.0 / (1.0 + tl.exp(-zc))
        tl.store(out_ptr + r * 2 * N + j, idx)
        tl.store(out_ptr + r * 2 * N + N + j, conf.to(tl.int32, bitcast=True).to(tl.int64))
        prev = idx


def dspark_greedy_block(prev: torch.Tensor, logits: torch.Tensor, h: torch.Tensor, w1: torch.Tensor,
                        w2: torch.Tensor, wc: torch.Tensor, temperatures: torch.Tensor, n: int) -> torch.Tensor:
    """``prev`` [R] the blocks' last tokens (any stride: a column of the draft inputs), ``logits`` [R, G, V] float32 (no Markov bias yet),
    ``h`` [R, G, D] the last stage's normed hidden, ``w1`` / ``w2`` [V, rank] the Markov tables,
    ``wc`` [1, D + rank] the confidence projection, ``temperatures`` [>= n] float32 (device):
    packed [R, 2n] int64, the n greedy drafts then their confidences' float32 bits."""
    check_device(prev, logits, h, w1, w2, wc, temperatures)
    r, g, v = logits.shape
    d, rank = h.shape[-1], w1.shape[1]
    if logits.dtype != torch.float32 or not logits.is_contiguous() or not 1 <= n <= g:
        raise ValueError(f"dspark_greedy_block: logits must be contiguous float32 [R, G, V] and 1 <= n <= G, got "
                         f"{logits.dtype} {tuple(logits.shape)}, n={n}")
    if w1.shape != w2.shape or w1.shape[0] != v or wc.numel() != d + rank or h.shape[:2] != (r, g):
        raise ValueError(f"dspark_greedy_block: shapes disagree: logits {tuple(logits.shape)}, h {tuple(h.shape)}, "
                         f"w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}, wc {tuple(wc.shape)}")
    out = torch.empty(r, 2 * n, dtype=torch.int64, device=logits.device)
    if r:
        block_k = next_pow2(rank)
        _dspark_block_kernel[(r,)](prev, prev.stride(0), logits, h.contiguous(), w1.contiguous(), w2.contiguous(), wc.contiguous(),
                                   temperatures, out, v, d, rank, N=n, G=g, CODE=dtype_code(w2.dtype),
                                   INTERP=interpreting(), BLOCK_V=max(16, min(256, 8192 // block_k)),
                                   BLOCK_K=block_k, BLOCK_D=min(1024, next_pow2(d)), num_warps=4)
    return out


def dspark_greedy_block_ref(prev: torch.Tensor, logits: torch.Tensor, h: torch.Tensor, w1: torch.Tensor,
                            w2: torch.Tensor, wc: torch.Tensor, temperatures: torch.Tensor, n: int) -> torch.Tensor:
    """Torch reference of :func:`dspark_greedy_block` (``MarkovHead`` / ``ConfidenceHead`` /
    ``sample_draft``'s greedy rows, written out)."""
    toks, confs = [], []
    for j in range(n):
        emb = w1[prev]
        z = logits[:, j] + torch.nn.functional.linear(emb, w2).float()
        zc = torch.nn.functional.linear(torch.cat([h[:, j], emb.to(h.dtype)], dim=-1), wc.view(1, -1))
        confs.append(torch.sigmoid(zc.float().squeeze(-1) / temperatures[j]))
        prev = torch.nan_to_num(z, nan=0.0, posinf=0.0, neginf=-1e30).argmax(dim=-1)
        toks.append(prev)
    bits = torch.stack(confs, dim=1).float().view(torch.int32).to(torch.int64)
    return torch.cat([torch.stack(toks, dim=1), bits], dim=1)


__all__ = ["dspark_greedy_block", "dspark_greedy_block_ref"]
