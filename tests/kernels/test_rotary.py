"""rotary kernel vs the model's apply_rope / Rotary.cos_sin (interpreter on CPU)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, assert_close, gen  # noqa: E402

from deepinfer.models.rope import Rotary  # noqa: E402
from deepinfer_kernels.rotary import rotary, rotary_ref  # noqa: E402

YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
        "beta_fast": 32, "beta_slow": 1}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(6, 4, 64), (5, 48), (3, 2, 3, 32)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rotary_tables(fresh_seed: int, dtype: torch.dtype, shape: tuple[int, ...], inverse: bool) -> None:
    g = gen(fresh_seed)
    rope = Rotary(16, 10000.0)
    pos = torch.randint(0, 5000, (shape[0],), generator=g)
    cos, sin = rope.cos_sin(pos, dtype)
    x = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    out = rotary(x, cos, sin, inverse=inverse)
    ref = rotary_ref(x, cos, sin, inverse=inverse)
    assert_close(out, ref, dtype)
    nope = shape[-1] - 16
    assert torch.equal(out[..., :nope], x[..., :nope])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaling", [None, YARN])
def test_rotary_positions_inplace(fresh_seed: int, dtype: torch.dtype, scaling: dict | None) -> None:
    """cos/sin computed in the kernel from positions (rounded through x's dtype)."""
    g = gen(fresh_seed)
    rope = Rotary(32, 160000.0 if scaling else 10000.0, scaling)
    pos = torch.randint(0, 100_000, (9,), generator=g).to(DEVICE)
    x = torch.randn(9, 3, 64, generator=g).to(dtype).to(DEVICE)
    ref = rotary_ref(x.clone(), positions=pos, inv_freq=rope.inv_freq)
    y = x.clone()
    out = rotary(y, positions=pos, inv_freq=rope.inv_freq, inplace=True)
    assert out.data_ptr() == y.data_ptr()
    assert_close(y, ref, dtype)
    # round trip: rotating back restores x to rounding error
    back = rotary(y, positions=pos, inv_freq=rope.inv_freq, inverse=True)
    assert_close(back, x, dtype, scale=2.0)


def test_rotary_strided_heads(fresh_seed: int) -> None:
    """A head-strided view (q heads inside a wider buffer) is rotated in place."""
    g = gen(fresh_seed)
    rope = Rotary(16, 10000.0)
    pos = torch.arange(4)
    cos, sin = (t.to(DEVICE) for t in rope.cos_sin(pos, torch.bfloat16))
    buf = torch.randn(4, 3, 80, generator=g).to(torch.bfloat16).to(DEVICE)
    view = buf[:, :, 8:72]
    ref = rotary_ref(view.clone(), cos, sin)
    rotary(view, cos, sin, inplace=True)
    assert_close(buf[:, :, 8:72], ref, torch.bfloat16)
