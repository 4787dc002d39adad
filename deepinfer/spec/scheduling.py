"""Confidence-scheduled verification (DSpark's hardware-aware prefix scheduler).

Every request verifies at least its bonus row. A candidate is a (request, prefix length
j) pair whose survival probability is the product of the request's first j draft
confidences. Candidates of all requests are sorted by survival (ties: shorter prefix
first, so admission stays prefix-closed) and admitted greedily; the admitted count m is
the argmax over prefixes of expected tokens / step time, with expected tokens =
R + sum of admitted survivals and step time T(R + m) from a profiled curve
(`benchmarks/spec_step_curve.py` writes it). Pure functions: unit-tested on CPU.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass


@dataclass
class StepTimeCurve:
    """Decode step time (seconds) as a function of verify tokens in the step."""

    tokens: list[int]
    seconds: list[float]
    sampler_seconds: float = 0.0

    def __post_init__(self) -> None:
        pairs = sorted(zip(self.tokens, self.seconds))
        self.tokens, self.seconds = [p[0] for p in pairs], [p[1] for p in pairs]
        if not self.tokens:
            raise ValueError("a step-time curve needs at least one point")

    def __call__(self, num_tokens: int) -> float:
        """Time of the smallest measured size >= num_tokens (a captured graph is padded up to
        it); beyond the largest, linear extrapolation from the last two points."""
        i = bisect.bisect_left(self.tokens, num_tokens)
        if i < len(self.tokens):
            return self.seconds[i] + self.sampler_seconds
        if len(self.tokens) == 1:
            return self.seconds[0] * num_tokens / self.tokens[0] + self.sampler_seconds
        (t0, s0), (t1, s1) = (self.tokens[-2], self.seconds[-2]), (self.tokens[-1], self.seconds[-1])
        return s1 + (s1 - s0) / (t1 - t0) * (num_tokens - t1) + self.sampler_seconds

    @classmethod
    def default(cls) -> "StepTimeCurve":
        """A memory-bound-decode shape (flat, then linear) for when nothing was profiled."""
        toks = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
        return cls(toks, [0.010 + 0.00002 * max(0, t - 64) for t in toks])

    @classmethod
    def from_profile(cls, path_or_dict) -> "StepTimeCurve":
        """From the JSON `benchmarks/spec_step_curve.py` writes: rows with `batch`,
        `verify_per_request` and `step_ms`; x = batch * verify_per_request."""
        data = path_or_dict
        if not isinstance(data, dict):
            with open(path_or_dict) as f:
                data = json.load(f)
        best: dict[int, float] = {}
        for row in data["rows"]:
            x = int(row["batch"]) * int(row["verify_per_request"])
            best[x] = min(best.get(x, float("inf")), float(row["step_ms"]) / 1e3)
        return cls(list(best), list(best.values()))


def _candidates(confidences: list[list[float]]) -> list[tuple[float, int, int]]:
    out = []
    for i, conf in enumerate(confidences):
        surv = 1.0
        for j, c in enumerate(conf):
            surv *= min(1.0, max(0.0, float(c)))
            out.append((surv, j, i))
    out.sort(key=lambda t: (-t[0], t[1], t[2]))
    return out


def plan_budget(confidences: list[list[float]], curve, num_other_rows: int = 0) -> int:
    """Number of extra verify rows m (beyond one per request) maximising expected tokens
    per second. ``num_other_rows``: rows of the step that are not verification (prefill)."""
    cands = _candidates(confidences)
    R = len(confidences)
    base = R + num_other_rows
    best_m, best, expected = 0, R / curve(max(1, base)), float(R)
    for m, (surv, _, _) in enumerate(cands, start=1):
        expected += surv
        thr = expected / curve(base + m)
        if thr > best:
            best_m, best = m, thr
    return best_m


def assign(confidences: list[list[float]], budget: int) -> list[int]:
    """Draft lengths per request: the ``budget`` most probable prefixes across requests."""
    lengths = [0] * len(confidences)
    for surv, j, i in _candidates(confidences)[: max(0, budget)]:
        lengths[i] = max(lengths[i], j + 1)
    return lengths


def plan_verify_lengths(confidences: list[list[float]], curve, num_other_rows: int = 0) -> list[int]:
    """Synchronous scheduling: budget and assignment from the same (newest) confidences."""
    return assign(confidences, plan_budget(confidences, curve, num_other_rows))


def split_budget(old_confidences: list[list[float]], new_confidences: list[list[float]], curve,
                 num_other_rows: int = 0) -> list[int]:
    """Async scheduling: step N+1 is planned while step N runs, so the total budget comes
    from confidences two steps back (``old``) and is split with the newest ones."""
    return assign(new_confidences, plan_budget(old_confidences, curve, num_other_rows))
