"""Speculative decoding counters: acceptance per draft position, mean accepted length,
verify tokens per step, effective tokens per step (what the decode chart multiplies
tok/s per device with)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    proposed: list[int] = field(default_factory=list)  # per draft position j (0-based): drafts verified
    accepted: list[int] = field(default_factory=list)  # ... of which accepted
    steps: int = 0  # steps that verified at least one request
    verify_tokens: int = 0  # target rows scored for sampling (drafts + 1 per request)
    emitted_tokens: int = 0
    requests_verified: int = 0  # (request, step) pairs that sampled
    history: list[dict] = field(default_factory=list)  # per step, for live plots
    # Calibration of the drafter's confidences: per draft position j, bins of the cumulative
    # product c_1 * ... * c_j (the scheduler's survival estimate) with [count, sum of the
    # estimates, prefixes that survived verification].
    calibration_bins: list[list[list[float]]] = field(default_factory=list)
    #: confidences that were not finite numbers in [0, 1] (left out of the bins, with the rest of
    #: their prefix): a drafter fed garbage, which must not take the engine's step down with it
    invalid_confidences: int = 0

    def record(self, num_drafts: list[int], num_accepted: list[int]) -> None:
        if not num_drafts:
            return
        for k, a in zip(num_drafts, num_accepted):
            while len(self.proposed) < k:
                self.proposed.append(0)
                self.accepted.append(0)
            for j in range(k):
                self.proposed[j] += 1
                self.accepted[j] += int(j < a)
        self.steps += 1
        v = sum(k + 1 for k in num_drafts)
        e = sum(a + 1 for a in num_accepted)
        self.verify_tokens += v
        self.emitted_tokens += e
        self.requests_verified += len(num_drafts)
        self.history.append({"requests": len(num_drafts), "verify_tokens": v, "emitted": e})

    def record_confidences(self, confidences: list[list[float]], num_accepted: list[int], bins: int = 10) -> None:
        """Per verified request: the confidences of its drafts and how many were accepted."""
        for conf, a in zip(confidences, num_accepted):
            cum = 1.0
            for j, c in enumerate(conf):
                if not 0.0 <= c <= 1.0:  # NaN included
                    self.invalid_confidences += len(conf) - j
                    break
                while len(self.calibration_bins) <= j:
                    self.calibration_bins.append([[0.0, 0.0, 0.0] for _ in range(bins)])
                cum *= c
                cell = self.calibration_bins[j][min(int(cum * bins), bins - 1)]
                cell[0] += 1
                cell[1] += cum
                cell[2] += float(j < a)

    def calibration(self) -> list[dict]:
        """Per draft position: mean predicted prefix survival, observed survival, and the
        expected calibration error |predicted - observed| weighted over the bins."""
        out = []
        for cells in self.calibration_bins:
            n = sum(c[0] for c in cells)
            if not n:
                out.append({"count": 0, "predicted": float("nan"), "observed": float("nan"), "ece": float("nan")})
                continue
            ece = sum(abs(c[1] - c[2]) for c in cells if c[0]) / n
            out.append({"count": int(n), "predicted": sum(c[1] for c in cells) / n,
                        "observed": sum(c[2] for c in cells) / n, "ece": ece})
        return out

    def acceptance_per_position(self) -> list[float]:
        """P(draft j accepted | it was verified), j = 1..k."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts per verified request-step."""
        return (self.emitted_tokens - self.requests_verified) / max(1, self.requests_verified)

    @property
    def effective_tokens_per_step(self) -> float:
        """Tokens emitted per request per decode step (1 + mean accepted length)."""
        return self.emitted_tokens / max(1, self.requests_verified)

    @property
    def verify_tokens_per_step(self) -> float:
        """Target rows scored per request per step (1 + drafts)."""
        return self.verify_tokens / max(1, self.requests_verified)

    def summary(self) -> dict:
        return {"acceptance_per_position": self.acceptance_per_position(),
                "mean_accepted_length": self.mean_accepted_length,
                "effective_tokens_per_step": self.effective_tokens_per_step,
                "verify_tokens_per_step": self.verify_tokens_per_step,
                "steps": self.steps, "calibration": self.calibration()}

    def reset(self) -> None:
        self.__init__()
