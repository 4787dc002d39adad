"""skinny_linear (few rows x wide weight, the decode LM head) vs F.linear."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, assert_close, gen  # noqa: E402

from deepinfer_kernels.skinny_gemm import skinny_linear, skinny_linear_ref  # noqa: E402


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
