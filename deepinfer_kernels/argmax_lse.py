"""Per-row argmax and log-sum-exp of float32 logits in two launches: what a greedy
sampler needs (the token, and its log-prob ``max - logsumexp``) without materialising
``log_softmax`` over the vocabulary.

Why a kernel: at decode batch 1 the vocabulary row (129,280 floats) is one CTA's work for
torch's softmax and argmax reductions: ~35 + ~28 us per step on an H200 in a `mini`
decode profile, for half a megabyte. Here the row is cut into fixed ``SPLIT``-column
slices, one program each (max, first index of the max, sum of ``exp(x - max)``), and a
second kernel folds a row's partials. The split never depends on the batch, so a row's
results are the same alone or in any batch (the sampler's batch invariance).

Ties go to the lowest index (torch.argmax's rule). A row of only ``-inf`` returns index 0,
``lse = -inf`` and a NaN log-prob (as ``log_softmax`` does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, next_pow2

#: Columns per partial program (fixed: a row's sums must not depend on the batch).
SPLIT = 2048


@triton.jit(do_not_specialize=["V", "n_splits"])
def _argmax_partial_kernel(x_ptr, stride_r, V, pmax_ptr, psum_ptr, pidx_ptr, n_splits,
                    SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    row, sp = tl.program_id(0), tl.program_id(1)
    base = x_ptr + row.to(tl.int64) * stride_r
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], dtype=tl.float32)
    idx = tl.zeros([], dtype=tl.int32)
    for k0 in range(sp * SPLIT, sp * SPLIT + SPLIT, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf"))
        bm = tl.max(x, axis=0)
        bi = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int32)
        new_m = tl.maximum(m, bm)
        safe = tl.where(new_m == float("-inf"), 0.0, new_m)
        s = s * tl.exp(m - safe) + tl.sum(tl.exp(x - safe), axis=0)
        idx = tl.where(bm > m, k0 + bi, idx)  # strictly greater: the first maximum wins
        m = new_m
    out = row * n_splits + sp
    tl.store(pmax_ptr + out, m)
    tl.store(psum_ptr + out, s)
    tl.store(pidx_ptr + out, idx)


@triton.jit
def _argmax_finish_kernel(pmax_ptr, psum_ptr, pidx_ptr, tok_ptr, lse_ptr, lp_ptr, packed_ptr, n_splits,
                   BLOCK_S: tl.constexpr, PACKED: tl.constexpr):
    row = tl.program_id(0)
    sp = tl.arange(0, BLOCK_S)
    live = sp < n_splits
    pm = tl.load(pmax_ptr + row * n_splits + sp, mask=live, other=float("-inf"))
    ps = tl.load(psum_ptr + row * n_splits + sp, mask=live, other=0.0)
    pi = tl.load(pidx_ptr + row * n_splits + sp, mask=live, other=0)
    m = tl.max(pm, axis=0)
    first = tl.min(tl.where(pm == m, sp, BLOCK_S), axis=0)  # the lowest split holding the maximum
    tok = tl.sum(tl.where(sp == first, pi, 0), axis=0)
    safe = tl.where(m == float("-inf"), 0.0, m)
    lse = safe + tl.log(tl.sum(ps * tl.exp(pm - safe), axis=0))
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(lse_ptr + row, lse)
    tl.store(lp_ptr + row, m - lse)
    if PACKED:  # [R, 2] int64: the token, and its log-prob's float32 bits (one copy to the host)
        tl.store(packed_ptr + 2 * row, tok.to(tl.int64))
        tl.store(packed_ptr + 2 * row + 1, (m - lse).to(tl.int32, bitcast=True).to(tl.int64))


def argmax_logsumexp(logits: torch.Tensor, split: int = SPLIT, packed: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(argmax int64 [R], logsumexp float32 [R], log-prob of the argmax float32 [R]) of
    float32 ``logits`` [R, V] (contiguous rows). ``split``: columns per partial program
    (a power of two; tests shrink it to cover several partials on tiny rows). ``packed``:
    an int64 [R, 2] tensor that also receives (argmax, the log-prob's float32 bits): the
    layout of ``deepinfer.engine.sampler.pack_greedy``."""
    check_device(logits)
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"argmax_logsumexp: logits must be float32 [R, V] with contiguous rows, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    if split < 16 or split & (split - 1):
        raise ValueError(f"argmax_logsumexp: split={split} must be a power of two >= 16")
    r, v = logits.shape
    dev = logits.device
    tok = torch.empty(r, dtype=torch.int64, device=dev)
    lse = torch.empty(r, dtype=torch.float32, device=dev)
    lp = torch.empty(r, dtype=torch.float32, device=dev)
    if r == 0:
        return tok, lse, lp
    n_splits = triton.cdiv(v, split)
    pmax = torch.empty(r, n_splits, dtype=torch.float32, device=dev)
    psum, pidx = torch.empty_like(pmax), torch.empty(r, n_splits, dtype=torch.int32, device=dev)
    _argmax_partial_kernel[(r, n_splits)](logits, logits.stride(0), v, pmax, psum, pidx, n_splits,
                                   SPLIT=split, BLOCK=min(split, 1024), num_warps=4)
    if packed is not None and (packed.shape != (r, 2) or packed.dtype != torch.int64 or not packed.is_contiguous()):
        raise ValueError(f"argmax_logsumexp: packed must be a contiguous int64 [{r}, 2] tensor")
    _argmax_finish_kernel[(r,)](pmax, psum, pidx, tok, lse, lp, packed if packed is not None else tok, n_splits,
                         BLOCK_S=max(16, next_pow2(n_splits)), PACKED=packed is not None, num_warps=1)
    return tok, lse, lp


def argmax_logsumexp_ref(logits: torch.Tensor, split: int = SPLIT, packed: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`argmax_logsumexp`."""
    tok = logits.argmax(dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    lp = torch.log_softmax(logits, dim=-1).gather(1, tok[:, None]).squeeze(1)
    if packed is not None:
        from deepinfer.engine.sampler import pack_greedy

        packed.copy_(pack_greedy(tok, lp))
    return tok, lse, lp

