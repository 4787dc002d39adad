"""In-kernel FP8 / FP4 KV-format rounding (deepinfer_kernels/kv_quant_sim.py) vs the
reference path's deepinfer.models.kv_quant: bitwise equal, including the values where a
rounding could go either way (ties of the e2m1 grid, e4m3 subnormals, tiny blocks)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, gen  # noqa: E402

from deepinfer_kernels.kv_quant_sim import kv_quant_sim, kv_quant_sim_ref  # noqa: E402

CASES = [("fp8", 32), ("fp4", 32), ("fp4_e4m3", 16)]


def _inputs(seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = gen(seed)
    # scales 1e-6 .. 1e2 per row (an FP4 block's e4m3 scale stays inside e4m3's range)
    x = torch.randn(6, 4, 64, generator=g) * torch.logspace(-6, 2, 6)[:, None, None]
    # ties: exact multiples of grid points relative to the block max, and zeros inside a block
    x[0, 0, :8] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x[0, 1, 16:32] = 0.0
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,block", CASES)
def test_kv_quant_sim_bitwise(fresh_seed: int, dtype: torch.dtype, mode: str, block: int) -> None:
    x = _inputs(fresh_seed, dtype)
    out, ref = kv_quant_sim(x, mode, block), kv_quant_sim_ref(x, mode, block)
    assert out.dtype == dtype and not torch.equal(ref, x), "the rounding must change something"
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_kv_quant_sim_leaves_undivided_width(fresh_seed: int) -> None:
    """A width the block does not divide stays as it is (tiny test models), as in the reference."""
    x = torch.randn(3, 16, generator=gen(fresh_seed)).to(DEVICE)
    assert torch.equal(kv_quant_sim(x, "fp8", 32), x) and torch.equal(kv_quant_sim_ref(x, "fp8", 32), x)


def test_kv_quant_sim_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="kv quant mode 'int4'"):
        kv_quant_sim(torch.ones(2, 32, device=DEVICE), "int4", 32)
