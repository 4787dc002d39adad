"""The engine's record of how well draft confidences predict verification: per draft
position, the cumulative product of confidences against the prefixes that survived."""

from __future__ import annotations

import math
import random

from deepinfer.spec.metrics import SpecMetrics


def test_hand_made_verifications_give_the_expected_bins() -> None:
    m = SpecMetrics()
    m.record_confidences([[0.9, 0.5], [0.9, 0.5, 0.1]], [1, 3])
    cal = m.calibration()
    assert [c["count"] for c in cal] == [2, 2, 1]
    assert math.isclose(cal[0]["predicted"], 0.9) and cal[0]["observed"] == 1.0
    assert math.isclose(cal[1]["predicted"], 0.45) and cal[1]["observed"] == 0.5
    assert math.isclose(cal[1]["ece"], 0.05)  # one bin: |0.45 - 0.5|
    assert math.isclose(cal[2]["predicted"], 0.045) and cal[2]["observed"] == 1.0


def test_calibrated_confidences_have_small_error_and_overconfident_ones_do_not() -> None:
    rng = random.Random(0)
    good, bad = SpecMetrics(), SpecMetrics()
    for _ in range(20000):
        p = [rng.uniform(0.3, 0.99) for _ in range(4)]
        accepted = next((j for j, pj in enumerate(p) if rng.random() >= pj), 4)  # draft j survives w.p. p_j
        good.record_confidences([p], [accepted])
        bad.record_confidences([[min(1.0, 1.3 * x) for x in p]], [accepted])
    assert all(c["ece"] < 0.02 for c in good.calibration())
    assert all(c["ece"] > 0.05 for c in bad.calibration()[1:])


def test_invalid_confidences_are_counted_not_binned():
    """A NaN or out-of-range confidence (a drafter that read garbage) ends its prefix in the
    calibration bins and is counted; the step's metrics never raise (seen once in CI: an MTP
    k=3 draft's later confidences were NaN and the metrics crashed the engine's step)."""
    m = SpecMetrics()
    m.record_confidences([[0.9, float("nan"), 0.5], [0.8, 0.7], [1.5]], [1, 2, 0])
    assert m.invalid_confidences == 2 + 1
    assert sum(c[0] for c in m.calibration_bins[0]) == 2 and sum(c[0] for c in m.calibration_bins[1]) == 1
