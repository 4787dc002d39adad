"""Fused mHC kernels vs the model's mhc.py (interpreter on CPU, tiny shapes, fresh inputs)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, assert_close, gen  # noqa: E402

from deepinfer_kernels.mhc import (fn_terms, hc_head, hc_head_ref, hc_post_pre, hc_post_pre_ref,  # noqa: E402
                                   hc_pre, hc_pre_ref, tuned)

N, ITERS, HC_EPS, EPS = 4, 20, 1e-6, 1e-6


def _params(g: torch.Generator, d: int, head: bool = False):
    """Mix weights like a checkpoint's: float32, small, with non-trivial base and scale."""
    mix = N if head else (2 + N) * N
    fn = (torch.randn(mix, N * d, generator=g) * 0.05).to(DEVICE)
    base = (torch.randn(mix, generator=g) * 0.5).to(DEVICE)
    scale = (torch.rand(1 if head else 3, generator=g) + 0.5).to(DEVICE)
    return fn, base, scale


def _streams(g: torch.Generator, t: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(t, N, d, generator=g) * 2 + 0.3).to(dtype).to(DEVICE)


def _norm(g: torch.Generator, d: int):
    return (torch.rand(d, generator=g) + 0.5).to(DEVICE), 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
# (3, 64): the row mix kernel; (19, 160) forced onto the dot kernel: its 128-column K splits
# end mid-stream and D is not a power of two
@pytest.mark.parametrize("t,d", [(3, 64), (19, 160)])
@pytest.mark.parametrize("normed,iters", [(False, 3), (True, ITERS)])  # 3: far from converged, every step shows
def test_hc_pre(fresh_seed: int, dtype: torch.dtype, t: int, d: int, normed: bool, iters: int) -> None:
    g = gen(fresh_seed)
    streams = _streams(g, t, d, dtype)
    fn, base, scale = _params(g, d)
    norm = _norm(g, d) if normed else None
    with tuned(rows_max_t=0 if d == 160 else 64):
        post, comb, x = hc_pre(streams, fn, base, scale, iters, HC_EPS, EPS, norm)
    post_r, comb_r, x_r = hc_pre_ref(streams, fn, base, scale, iters, HC_EPS, EPS, norm)
    assert post.dtype == comb.dtype == torch.float32 and x.dtype == dtype
    assert_close(post, post_r, torch.float32)
    assert_close(comb, comb_r, torch.float32)
    assert_close(x, x_r, dtype)
    # the Sinkhorn output is (nearly) doubly stochastic: the kernel really iterated
    assert torch.allclose(comb.sum(-2), torch.ones(t, N, device=DEVICE), atol=1e-4)
    if iters == ITERS:  # rows converge as far as the reference's 20 iterations take them (not always to 1e-2)
        row_err, row_err_r = (comb.sum(-1) - 1).abs().max(), (comb_r.sum(-1) - 1).abs().max()
        assert row_err <= row_err_r + 1e-4 and row_err_r < 0.1


def test_hc_pre_expanded_embedding(fresh_seed: int) -> None:
    """Layer 0 reads the embedding broadcast over the streams (stride 0) without a copy."""
    g = gen(fresh_seed)
    emb = torch.randn(5, 96, generator=g).to(torch.bfloat16).to(DEVICE)
    streams = emb.unsqueeze(1).expand(-1, N, -1)
    fn, base, scale = _params(g, 96)
    got = hc_pre(streams, fn, base, scale, ITERS, HC_EPS, EPS)
    ref = hc_pre_ref(streams.contiguous(), fn, base, scale, ITERS, HC_EPS, EPS)
    for a, b, dt in zip(got, ref, (torch.float32, torch.float32, torch.bfloat16)):
        assert_close(a, b, dt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows_max_t", [0, 64])  # the dot / the row mix kernel
def test_hc_post_pre(fresh_seed: int, dtype: torch.dtype, rows_max_t: int) -> None:
    g = gen(fresh_seed)
    t, d = 6, 128
    streams = _streams(g, t, d, dtype)
    fn0, base0, scale0 = _params(g, d)
    post, comb, _ = hc_pre_ref(streams, fn0, base0, scale0, ITERS, HC_EPS, EPS)
    out = torch.randn(t, d, generator=g).to(dtype).to(DEVICE)
    fn, base, scale = _params(g, d)
    norm = _norm(g, d)
    with tuned(rows_max_t=rows_max_t):
        got = hc_post_pre(out, streams, post, comb, fn, base, scale, ITERS, HC_EPS, EPS, norm)
    ref = hc_post_pre_ref(out, streams, post, comb, fn, base, scale, ITERS, HC_EPS, EPS, norm)
    new, new_r = got[0], ref[0]
    assert new.dtype == dtype
    if dtype == torch.bfloat16:  # torch's rounding points: equal but where a 4-term sum order flips an ulp
        assert (new != new_r).float().mean() < 0.01
    assert_close(new, new_r, dtype)
    for a, b, dt in zip(got[1:], ref[1:], (torch.float32, torch.float32, dtype)):
        assert_close(a, b, dt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_post", [False, True])
@pytest.mark.parametrize("rows_max_t", [0, 64])  # the dot / the row mix kernel
def test_hc_head(fresh_seed: int, dtype: torch.dtype, with_post: bool, rows_max_t: int) -> None:
    g = gen(fresh_seed)
    t, d = 7, 64
    streams = _streams(g, t, d, dtype)
    prev = None
    if with_post:
        fn0, base0, scale0 = _params(g, d)
        post, comb, _ = hc_pre_ref(streams, fn0, base0, scale0, ITERS, HC_EPS, EPS)
        prev = (torch.randn(t, d, generator=g).to(dtype).to(DEVICE), post, comb)
    fn, base, scale = _params(g, d, head=True)
    norm = _norm(g, d)
    with tuned(rows_max_t=rows_max_t):
        got = hc_head(streams, fn, base, scale, HC_EPS, EPS, norm, prev)
    ref = hc_head_ref(streams, fn, base, scale, HC_EPS, EPS, norm, prev)
    assert_close(got, ref, dtype)


@pytest.mark.parametrize("split,block_s,mix_t,fin_t", [(32, 4, 16, 2), (64, 2, 32, 4), (256, 16, 16, 8)])
def test_hc_post_pre_launch_shapes(fresh_seed: int, split: int, block_s: int, mix_t: int, fin_t: int) -> None:
    """Every launch shape the GPU sweep may pick computes the same numbers: narrow splits
    whose partials the finish kernel sums over several tiles, wide splits that loop."""
    g = gen(fresh_seed)
    t, d = 37, 160  # K = 640: 20 / 10 / 3 splits, the last one partial
    streams = _streams(g, t, d, torch.bfloat16)
    post, comb, _ = hc_pre_ref(streams, *_params(g, d), ITERS, HC_EPS, EPS)
    out = torch.randn(t, d, generator=g).to(torch.bfloat16).to(DEVICE)
    fn, base, scale = _params(g, d)
    norm = _norm(g, d)
    ref = hc_post_pre_ref(out, streams, post, comb, fn, base, scale, ITERS, HC_EPS, EPS, norm)
    with tuned(split=split, large_split=split, finish_splits=block_s, mix_block_t=mix_t, finish_block_t=fin_t,
               rows_max_t=0):  # the dot mix kernel (decode sizes would take the row kernel)
        got = hc_post_pre(out, streams, post, comb, fn, base, scale, ITERS, HC_EPS, EPS, norm)
        alone = hc_post_pre(out[5:6], streams[5:6], post[5:6], comb[5:6], fn, base, scale, ITERS, HC_EPS, EPS, norm)
    for a, b, dt in zip(got[1:], ref[1:], (torch.float32, torch.float32, torch.bfloat16)):
        assert_close(a, b, dt)
    for a, b in zip(alone, got):  # a row's numbers do not depend on the batch around it
        assert torch.equal(a, b[5:6])


def test_fn_terms_carry_float32(fresh_seed: int) -> None:
    """The tensor-core mix's three bf16 slices of fn add back to fn to float32 precision
    (one slice alone is bf16's 3 digits: the reason for three)."""
    fn, _, _ = _params(gen(fresh_seed), 96)
    parts = fn_terms(fn, 3)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, *fn.shape)
    assert (parts.float().sum(0) - fn).abs().max() <= 2 ** -23 * fn.abs().max()
    assert (parts[0].float() - fn).abs().max() > 2 ** -12 * fn.abs().max()


# split 32 divides D = 96 (a program's columns in one stream: the vector-load path), 64 / 256 do not
@pytest.mark.parametrize("op,split,block_t", [("pre", 32, 16), ("post_pre", 64, 16), ("post_pre", 32, 32),
                                              ("head", 256, 16), ("head", 32, 16)])
def test_tensor_core_mix(fresh_seed: int, op: str, split: int, block_t: int) -> None:
    """Prefill-sized bf16 steps take the dot kernel on tensor cores (fn as three bf16
    slices): same numbers as the reference as closely as the IEEE float32 dot kernel."""
    g = gen(fresh_seed)
    t, d, iters = 20, 96, 3  # K = 384: 6 / 2 splits, row tiles ending mid-block
    streams = _streams(g, t, d, torch.bfloat16)
    post, comb, _ = hc_pre_ref(streams, *_params(g, d), ITERS, HC_EPS, EPS)
    out = torch.randn(t, d, generator=g).to(torch.bfloat16).to(DEVICE)
    fn, base, scale = _params(g, d, head=op == "head")
    norm = _norm(g, d)
    if op == "pre":
        args, run, ref = (streams, fn, base, scale, iters, HC_EPS, EPS, norm), hc_pre, hc_pre_ref
    elif op == "post_pre":
        args = (out, streams, post, comb, fn, base, scale, iters, HC_EPS, EPS, norm)
        run, ref = hc_post_pre, hc_post_pre_ref
    else:
        args, run, ref = (streams, fn, base, scale, HC_EPS, EPS, norm, (out, post, comb)), hc_head, hc_head_ref
    want = ref(*args)
    with tuned(rows_max_t=0, tc_min_t=1, tc_terms=3, tc_split=split, tc_block_t=block_t, tc_block_k=32):
        got = run(*args)
    with tuned(rows_max_t=0, tc_min_t=t + 1):  # the IEEE float32 dot kernel on the same inputs
        ieee = run(*args)
    got, ieee, want = [x if isinstance(x, tuple) else (x,) for x in (got, ieee, want)]
    for a, b, c in zip(got, ieee, want):
        dt = torch.float32 if a.dtype == torch.float32 else torch.bfloat16
        assert_close(a, c, dt)
        if dt == torch.float32:  # no less accurate than the float32 kernel, within float32 noise
            assert (a - c).abs().max() <= 2 * (b - c).abs().max() + 1e-5


def test_tensor_core_mix_follows_in_place_weight_updates(fresh_seed: int) -> None:
    """The bf16 slices of fn are cached on the weight tensor; an in-place update (a reload)
    is seen by the next call."""
    g = gen(fresh_seed)
    streams = _streams(g, 20, 96, torch.bfloat16)
    fn, base, scale = _params(g, 96)
    with tuned(rows_max_t=0, tc_min_t=1, tc_split=32, tc_block_t=16, tc_block_k=32):
        hc_pre(streams, fn, base, scale, 3, HC_EPS, EPS)
        fn.mul_(-1.5)
        post, comb, x = hc_pre(streams, fn, base, scale, 3, HC_EPS, EPS)
    post_r, comb_r, x_r = hc_pre_ref(streams, fn, base, scale, 3, HC_EPS, EPS)
    assert_close(post, post_r, torch.float32)
    assert_close(comb, comb_r, torch.float32)
    assert_close(x, x_r, torch.bfloat16)


@pytest.mark.parametrize("rows_split,per_program,one_pass", [(32, 1, True), (32, 3, False), (32, 8, True)])
def test_row_mix_kernel(fresh_seed: int, rows_split: int, per_program: int, one_pass: bool) -> None:
    """Decode-sized steps take the dot-free row mix kernel (a program per stream slice and
    a few tokens); every entry point computes the reference's numbers through it, with the
    collapse in one pass of registers or in two tiled passes, and a token's numbers do not
    depend on the tokens sharing its program."""
    g = gen(fresh_seed)
    t, d = 7, 160  # 7 tokens: the last program of 3 / 4 rows is partial
    streams = _streams(g, t, d, torch.bfloat16)
    post, comb, _ = hc_pre_ref(streams, *_params(g, d), ITERS, HC_EPS, EPS)
    out = torch.randn(t, d, generator=g).to(torch.bfloat16).to(DEVICE)
    fn, base, scale = _params(g, d)
    fn_h, base_h, scale_h = _params(g, d, head=True)
    norm = _norm(g, d)
    with tuned(rows_split=rows_split, rows_per_program=per_program, finish_one_pass=4096 if one_pass else 0):
        got = hc_post_pre(out, streams, post, comb, fn, base, scale, ITERS, HC_EPS, EPS, norm)
        alone = hc_post_pre(out[4:5], streams[4:5], post[4:5], comb[4:5], fn, base, scale, ITERS, HC_EPS, EPS, norm)
        pre = hc_pre(streams, fn, base, scale, 3, HC_EPS, EPS)
        head = hc_head(streams, fn_h, base_h, scale_h, HC_EPS, EPS, norm, (out, post, comb))
    ref = hc_post_pre_ref(out, streams, post, comb, fn, base, scale, ITERS, HC_EPS, EPS, norm)
    assert (got[0] != ref[0]).float().mean() < 0.01
    for a, b, dt in zip(got[1:], ref[1:], (torch.float32, torch.float32, torch.bfloat16)):
        assert_close(a, b, dt)
    for a, b, dt in zip(pre, hc_pre_ref(streams, fn, base, scale, 3, HC_EPS, EPS), (torch.float32,) * 2 + (torch.bfloat16,)):
        assert_close(a, b, dt)
    assert_close(head, hc_head_ref(streams, fn_h, base_h, scale_h, HC_EPS, EPS, norm, (out, post, comb)), torch.bfloat16)
    for a, b in zip(alone, got):
        assert torch.equal(a, b[4:5])


def test_hc_rejects_unsupported_streams() -> None:
    x = torch.zeros(2, 3, 8, device=DEVICE)
    fn = torch.zeros(15, 24, device=DEVICE)
    with pytest.raises(ValueError, match="hc_mult=3"):
        hc_pre(x, fn, torch.zeros(15, device=DEVICE), torch.ones(3, device=DEVICE), 2, 1e-6, 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows_max_t", [0, 64])  # the dot / the row mix kernel
@pytest.mark.parametrize("with_post", [False, True])
def test_hc_shifted(fresh_seed: int, dtype: torch.dtype, rows_max_t: int, with_post: bool) -> None:
    """V4.1's shifted site: this site's pre / post / comb from the (expanded) streams, the
    input collapsed with the previous site's pre, the expansion in float32 (one rounding)."""
    from deepinfer_kernels.mhc import hc_shifted, hc_shifted_ref

    g = gen(fresh_seed)
    t, d = 5, 128
    streams = _streams(g, t, d, dtype)
    prev = None
    if with_post:
        post, comb, _ = hc_pre_ref(streams, *_params(g, d), ITERS, HC_EPS, EPS)
        prev = (torch.randn(t, d, generator=g).to(dtype).to(DEVICE), post, comb)
    pre_in = (torch.rand(t, N, generator=g) + 0.1).to(DEVICE)
    fn, base, scale = _params(g, d)
    norm = _norm(g, d)
    with tuned(rows_max_t=rows_max_t):
        got = hc_shifted(streams, fn, base, scale, ITERS, HC_EPS, EPS, pre_in, norm, prev)
    ref = hc_shifted_ref(streams, fn, base, scale, ITERS, HC_EPS, EPS, pre_in, norm, prev)
    assert (got[0] is None) == (ref[0] is None) == (not with_post)
    if with_post:
        assert got[0].dtype == dtype
        assert_close(got[0], ref[0], dtype)
    for a, b, dt in zip(got[1:], ref[1:], (torch.float32, torch.float32, torch.float32, dtype)):
        assert_close(a, b, dt)
