"""Fused mHC (manifold-constrained hyper-connections) kernels: ``hc_pre``, ``hc_post``
folded into the next ``hc_pre`` / ``hc_head``, and the sublayer input RMSNorm.

Math (``deepinfer.models.mhc``; T tokens, N streams of width D, K = N * D, float32
mixes, ``round`` = round to the activation dtype):

* post (optional, the previous sublayer's output ``o`` with its ``post``/``comb``):
  ``s[j] = round(round(round(post[j]) * o) + round(sum_i round(comb[i, j]) * s_old[i]))``
  (torch's bf16 elementwise product and its bf16 4-wide matmul), stored as the new streams;
* mixes ``m = (s_flat @ fn^T) * rsqrt(mean(s_flat^2) + eps)``;
* layer mode: ``pre = sigmoid(m_pre * s0 + b_pre) + hc_eps``, ``post = 2 sigmoid(...)``,
  ``comb = softmax_row(m_comb * s2 + b_comb) + hc_eps`` then Sinkhorn-Knopp (columns,
  then ``iters - 1`` x rows + columns, each ``x / (sum + hc_eps)``);
  head mode (``hc_head``): only ``pre = sigmoid(m * s + b) + hc_eps``;
* collapse ``x = round(sum_j pre[j] * s[j])``, optionally ``RMSNorm(x)`` (the sublayer's
  attn_norm / ffn_norm, or the model's final norm after the head).

Two launches, whatever N and D: a mix kernel (grid: token blocks x K splits) computes
the new streams of its K slice, their partial sum of squares and partial mix dot products
(float32) -- ``_mix_rows_kernel`` for decode-sized steps (no tl.dot, a slice of one stream
per program), ``_mix_kernel`` (IEEE tl.dot over 16-row tiles) above; ``_finish_kernel`` (grid: token blocks) adds the partials (a fixed-shape
tile reduction over the splits), runs the activations and all Sinkhorn iterations in
registers and writes post, comb and the (normed) collapse. Every token's numbers depend
only on its own row.

Why many narrow splits: a decode step has one to a few hundred tokens, so the kernel is
latency-bound; each mix program does ONE pass over ``SPLIT`` columns (no serial loop of
dependent loads), and the finish kernel reads each row's partials as one contiguous tile
(the first version looped over 512-column slices and summed the partials one split at a
time: half of a `mini` decode step's GPU time at T=1 on an H200; the dot kernel with narrow
splits was still several times the row kernel's time at T=1; docs/measurements.md).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ._common import check_device, dtype_code, interpreting, mma, next_pow2, round_to


@dataclass(frozen=True)
class MhcTuning:
    """Launch shape of the kernels, measured on an H200 (profiling/results/mhc_tuning_h200.json,
    ``python3 profiling/mhc_tuning.py``). Steps of at most ``rows_max_t`` tokens (decode,
    speculative verify) take the row mix kernel: ``rows_split`` columns of one stream and
    ``rows_per_program`` tokens per program, ``rows_warps`` warps (hc_post_pre + norm at
    T=1 a fraction of the dot kernel's time at mini and V4-Flash widths). Larger steps use the dot kernel with ``split`` columns per program up to
    ``small_work`` = T x K elements and ``large_split`` above (fewer partials to add). A
    row's numbers depend on its own row and on which kernel its step size selects, never
    otherwise on the batch (batch-invariant mode passes one shape for every step size:
    deepinfer/models/fast/invariant.py). Prefill-sized
    bf16 steps take the tensor-core variant (``tc_*``; ``mhc_tuning.py --large``,
    profiling/results/mhc_tuning_large_h200.json): hc_post_pre + norm at 8k tokens x
    V4-Flash widths several times faster than the IEEE dot kernel with aligned splits
    (numbers in docs/measurements.md)."""

    split: int = 128
    large_split: int = 512
    small_work: int = 64 * 4096
    mix_block_t: int = 16  # tl.dot needs >= 16 rows
    mix_warps: int = 4
    finish_block_t: int = 1
    finish_splits: int = 64  # splits summed per tile in the finish kernel
    finish_warps: int = 4
    finish_one_pass: int = 4096  # finish rows x D up to this: the collapse in one pass of registers
    rows_max_t: int = 64
    rows_split: int = 256  # the largest power of two <= this dividing D is used (>= 32, else the dot kernel)
    rows_per_program: int = 2
    rows_warps: int = 1
    # prefill-sized bf16 steps (T >= tc_min_t): the dot kernel on tensor cores, fn split
    # into tc_terms bf16 slices (3: fn to ~2^-24, float32's precision; 0 disables)
    tc_min_t: int = 256
    tc_terms: int = 3
    tc_split: int = 512
    tc_block_t: int = 64
    tc_block_k: int = 32
    tc_warps: int = 4
    tc_stages: int = 2


#: The shape every launch uses (profiling/mhc_tuning.py sweeps alternatives on a GPU).
TUNING = MhcTuning()


@contextmanager
def tuned(**fields):
    """Temporarily launch with other :class:`MhcTuning` fields (benchmarks, tests)."""
    global TUNING
    saved, TUNING = TUNING, replace(TUNING, **fields)
    try:
        yield TUNING
    finally:
        TUNING = saved


@triton.jit(do_not_specialize=["T"])
def _mix_kernel(src_ptr, out_ptr, post_ptr, comb_ptr, new_ptr, fn_ptr, part_ptr, ss_ptr,
                T, D, stride_st, stride_sj, stride_ot, n_splits, term_stride,
                N: tl.constexpr, HAS_POST: tl.constexpr, HEAD: tl.constexpr, CODE: tl.constexpr,
                INTERP: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT: tl.constexpr, TERMS: tl.constexpr, ALIGNED: tl.constexpr, FP32_POST: tl.constexpr):
    # TERMS = 0: fn is float32 and the dots run in IEEE float32; TERMS > 0: fn is TERMS
    # bfloat16 slices (fn = sum of them, term_stride apart) and v is bf16-exact, so each
    # term's dot runs on the tensor cores with exact products and float32 accumulation.
    # ALIGNED (SPLIT divides D): a program's columns lie in one stream, so the stream index
    # is a scalar and the columns are contiguous and aligned: vector loads. Otherwise every
    # column's (stream, offset) is computed and the loads are element-wise (an order of
    # magnitude slower at prefill sizes on an H200: docs/measurements.md).
    pid_t, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    r2 = rows.to(tl.int64)[:, None]
    K = N * D
    cp = tl.arange(0, NP)
    cc = tl.arange(0, N * N)
    acc_pre = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
    acc_post = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
    acc_comb = tl.zeros([BLOCK_T, N * N], dtype=tl.float32)
    ss = tl.zeros([BLOCK_T], dtype=tl.float32)
    k_lo = pid_k * SPLIT
    for it in range(0, SPLIT // BLOCK_K):
        kk = k_lo + it * BLOCK_K + tl.arange(0, BLOCK_K)
        if ALIGNED:
            kk = tl.max_contiguous(tl.multiple_of(kk, BLOCK_K), BLOCK_K)
            m2 = rmask[:, None]
            pmask = (cp < N)[None, :]
            cmask = (cc >= 0)[None, :]
            j = k_lo // D
            d = tl.max_contiguous(tl.multiple_of(k_lo % D + it * BLOCK_K + tl.arange(0, BLOCK_K), BLOCK_K),
                                  BLOCK_K)[None, :]
        else:
            kmask = kk < K
            m2 = rmask[:, None] & kmask[None, :]
            pmask = kmask[:, None] & (cp[None, :] < N)
            cmask = kmask[:, None]
            j = (kk // D)[None, :]
            d = (kk % D)[None, :]
        if HAS_POST:  # hc_post of the previous sublayer, for this slice of the new streams
            o = tl.load(out_ptr + r2 * stride_ot + d, mask=m2, other=0.0).to(tl.float32)
            p = tl.load(post_ptr + r2 * N + j, mask=m2, other=0.0)
            if FP32_POST:  # V4.1: post * o + sum comb * s in float32, one rounding
                v = p * o
            else:
                v = round_to(round_to(p, CODE, INTERP) * o, CODE, INTERP)
            mix = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
            for i in tl.static_range(N):
                c = tl.load(comb_ptr + r2 * (N * N) + i * N + j, mask=m2, other=0.0)
                if not FP32_POST:
                    c = round_to(c, CODE, INTERP)
                s = tl.load(src_ptr + r2 * stride_st + i * stride_sj + d, mask=m2, other=0.0).to(tl.float32)
                mix += c * s
            if FP32_POST:
                v = round_to(v + mix, CODE, INTERP)
            else:
                v = round_to(v + round_to(mix, CODE, INTERP), CODE, INTERP)
            tl.store(new_ptr + r2 * K + kk[None, :], v.to(new_ptr.dtype.element_ty), mask=m2)
        else:
            v = tl.load(src_ptr + r2 * stride_st + j * stride_sj + d, mask=m2, other=0.0).to(tl.float32)
        ss += tl.sum(v * v, axis=1)
        kc = kk[:, None]
        if TERMS == 0:
            w = tl.load(fn_ptr + cp[None, :] * K + kc, mask=pmask, other=0.0)
            acc_pre = tl.dot(v, w, acc_pre, input_precision="ieee")
            if not HEAD:
                w = tl.load(fn_ptr + (N + cp[None, :]) * K + kc, mask=pmask, other=0.0)
                acc_post = tl.dot(v, w, acc_post, input_precision="ieee")
                w = tl.load(fn_ptr + (2 * N + cc[None, :]) * K + kc, mask=cmask, other=0.0)
                acc_comb = tl.dot(v, w, acc_comb, input_precision="ieee")
        else:
            v16 = v.to(tl.bfloat16)
            for p in tl.static_range(TERMS):
                fp = fn_ptr + p * term_stride
                acc_pre = mma(v16, tl.load(fp + cp[None, :] * K + kc, mask=pmask, other=0.0), acc_pre, INTERP)
                if not HEAD:
                    w = tl.load(fp + (N + cp[None, :]) * K + kc, mask=pmask, other=0.0)
                    acc_post = mma(v16, w, acc_post, INTERP)
                    w = tl.load(fp + (2 * N + cc[None, :]) * K + kc, mask=cmask, other=0.0)
                    acc_comb = mma(v16, w, acc_comb, INTERP)
    # partials: [T, n_splits, 2 * NP + N * N] (pre | post | comb), [T, n_splits]: a row's are contiguous
    W = 2 * NP + N * N
    base = part_ptr + (r2 * n_splits + pid_k) * W
    tl.store(base + cp[None, :], acc_pre, mask=rmask[:, None])
    if not HEAD:
        tl.store(base + NP + cp[None, :], acc_post, mask=rmask[:, None])
        tl.store(base + 2 * NP + cc[None, :], acc_comb, mask=rmask[:, None])
    tl.store(ss_ptr + rows.to(tl.int64) * n_splits + pid_k, ss, mask=rmask)


@triton.jit(do_not_specialize=["T"])
def _mix_rows_kernel(src_ptr, out_ptr, post_ptr, comb_ptr, new_ptr, fn_ptr, part_ptr, ss_ptr,
                     T, D, stride_st, stride_sj, stride_ot, n_splits,
                     N: tl.constexpr, HAS_POST: tl.constexpr, HEAD: tl.constexpr, CODE: tl.constexpr,
                     INTERP: tl.constexpr, NP: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr,
                     MIXP: tl.constexpr, FP32_POST: tl.constexpr):
    """``_mix_kernel`` for decode-sized steps, without tl.dot: a program owns SPLIT columns
    of ONE stream (SPLIT divides D, so post / comb of that stream are scalars) for ROWS
    tokens, loads its [mixes, SPLIT] slice of fn once and reduces each token's products
    in one pass (the dot version pads every step to 16 rows and chains dependent loads)."""
    pid_t, pid_k = tl.program_id(0), tl.program_id(1)
    K = N * D
    j = (pid_k * SPLIT) // D
    d = (pid_k * SPLIT) % D + tl.arange(0, SPLIT)
    kk = pid_k * SPLIT + tl.arange(0, SPLIT)
    r = tl.arange(0, MIXP)
    n_mix = N if HEAD else (2 + N) * N
    live = r < n_mix
    w = tl.load(fn_ptr + r[:, None] * K + kk[None, :], mask=live[:, None], other=0.0)
    # partial layout of _mix_kernel: pre at [0, N), post at [NP, NP + N), comb at [2 NP, 2 NP + N * N)
    col = tl.where(r < N, r, tl.where(r < 2 * N, NP + r - N, 2 * NP + r - 2 * N))
    W = 2 * NP + N * N
    for i in tl.static_range(ROWS):
        row = pid_t * ROWS + i
        if row < T:
            row64 = row.to(tl.int64)
            if HAS_POST:
                o = tl.load(out_ptr + row64 * stride_ot + d).to(tl.float32)
                p = tl.load(post_ptr + row64 * N + j)
                if FP32_POST:
                    v = p * o
                else:
                    v = round_to(round_to(p, CODE, INTERP) * o, CODE, INTERP)
                mix = tl.zeros([SPLIT], dtype=tl.float32)
                for ii in tl.static_range(N):
                    c = tl.load(comb_ptr + row64 * (N * N) + ii * N + j)
                    if not FP32_POST:
                        c = round_to(c, CODE, INTERP)
                    mix += c * tl.load(src_ptr + row64 * stride_st + ii * stride_sj + d).to(tl.float32)
                if FP32_POST:
                    v = round_to(v + mix, CODE, INTERP)
                else:
                    v = round_to(v + round_to(mix, CODE, INTERP), CODE, INTERP)
                tl.store(new_ptr + row64 * K + kk, v.to(new_ptr.dtype.element_ty))
            else:
                v = tl.load(src_ptr + row64 * stride_st + j * stride_sj + d).to(tl.float32)
            tl.store(ss_ptr + row64 * n_splits + pid_k, tl.sum(v * v, axis=0))
            m = tl.sum(w * v[None, :], axis=1)
            tl.store(part_ptr + (row64 * n_splits + pid_k) * W + col, m, mask=live)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit(do_not_specialize=["T"])
def _finish_kernel(src_ptr, stride_st, stride_sj, part_ptr, ss_ptr, base_ptr, scale_ptr, norm_w_ptr,
                   post_ptr, comb_ptr, x_ptr, pre_in_ptr, pre_out_ptr, T, D, n_splits, iters, hc_eps, norm_eps,
                   out_eps, N: tl.constexpr, HEAD: tl.constexpr, HAS_NORM: tl.constexpr, CODE: tl.constexpr,
                   INTERP: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_S: tl.constexpr, ONE_PASS: tl.constexpr, SHIFTED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    r2 = rows.to(tl.int64)[:, None]
    cp = tl.arange(0, NP)
    cc = tl.arange(0, N * N)
    W = 2 * NP + N * N
    m_pre = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
    m_post = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
    m_comb = tl.zeros([BLOCK_T, N * N], dtype=tl.float32)
    ss = tl.zeros([BLOCK_T], dtype=tl.float32)
    # the partials of BLOCK_S splits at once, tile-reduced: a fixed shape, so the sums never depend on T
    r3 = r2[:, :, None]
    for s0 in range(0, n_splits, BLOCK_S):
        sp = s0 + tl.arange(0, BLOCK_S)
        s3 = sp[None, :, None]
        m3 = rmask[:, None, None] & (s3 < n_splits)
        base = part_ptr + (r3 * n_splits + s3) * W
        mp = m3 & (cp[None, None, :] < N)  # (the row mix kernel leaves the padding unwritten)
        m_pre += tl.sum(tl.load(base + cp[None, None, :], mask=mp, other=0.0), axis=1)
        if not HEAD:
            m_post += tl.sum(tl.load(base + NP + cp[None, None, :], mask=mp, other=0.0), axis=1)
            m_comb += tl.sum(tl.load(base + 2 * NP + cc[None, None, :], mask=m3, other=0.0), axis=1)
        ss += tl.sum(tl.load(ss_ptr + r2 * n_splits + sp[None, :], mask=rmask[:, None] & (sp[None, :] < n_splits),
                             other=0.0), axis=1)
    inv = tl.div_rn(1.0, tl.sqrt_rn(ss / (N * D) + norm_eps))[:, None]
    pmask = cp < N
    pre = _sigmoid(m_pre * inv * tl.load(scale_ptr) + tl.load(base_ptr + cp, mask=pmask, other=0.0)[None, :]) + hc_eps
    if not HEAD:
        post = 2.0 * _sigmoid(m_post * inv * tl.load(scale_ptr + 1)
                              + tl.load(base_ptr + N + cp, mask=pmask, other=0.0)[None, :])
        tl.store(post_ptr + r2 * N + cp[None, :], post, mask=rmask[:, None] & pmask[None, :])
        logit = m_comb * inv * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + cc)[None, :]
        logit = tl.reshape(logit, [BLOCK_T, N, N])
        e = tl.exp(logit - tl.max(logit, axis=2)[:, :, None])
        comb = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        for _ in range(iters - 1):
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        tl.store(comb_ptr + r2 * (N * N) + cc[None, :], tl.reshape(comb, [BLOCK_T, N * N]), mask=rmask[:, None])
    if SHIFTED:  # V4.1: this site's pre is output; the input collapses with the previous site's
        tl.store(pre_out_ptr + r2 * N + cp[None, :], pre, mask=rmask[:, None] & pmask[None, :])
        pre = tl.load(pre_in_ptr + r2 * N + cp[None, :], mask=rmask[:, None] & pmask[None, :], other=0.0)
    # collapse (and the sublayer's RMSNorm): in registers when a row fits one tile, else
    # two passes (the first for the sum of squares)
    if ONE_PASS:
        d = tl.arange(0, BLOCK_D)
        m2 = rmask[:, None] & (d[None, :] < D)
        x = _collapse(src_ptr, stride_st, stride_sj, pre, r2, d, m2, cp, N, BLOCK_T, BLOCK_D, CODE, INTERP)
        if HAS_NORM:
            inv2 = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=1) / D + out_eps))[:, None]
            w = tl.load(norm_w_ptr + d, mask=d < D, other=0.0)
            x = round_to(round_to(x * inv2, CODE, INTERP) * w[None, :], CODE, INTERP)
        tl.store(x_ptr + r2 * D + d[None, :], x.to(x_ptr.dtype.element_ty), mask=m2)
    else:
        ss2 = tl.zeros([BLOCK_T], dtype=tl.float32)
        if HAS_NORM:
            for d0 in range(0, D, BLOCK_D):
                d = d0 + tl.arange(0, BLOCK_D)
                m2 = rmask[:, None] & (d[None, :] < D)
                x = _collapse(src_ptr, stride_st, stride_sj, pre, r2, d, m2, cp, N, BLOCK_T, BLOCK_D, CODE, INTERP)
                ss2 += tl.sum(x * x, axis=1)
        inv2 = tl.div_rn(1.0, tl.sqrt_rn(ss2 / D + out_eps))[:, None]
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            m2 = rmask[:, None] & (d[None, :] < D)
            x = _collapse(src_ptr, stride_st, stride_sj, pre, r2, d, m2, cp, N, BLOCK_T, BLOCK_D, CODE, INTERP)
            if HAS_NORM:
                w = tl.load(norm_w_ptr + d, mask=d < D, other=0.0)
                x = round_to(round_to(x * inv2, CODE, INTERP) * w[None, :], CODE, INTERP)
            tl.store(x_ptr + r2 * D + d[None, :], x.to(x_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _collapse(src_ptr, stride_st, stride_sj, pre, r2, d, m2, cp, N: tl.constexpr, BLOCK_T: tl.constexpr,
              BLOCK_D: tl.constexpr, CODE: tl.constexpr, INTERP: tl.constexpr):
    """round(sum_j pre[:, j] * s[:, j, d]) for one [BLOCK_T, BLOCK_D] tile."""
    x = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(N):
        pj = tl.sum(tl.where(cp[None, :] == j, pre, 0.0), axis=1)
        sj = tl.load(src_ptr + r2 * stride_st + j * stride_sj + d[None, :], mask=m2, other=0.0)
        x += pj[:, None] * sj.to(tl.float32)
    return round_to(x, CODE, INTERP)


def fn_terms(fn: torch.Tensor, terms: int) -> torch.Tensor:
    """float32 ``fn`` [R, K] as ``terms`` bfloat16 slices [terms, R, K] summing to it: each
    the bf16 rounding of what the previous ones leave (3 slices carry 24 bits, float32's
    precision, so bf16-exact activations times them on tensor cores lose nothing)."""
    parts, rest = [], fn.float()
    for _ in range(terms):
        parts.append(rest.to(torch.bfloat16))
        rest = rest - parts[-1].float()
    return torch.stack(parts)


def _cached_terms(fn: torch.Tensor, terms: int) -> torch.Tensor:
    """:func:`fn_terms` of a model's mix weights, kept on the tensor itself until it changes
    in place (``_version``): the split is a constant of the parameter, recomputing it cost
    5 small launches per mHC call of every prefill step."""
    key = (fn._version, terms)
    cached = getattr(fn, "_mhc_fn_terms", None)
    if cached is None or cached[0] != key:
        cached = fn._mhc_fn_terms = (key, fn_terms(fn, terms))
    return cached[1]


def _check_streams(streams: torch.Tensor) -> None:
    n = streams.shape[1]
    if streams.dim() != 3 or streams.stride(2) != 1:
        raise ValueError(f"mhc: streams must be [T, N, D] with contiguous D, got {tuple(streams.shape)}")
    if n < 4 or n & (n - 1):
        raise ValueError(f"mhc: hc_mult={n} unsupported by the kernel (a power of two >= 4)")


def _launch(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
            hc_eps: float, norm_eps: float, head: bool, prev: tuple | None, norm: tuple | None,
            pre_in: torch.Tensor | None = None, tuning: MhcTuning | None = None):
    check_device(streams)
    _check_streams(streams)
    t, n, d = streams.shape
    dev, dtype = streams.device, streams.dtype
    fn, base, scale = fn.float().contiguous(), base.float().contiguous(), scale.float().contiguous()
    src, new = streams, None
    out = post_in = comb_in = streams
    if prev is not None:
        out, post_in, comb_in = prev
        if out.stride(-1) != 1:
            out = out.contiguous()
        post_in, comb_in = post_in.float().contiguous(), comb_in.float().contiguous()
        new = src = torch.empty(t, n, d, dtype=dtype, device=dev)
    tune = TUNING if tuning is None else tuning
    np_ = max(16, next_pow2(n))
    rows_split = tune.rows_split
    while rows_split > 32 and d % rows_split:
        rows_split //= 2
    rows = t <= tune.rows_max_t and d % rows_split == 0
    terms = tune.tc_terms if (not rows and t >= tune.tc_min_t and dtype == torch.bfloat16) else 0
    if rows:
        split = rows_split
    elif terms:
        split = tune.tc_split
    else:
        split = tune.split if t * n * d <= tune.small_work else tune.large_split
    n_splits = triton.cdiv(n * d, split)
    part = torch.empty(t, n_splits, 2 * np_ + n * n, dtype=torch.float32, device=dev)
    ss = torch.empty(t, n_splits, dtype=torch.float32, device=dev)
    post = torch.empty(t, n, dtype=torch.float32, device=dev)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=dev)
    x = torch.empty(t, d, dtype=dtype, device=dev)
    pre_out = torch.empty(t, n, dtype=torch.float32, device=dev) if pre_in is not None else None
    if pre_in is not None:
        pre_in = pre_in.float().contiguous()
    if t == 0:
        return (new, post, comb, x) if pre_in is None else (new, pre_out, post, comb, x)
    code, interp = dtype_code(dtype), interpreting()
    opts = {} if interp else {"enable_fp_fusion": False}
    mix_args = (streams, out, post_in, comb_in, new if new is not None else x, fn, part, ss,
                t, d, streams.stride(0), streams.stride(1), out.stride(0), n_splits)
    shifted = pre_in is not None
    mix_kw = dict(N=n, HAS_POST=prev is not None, HEAD=head, CODE=code, INTERP=interp, NP=np_, SPLIT=split,
                  FP32_POST=shifted, **opts)
    if rows:
        _mix_rows_kernel[(triton.cdiv(t, tune.rows_per_program), n_splits)](
            *mix_args, ROWS=tune.rows_per_program, MIXP=next_pow2(n if head else (2 + n) * n),
            num_warps=tune.rows_warps, **mix_kw)
    elif terms:
        parts = _cached_terms(fn, terms)
        mix_args = mix_args[:5] + (parts,) + mix_args[6:]
        _mix_kernel[(triton.cdiv(t, tune.tc_block_t), n_splits)](
            *mix_args, parts.stride(0), BLOCK_T=tune.tc_block_t, BLOCK_K=min(tune.tc_block_k, split),
            TERMS=terms, ALIGNED=d % split == 0, num_warps=tune.tc_warps, num_stages=tune.tc_stages, **mix_kw)
    else:
        _mix_kernel[(triton.cdiv(t, tune.mix_block_t), n_splits)](
            *mix_args, 0, BLOCK_T=tune.mix_block_t, BLOCK_K=min(64, split), TERMS=0, ALIGNED=d % split == 0,
            num_warps=tune.mix_warps, **mix_kw)
    norm_w, out_eps = (norm[0].float().contiguous(), float(norm[1])) if norm is not None else (base, 1.0)
    # a whole row in registers when it fits (one pass of loads), else 256-column tiles
    block_d = next_pow2(d) if next_pow2(d) * tune.finish_block_t <= tune.finish_one_pass else min(256, next_pow2(d))
    _finish_kernel[(triton.cdiv(t, tune.finish_block_t),)](
        src, src.stride(0), src.stride(1), part, ss, base, scale, norm_w, post, comb, x,
        pre_in if shifted else post, pre_out if shifted else post, t, d, n_splits, int(iters), float(hc_eps),
        float(norm_eps), out_eps,
        N=n, HEAD=head, HAS_NORM=norm is not None, CODE=code, INTERP=interp, NP=np_, BLOCK_T=tune.finish_block_t,
        BLOCK_D=block_d, BLOCK_S=min(tune.finish_splits, next_pow2(n_splits)), ONE_PASS=block_d >= d, SHIFTED=shifted,
        num_warps=tune.finish_warps, **opts)
    return (new, post, comb, x) if pre_in is None else (new, pre_out, post, comb, x)


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
           hc_eps: float, norm_eps: float, norm: tuple[torch.Tensor, float] | None = None,
           tuning: MhcTuning | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mhc.hc_pre`` -> (post [T, N] f32, comb [T, N, N] f32, x [T, D]). ``streams`` may be
    a stride-0 expand over N (the embedding at layer 0). ``norm=(weight, eps)`` returns
    ``RMSNorm(x)`` instead of x (the sublayer's input norm). ``tuning``: a launch shape
    other than :data:`TUNING` (batch-invariant mode fixes one for every step size)."""
    _, post, comb, x = _launch(streams, fn, base, scale, iters, hc_eps, norm_eps, False, None, norm, tuning=tuning)
    return post, comb, x


def hc_post_pre(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
                norm_eps: float, norm: tuple[torch.Tensor, float] | None = None, tuning: MhcTuning | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mhc.hc_post(out, streams, post, comb)`` then ``hc_pre`` of the next sublayer:
    -> (new streams [T, N, D], post, comb, x). ``tuning`` as in :func:`hc_pre`."""
    return _launch(streams, fn, base, scale, iters, hc_eps, norm_eps, False, (out, post, comb), norm, tuning=tuning)


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float, norm: tuple[torch.Tensor, float] | None = None,
            prev: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
            return_streams: bool = False, tuning: MhcTuning | None = None
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``mhc.hc_head`` -> x [T, D] (``RMSNorm(x)`` with ``norm``); ``prev=(out, post, comb)``
    first applies the last sublayer's ``hc_post``. ``return_streams``: (x, the streams the
    head collapsed) (the model's final streams, e.g. for an MTP drafter). ``tuning`` as in
    :func:`hc_pre`."""
    new, _, _, x = _launch(streams, fn, base, scale, 0, hc_eps, norm_eps, True, prev, norm, tuning=tuning)
    return (x, streams if new is None else new) if return_streams else x


def hc_shifted(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
               hc_eps: float, norm_eps: float, pre_in: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None,
               prev: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               tuning: MhcTuning | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V4.1's shifted mHC site (``v41.layers.hc_mixes`` / ``hc_collapse`` /
    ``hc_expand``): ``prev=(out, post, comb)`` first applies the previous sublayer's
    expansion in float32 with one rounding; this site's (pre, post, comb) come from the
    new streams, but the sublayer input collapses them with ``pre_in`` [T, N] (the
    previous site's pre), then ``norm``. -> (new streams or None without ``prev``, pre,
    post, comb, x). ``tuning`` as in :func:`hc_pre`."""
    return _launch(streams, fn, base, scale, iters, hc_eps, norm_eps, False, prev, norm, pre_in, tuning=tuning)


# ----------------------------------------------------------------------------- references
def _ref_norm(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None) -> torch.Tensor:
    from deepinfer.models.norm import RMSNorm

    if norm is None:
        return x
    return RMSNorm.forward(type("N", (), {"weight": norm[0], "eps": norm[1]})(), x)


def hc_pre_ref(streams, fn, base, scale, iters, hc_eps, norm_eps, norm=None):
    """Torch reference of :func:`hc_pre`: the model's ``mhc.hc_pre`` (+ RMSNorm)."""
    from deepinfer.models import mhc

    post, comb, x = mhc.hc_pre(streams, fn, base, scale, iters, hc_eps, norm_eps)
    return post, comb, _ref_norm(x, norm)


def hc_post_pre_ref(out, streams, post, comb, fn, base, scale, iters, hc_eps, norm_eps, norm=None):
    """Torch reference of :func:`hc_post_pre`: ``mhc.hc_post`` then ``mhc.hc_pre``."""
    from deepinfer.models import mhc

    new = mhc.hc_post(out, streams, post, comb)
    return (new,) + hc_pre_ref(new, fn, base, scale, iters, hc_eps, norm_eps, norm)


def hc_head_ref(streams, fn, base, scale, hc_eps, norm_eps, norm=None, prev=None, return_streams=False):
    """Torch reference of :func:`hc_head`: (``mhc.hc_post``), ``mhc.hc_head`` (+ RMSNorm)."""
    from deepinfer.models import mhc

    if prev is not None:
        streams = mhc.hc_post(prev[0], streams, prev[1], prev[2])
    x = _ref_norm(mhc.hc_head(streams, fn, base, scale, hc_eps, norm_eps), norm)
    return (x, streams) if return_streams else x


def hc_shifted_ref(streams, fn, base, scale, iters, hc_eps, norm_eps, pre_in, norm=None, prev=None):
    """Torch reference of :func:`hc_shifted`: V4.1's own ``hc_expand``, ``hc_mixes``,
    ``hc_collapse`` (+ RMSNorm)."""
    from deepinfer.models.v41.layers import hc_collapse, hc_expand, hc_mixes

    new = None
    if prev is not None:
        streams = new = hc_expand(prev[0], streams, prev[1], prev[2])
    pre, post, comb = hc_mixes(streams, fn, base, scale, iters, hc_eps, norm_eps)
    return new, pre, post, comb, _ref_norm(hc_collapse(streams, pre_in), norm)
