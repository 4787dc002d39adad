"""Per-position temperatures for DSpark's confidence head (REFERENCE.md section 8).

The scheduler ranks draft prefixes by the product of their confidences, so what must be
calibrated is the cumulative product: for position k, prod_{i<=k} sigmoid(z_i / T_i)
should match the probability that drafts 1..k all survive. T_1..T_G are fitted in order,
each minimising the expected calibration error (ECE) of the cumulative product at its
position with the earlier temperatures fixed. Survival labels are the expected
acceptances 1 - TV(p_draft, p_target) (lossless verification at temperature 1 accepts a
draft with exactly that probability), multiplied along the block.
"""

from __future__ import annotations

import torch


def expected_calibration_error(pred: torch.Tensor, actual: torch.Tensor, bins: int = 10) -> float:
    """Bin-weighted |mean(pred) - mean(actual)| over equal-width bins of pred in [0, 1]."""
    pred, actual = pred.flatten().double(), actual.flatten().double()
    idx = (pred * bins).long().clamp(0, bins - 1)
    total = pred.new_zeros(())
    for b in range(bins):
        sel = idx == b
        if sel.any():
            total = total + sel.sum() * (pred[sel].mean() - actual[sel].mean()).abs()
    return float(total / max(1, pred.numel()))


def fit_temperatures(conf_logits: torch.Tensor, accept: torch.Tensor, grid: torch.Tensor | None = None
                     ) -> tuple[list[float], list[float], list[float]]:
    """conf_logits, accept: [N, G] (per block, per draft position). Returns (temperatures,
    ECE of the cumulative product before fitting, after fitting), one entry per position."""
    grid = grid if grid is not None else torch.logspace(-1, 1, 81, dtype=torch.float64)
    z, a = conf_logits.double(), accept.double().clamp(0, 1)
    survive = torch.cumprod(a, dim=1)
    temps: list[float] = []
    before: list[float] = []
    after: list[float] = []
    prod_fit = torch.ones(z.shape[0], dtype=torch.float64)
    prod_raw = torch.ones(z.shape[0], dtype=torch.float64)
    for k in range(z.shape[1]):
        prod_raw = prod_raw * torch.sigmoid(z[:, k])
        before.append(expected_calibration_error(prod_raw, survive[:, k]))
        errors = [expected_calibration_error(prod_fit * torch.sigmoid(z[:, k] / t), survive[:, k]) for t in grid]
        best = int(torch.tensor(errors).argmin())
        temps.append(float(grid[best]))
        after.append(errors[best])
        prod_fit = prod_fit * torch.sigmoid(z[:, k] / grid[best])
    return temps, before, after
