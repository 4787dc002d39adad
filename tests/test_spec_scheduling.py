"""Confidence-scheduled verify budget: pure functions over confidences and a step-time curve."""

from __future__ import annotations

import pytest

from deepinfer.engine.kv_cache_manager import HybridKVCacheManager, KVCacheGroupSpec
from deepinfer.engine.outputs import ModelRunnerOutput
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler, SchedulerConfig
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.metrics import SpecMetrics
from deepinfer.spec.scheduling import StepTimeCurve, assign, plan_budget, plan_verify_lengths, split_budget


def flat(t=0.01):
    return StepTimeCurve([1, 1024], [t, t])  # verify rows are free: admit every candidate


def test_free_rows_admit_everything_and_costly_rows_nothing():
    conf = [[0.9, 0.8, 0.1], [0.5, 0.5]]
    assert plan_verify_lengths(conf, flat()) == [3, 2]
    steep = StepTimeCurve([1, 2, 3, 4, 5, 6, 7], [1.0, 10, 20, 30, 40, 50, 60])
    assert plan_verify_lengths(conf, steep) == [0, 0]


def test_admission_is_by_survival_product_across_requests():
    conf = [[0.9, 0.9, 0.9], [0.3, 0.9]]
    # survivals: r0: .9 .81 .729; r1: .3 .27 -> the 3 best are all of r0
    assert assign(conf, 3) == [3, 0]
    assert assign(conf, 4) == [3, 1]
    # each extra row costs 40% of a step
    curve = StepTimeCurve(list(range(1, 10)), [1.0 + 0.4 * (n - 2) if n > 2 else 1.0 for n in range(1, 10)])
    lengths = plan_verify_lengths(conf, curve)
    assert lengths == [1, 0]  # (2 + .9) / 1.4 beats 2 / 1.0 and (2 + .9 + .81) / 1.8


def test_budget_maximises_expected_tokens_per_second():
    conf = [[0.95, 0.9, 0.6, 0.2]]
    curve = StepTimeCurve([1, 2, 3, 4, 5], [1.0, 1.05, 1.1, 1.6, 2.5])
    m = plan_budget(conf, curve)
    best = max(range(5), key=lambda j: (1 + sum([0.95, 0.855, 0.513, 0.1026][:j])) / curve(1 + j))
    assert m == best


def test_async_budget_comes_from_old_confidences_and_split_with_new():
    old = [[0.99] * 4, [0.99] * 4]
    new = [[0.1] * 4, [0.9] * 4]
    lengths = split_budget(old, new, flat())
    assert sum(lengths) == 8 and lengths == [4, 4]
    steep = StepTimeCurve([1, 2, 3, 4], [1.0, 1.0, 1.0, 10.0])  # one extra row is free, more are not
    assert split_budget(old, new, steep) == [0, 1]


def test_curve_lookup_and_profile_json():
    c = StepTimeCurve.from_profile({"rows": [{"batch": 1, "verify_per_request": 2, "step_ms": 10},
                                             {"batch": 2, "verify_per_request": 2, "step_ms": 12},
                                             {"batch": 4, "verify_per_request": 1, "step_ms": 11}]})
    assert c(1) == pytest.approx(0.010) and c(3) == pytest.approx(0.011) and c(4) == pytest.approx(0.011)
    assert c(6) > c(4)


def test_scheduler_verifies_drafts_and_advances_by_accepted_only():
    kv = HybridKVCacheManager([KVCacheGroupSpec("swa", 32)], {"swa": 16}, 16, 4)
    s = Scheduler(SchedulerConfig(4, 64, 64, 16), kv)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    s.add_request(req)
    out = s.schedule()
    s.update(out, ModelRunnerOutput(["r"], [[7]]))
    req.draft_token_ids = [8, 9, 10, 11]  # max_tokens 5, 1 out: at most 3 drafts (+1 bonus)
    out = s.schedule()
    sr = out.scheduled[0]
    assert sr.num_draft_tokens == 3 and sr.token_ids == [7, 8, 9, 10] and sr.needs_sample
    assert req.draft_token_ids == []
    s.update(out, ModelRunnerOutput(["r"], [[8, 42]]))  # 1 accepted + resampled
    assert req.num_computed_tokens == 5 and req.output_token_ids == [7, 8, 42]
    out = s.schedule()
    assert out.scheduled[0].token_ids == [42] and out.scheduled[0].num_draft_tokens == 0


def test_metrics():
    m = SpecMetrics()
    m.record([3, 3], [3, 1])
    m.record([3], [0])
    assert m.acceptance_per_position() == [2 / 3, 1 / 3, 1 / 3]
    assert m.effective_tokens_per_step == pytest.approx((4 + 2 + 1) / 3)
    assert m.verify_tokens_per_step == 4.0
