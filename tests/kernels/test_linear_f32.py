"""Float32 linear kernel (deepinfer_kernels/linear_f32.py: V4.1's router logits and
ratio-2 compressor projections) vs ``F.linear(x.float(), w) / div`` on fresh random inputs."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, assert_close, gen  # noqa: E402

from deepinfer_kernels.linear_f32 import linear_f32, linear_f32_ref  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,cols,div", [(1, 64, 1.0), (13, 40, 0.7), (3, 300, 1.0)])
def test_linear_f32(fresh_seed: int, dtype: torch.dtype, rows: int, cols: int, div: float) -> None:
    g = gen(fresh_seed)
    x = torch.randn(rows, 96, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(cols, 96, generator=g) * 0.1).to(DEVICE)
    out = linear_f32(x, w, div)
    assert out.dtype == torch.float32 and out.shape == (rows, cols)
    assert_close(out, linear_f32_ref(x, w, div), torch.float32)


def test_linear_f32_needs_float32_weight() -> None:
    with pytest.raises(ValueError, match="float32 w"):
        linear_f32(torch.ones(2, 8, device=DEVICE), torch.ones(4, 8, dtype=torch.bfloat16, device=DEVICE))
