"""Helpers shared by the kernel tests (imported after conftest set TRITON_INTERPRET)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)

#: Tolerances per dtype (relative to the tensor norm), as torch.testing uses for outputs
#: that went through that dtype once more than the reference did.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def gen(seed: int) -> torch.Generator:
    """A CPU generator for fresh random inputs."""
    return torch.Generator().manual_seed(seed)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere fails."""
    out, ref = out.detach().double(), ref.detach().double()  # a module output may require grad
    if torch.isnan(out).any():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """Relative-norm check with the dtype's tolerance, plus an elementwise bound of a
    few units in the last place (catches a single wrong element the norm would hide)."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    err = rel_err(out, ref)
    assert err <= REL_TOL[dtype] * scale, f"relative error {err:.3e} > {REL_TOL[dtype] * scale:.1e}"
    eps = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype] * scale
    bound = 4 * eps * ref.double().abs() + 4 * eps * ref.double().abs().mean()
    worst = ((out.double() - ref.double()).abs() - bound).max()
    assert worst <= 0, f"max elementwise excess {float(worst):.3e}"
