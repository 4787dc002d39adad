"""Helpers of the batch-invariance tests: the bitwise row check and random inputs."""

from __future__ import annotations

from collections.abc import Callable

import torch

SIZES = [1, 2, 3, 7, 16, 64, 256]
Rows = tuple[torch.Tensor, ...]


def assert_row_invariant(fn: Callable[..., object], make: Callable[[int], Rows], sizes: list[int] = SIZES,
                         targets: int = 3) -> None:
    """fn(*rows) -> tensor or tuple of tensors, each with one result row per input row.
    A target row's result computed alone must equal, bitwise, its result at the first /
    middle / last position of batches of every size in ``sizes`` with fresh random
    companions. Several target rows: a variance often shows for only some inputs."""
    def flat(out: object) -> list[torch.Tensor]:
        return list(out) if isinstance(out, (tuple, list)) else [out]  # type: ignore[arg-type]

    for _ in range(targets):
        target = make(1)
        ref = flat(fn(*target))
        for n in sizes:
            for pos in sorted({0, n // 2, n - 1}):
                batch = make(n)
                for t, b in zip(target, batch):
                    b[pos] = t[0]
                got = flat(fn(*batch))
                for i, (g, r) in enumerate(zip(got, ref)):
                    assert torch.equal(g[pos:pos + 1], r), f"output {i}: row at {pos} of {n} differs from alone"


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


#: Relative-norm tolerance of a result that went through the dtype once more than its reference.
REL_TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """||out - ref|| / ||ref|| within the dtype's tolerance (float64 norms; NaN fails)."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    o, r = out.detach().double(), ref.detach().double()
    assert not torch.isnan(o).any(), "NaN in the result"
    err = float((o - r).norm() / r.norm().clamp_min(1e-30))
    assert err <= REL_TOL[dtype], f"relative error {err:.3e} > {REL_TOL[dtype]:.1e}"
