"""V4.1's head input kernel (deepinfer_kernels/hc_collapse.py: pending mHC expansion,
collapse with the head's pre, final RMSNorm) vs the model's own ops."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, assert_close, gen  # noqa: E402

from deepinfer_kernels.hc_collapse import hc_collapse_norm, hc_collapse_norm_ref  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("expand,normed", [(False, True), (True, True), (True, False)])
def test_hc_collapse_norm(fresh_seed: int, dtype: torch.dtype, expand: bool, normed: bool) -> None:
    g = gen(fresh_seed)
    t, hc, d = 6, 4, 64
    streams = torch.randn(t, hc, d, generator=g).to(dtype).to(DEVICE)
    pre = torch.rand(t, hc, generator=g).to(DEVICE)
    norm = ((torch.rand(d, generator=g) + 0.5).to(DEVICE), 1e-6) if normed else None
    prev = None
    if expand:
        prev = (torch.randn(t, d, generator=g).to(dtype).to(DEVICE), torch.rand(t, hc, generator=g).to(DEVICE),
                torch.rand(t, hc, hc, generator=g).to(DEVICE))
    out = hc_collapse_norm(streams, pre, norm, prev)
    assert out.dtype == dtype and out.shape == (t, d)
    assert_close(out, hc_collapse_norm_ref(streams, pre, norm, prev), dtype, scale=2.0)
