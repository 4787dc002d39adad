"""Bitwise batch invariance of every op of the reference path: a row's result computed
alone == the same row inside batches of 1..256 rows at the first / middle / last
position, with fresh random companions (torch.equal, never a tolerance).

Ops marked "no mode" are invariant by themselves (row-wise kernels of a fixed row
length); the others are checked in batch-invariant mode (see deepinfer/models/invariant_ops.py
for what varies without it). Model-level checks (attention over chunks, the indexer,
the MoE inside the model) live in tests/test_batch_invariance_model.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from batch_invariance_common import Rows, assert_close, assert_row_invariant, randn

from deepinfer import batch_invariant as bi
from deepinfer.batch_invariant import batch_invariant_mode
from deepinfer.engine.sampler import Sampler, SamplingTensors
from deepinfer.models import invariant_ops
from deepinfer.models.linear import GroupedLinear, Linear
from deepinfer.models.mhc import hc_head, hc_post, hc_pre
from deepinfer.models.moe import MoE
from deepinfer.models.norm import RMSNorm, unweighted_rms_norm
from deepinfer.sampling_params import SamplingParams

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def gen(fresh_seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(fresh_seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(64, 32), (32, 128), (64, 512), (256, 24), (1024, 2048)])
def test_linear(gen: torch.Generator, dtype: torch.dtype, k: int, n: int) -> None:
    lin = Linear(k, n, dtype)
    lin.weight.data = randn(gen, n, k, dtype=dtype, scale=k ** -0.5)
    with batch_invariant_mode(True):
        assert_row_invariant(lin, lambda m: (randn(gen, m, k, dtype=dtype),))


@pytest.mark.parametrize("threads", [1, 2])
def test_linear_threads_and_leading_dims(gen: torch.Generator, threads: int) -> None:
    w = randn(gen, 96, 160)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with batch_invariant_mode(True):
            assert_row_invariant(lambda x: invariant_ops.linear(x, w), lambda m: (randn(gen, m, 3, 160),))
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_linear(gen: torch.Generator, dtype: torch.dtype) -> None:
    lin = GroupedLinear(64, 2 * 16, 2, dtype)
    lin.weight.data = randn(gen, 32, 64, dtype=dtype, scale=0.125)
    with batch_invariant_mode(True):
        assert_row_invariant(lin, lambda m: (randn(gen, m, 2, 64, dtype=dtype),))


def test_matmul_nt_independent_of_rows_and_keys(gen: torch.Generator) -> None:
    """The indexer's scores: element (i, j) is the same for any number of queries and keys."""
    keys = randn(gen, 300, 16)
    with batch_invariant_mode(True):
        for n_keys in (1, 5, 33, 64, 300):
            assert_row_invariant(lambda a, n=n_keys: invariant_ops.matmul_nt(a, keys[:n])[:, :1],
                                 lambda m: (randn(gen, m, 16),), sizes=[1, 7, 256])


@pytest.mark.parametrize("mode", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_and_softmax_no_mode(gen: torch.Generator, dtype: torch.dtype, mode: bool) -> None:
    for d in (16, 64, 4096):
        norm = RMSNorm(d)
        norm.weight.data = 1 + 0.1 * randn(gen, d)
        with batch_invariant_mode(mode):
            assert_row_invariant(norm, lambda m, d=d: (randn(gen, m, d, dtype=dtype),))
            assert_row_invariant(lambda x: unweighted_rms_norm(x, 1e-6),
                                 lambda m, d=d: (randn(gen, m, d, dtype=dtype),))
    for d in (8, 37, 512):
        assert_row_invariant(lambda x: (torch.softmax(x.float(), -1), torch.log_softmax(x.float(), -1)),
                             lambda m, d=d: (randn(gen, m, 4, d, dtype=dtype),))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sigmoid", "silu", "softplus"])
def test_elementwise(gen: torch.Generator, dtype: torch.dtype, op: str) -> None:
    fn = getattr(invariant_ops, op)
    with batch_invariant_mode(True):
        for width in (1, 4, 8, 33):
            assert_row_invariant(fn, lambda m, w=width: (randn(gen, m, w, dtype=dtype, scale=4.0),))


@pytest.mark.parametrize("dtype", DTYPES)
def test_mhc(gen: torch.Generator, dtype: torch.dtype) -> None:
    n, d = 4, 64
    mix = (2 + n) * n
    fn, base, scale = randn(gen, mix, n * d, scale=0.05), randn(gen, mix, scale=0.5), 1 + randn(gen, 3, scale=0.2)
    hfn, hbase, hscale = randn(gen, n, n * d, scale=0.05), randn(gen, n, scale=0.5), 1 + randn(gen, 1, scale=0.2)

    def streams(m: int) -> Rows:
        return (randn(gen, m, n, d, dtype=dtype),)

    with batch_invariant_mode(True):
        assert_row_invariant(lambda s: hc_pre(s, fn, base, scale, 20, 1e-6, 1e-6), streams)
        assert_row_invariant(lambda s: hc_head(s, hfn, hbase, hscale, 1e-6, 1e-6), streams)
    # hc_post mixes the streams with a batched 4x4 matmul per token: invariant on CPU with or
    # without the mode; in the mode an explicit stream-order sum (cuBLAS picks by batch count)
    post_args = (lambda m: (randn(gen, m, d, dtype=dtype), randn(gen, m, n, d, dtype=dtype),
                            randn(gen, m, n).abs(), torch.rand(m, n, n, generator=gen)))
    for mode in (False, True):
        with batch_invariant_mode(mode):
            assert_row_invariant(lambda o, s, p, c: hc_post(o, s, p, c), post_args)
    # the mode's fixed-order sums compute the same function (within the dtype's rounding)
    s = randn(gen, 50, n, d, dtype=dtype)
    args = post_args(50)
    for call in (lambda: hc_pre(s, fn, base, scale, 20, 1e-6, 1e-6), lambda: hc_head(s, hfn, hbase, hscale, 1e-6, 1e-6),
                 lambda: hc_post(*args)):
        with batch_invariant_mode(False):
            ref = call()
        with batch_invariant_mode(True):
            got = call()
        for g, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
            assert_close(g, r, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_hash", [False, True])
def test_moe(gen: torch.Generator, dtype: torch.dtype, is_hash: bool) -> None:
    """Experts see a number of rows that depends on the batch; the combine adds each
    token's expert outputs in a fixed order."""
    hidden, inter, experts, vocab = 64, 32, 8, 100
    moe = MoE(hidden, inter, experts, 2, 1, is_hash, vocab, "sqrtsoftplus", 1.5, True, 10.0, dtype)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.copy_(randn(gen, *p.shape, scale=p.shape[-1] ** -0.5 if p.dim() > 1 else 0.5).to(p.dtype))
        if is_hash:
            moe.gate.tid2eid.copy_(torch.rand(vocab, experts, generator=gen).argsort(-1)[:, :2])
        with batch_invariant_mode(True):
            assert_row_invariant(moe, lambda m: (randn(gen, m, hidden, dtype=dtype),
                                                 torch.randint(0, vocab, (m,), generator=gen)))


def test_sampler_no_mode(gen: torch.Generator) -> None:
    """Row-wise pipeline + counter RNG keyed by (seq_seed, position): invariant as is."""
    vocab = 512
    kinds = [SamplingParams(temperature=1.0, seq_seed=11), SamplingParams(temperature=0.0),
             SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seq_seed=5, top_logprobs=3)]
    sampler = Sampler()

    def run(logits: torch.Tensor, kind: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        params = SamplingTensors.from_params([kinds[int(k)] for k in kind], pos.tolist())
        out = sampler.sample(logits, params)
        assert out.top_logprobs is not None or params.max_top_logprobs == 0
        return out.token_ids, out.logprobs

    for kind in range(len(kinds)):
        assert_row_invariant(run, lambda m, kind=kind: (
            randn(gen, m, vocab, scale=3.0),
            torch.where(torch.arange(m) == 0, kind, torch.randint(0, 3, (m,), generator=gen)),
            torch.randint(0, 1000, (m,), generator=gen)))


def test_mode_switch_and_kernel_dispatch(gen: torch.Generator) -> None:
    assert not bi.enabled()
    with batch_invariant_mode(True):
        assert bi.enabled()
        with batch_invariant_mode(False):
            assert not bi.enabled()
        assert bi.enabled()
    assert not bi.enabled()
    calls: list[tuple[int, ...]] = []

    def fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return invariant_ops.tiled_linear(x, w)

    x, w = randn(gen, 5, 8), randn(gen, 3, 8)
    bi.register_kernel("linear", "cpu", fake)
    try:
        invariant_ops.linear(x, w)
        assert calls == []  # mode off: plain F.linear
        with batch_invariant_mode(True):
            invariant_ops.linear(x, w)
        assert calls == [(5, 8)] and bi.registered_kernels() == {("linear", "cpu"): fake.__qualname__}
    finally:
        bi.register_kernel("linear", "cpu", None)
    with pytest.raises(KeyError, match="unknown batch-invariant op"):
        bi.register_kernel("conv", "cuda", fake)
    with contextlib.suppress(TypeError), pytest.raises(TypeError):
        bi.set_enabled(1)  # type: ignore[arg-type]
