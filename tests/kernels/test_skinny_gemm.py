"""skinny_linear (few rows x wide weight, the decode LM head) vs F.linear."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, assert_close, gen  # noqa: E402

from deepinfer_kernels.skinny_gemm import (skinny_grouped_linear, skinny_grouped_linear_ref, skinny_linear,  # noqa: E402
                                           skinny_linear_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(1, 200, 64), (5, 97, 80), (17, 64, 96)])  # tails in N and K, 2 row tiles
def test_skinny_linear(fresh_seed: int, dtype: torch.dtype, m: int, n: int, k: int) -> None:
    g = gen(fresh_seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype).to(DEVICE)
    out = skinny_linear(x, w)
    assert out.dtype == dtype
    assert_close(out, skinny_linear_ref(x, w), dtype)
    logits = skinny_linear(x, w, out_dtype=torch.float32)
    assert logits.dtype == torch.float32 and torch.equal(logits, out.float())  # rounded once, stored wide


def test_skinny_linear_rows_do_not_interact(fresh_seed: int) -> None:
    """A row's output is the same alone and in a batch (the head of a decode step)."""
    g = gen(fresh_seed)
    x = torch.randn(9, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(130, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    assert torch.equal(skinny_linear(x, w)[3:4], skinny_linear(x[3:4], w))


def test_skinny_linear_rejects_bad_shapes() -> None:
    w = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="at most 64"):
        skinny_linear(torch.randn(65, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        skinny_linear(torch.randn(2, 12, device=DEVICE), w)
    with pytest.raises(ValueError, match="dtype|float"):
        skinny_linear(torch.randn(2, 16, device=DEVICE).to(torch.bfloat16), w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 64), (7, 48)])  # a K tail at 48
def test_skinny_grouped_linear(fresh_seed: int, dtype: torch.dtype, m: int, k: int) -> None:
    """The attention's wo_a (block-diagonal by groups) for a few rows: each group's
    columns read only their own slice of x, as GroupedLinear's bmm."""
    g = gen(fresh_seed)
    groups, rank = 4, 48  # 16-column programs (the interpreter's 32 do not divide 48)
    x = torch.randn(m, groups * k, generator=g).to(dtype).to(DEVICE).view(m, groups, k)  # as o.view(n, G, -1)
    w = (torch.randn(groups * rank, k, generator=g) * k ** -0.5).to(dtype).to(DEVICE)
    out = skinny_grouped_linear(x, w)
    ref = skinny_grouped_linear_ref(x, w)
    assert out.shape == (m, groups * rank) and out.dtype == dtype
    assert_close(out, ref, dtype)
    # a group's columns do not see another group's inputs
    x2 = x.clone()
    x2[:, 1] = 0
    again = skinny_grouped_linear(x2, w)
    assert torch.equal(again[:, :rank], out[:, :rank]) and torch.equal(again[:, 2 * rank:], out[:, 2 * rank:])
    assert not torch.equal(again[:, rank:2 * rank], out[:, rank:2 * rank])


def test_skinny_grouped_linear_rejects_bad_shapes() -> None:
    x = torch.randn(2, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of"):
        skinny_grouped_linear(x, torch.randn(4 * 24, 16, device=DEVICE))  # 24 = 8 x 3: no 16-column programs
    with pytest.raises(ValueError, match=r"\[M, G, K\]"):
        skinny_grouped_linear(x, torch.randn(4 * 32, 12, device=DEVICE))
