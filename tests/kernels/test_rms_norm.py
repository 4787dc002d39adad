"""rms_norm kernel vs the model's RMSNorm (interpreter on CPU, tiny shapes)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, assert_close, gen  # noqa: E402

from deepinfer_kernels.rms_norm import rms_norm, rms_norm_ref  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(5, 64), (3, 2, 96), (1, 512)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm(fresh_seed: int, dtype: torch.dtype, shape: tuple[int, ...], weighted: bool) -> None:
    g = gen(fresh_seed)
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype).to(DEVICE)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(DEVICE) if weighted else None
    out = rms_norm(x, w, 1e-6)
    ref = rms_norm_ref(x, w, 1e-6)
    assert out.dtype == ref.dtype == dtype
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_residual(fresh_seed: int, dtype: torch.dtype) -> None:
    g = gen(fresh_seed)
    x = torch.randn(7, 128, generator=g).to(dtype).to(DEVICE)
    res = torch.randn(7, 128, generator=g).to(dtype).to(DEVICE)
    w = (torch.rand(128, generator=g) + 0.5).to(DEVICE)
    out, h = rms_norm(x, w, 1e-6, residual=res)
    ref, h_ref = rms_norm_ref(x, w, 1e-6, residual=res)
    assert torch.equal(h, h_ref), "residual sum must round exactly like torch"
    assert_close(out, ref, dtype)


def test_rms_norm_strided_rows(fresh_seed: int) -> None:
    """A row-strided view (e.g. a slice of a wider projection) is read in place."""
    g = gen(fresh_seed)
    wide = torch.randn(6, 200, generator=g).to(torch.bfloat16).to(DEVICE)
    x = wide[:, 8:136]
    w = (torch.rand(128, generator=g) + 0.5).to(DEVICE)
    assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), torch.bfloat16)
