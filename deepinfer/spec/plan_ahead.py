"""Async scheduling of speculative steps: plan step N+1 before step N lands.

A greedy-lane verify step N that drafted behind its verify graph (`LaneInFlight` with
``device_drafts``) leaves on the device, per state slot, everything step N+1 feeds: the
bonus token, the k next drafts and the accepted count (`DeviceTokenBuffer.record_verify`).
So N+1 can be planned and launched while N still runs, as a plain decode step is:

* the scheduler's accounting is optimistic (`AsyncScheduler`: N counts ``1 + drafts``
  output placeholders and all its rows as computed), so N+1's plan feeds each request
  ``1 + n`` placeholders at the position every accepted draft would give (n = k, or under
  confidence-scheduled verification the count `SpecDecoder.planned_ahead_lengths` gives);
* on the device the placeholders are gathered and the positions shifted by
  ``accepted - drafts`` (`DeviceTokenBuffer.fill`, ``ForwardBatch.position_shift``); the
  verify graph and the drafter's passes run at the true positions;
* when N lands, `AsyncScheduler.update` rewinds the optimistic counts and re-applies the
  true ones; the block tables were allocated for the optimistic (largest) positions.

A plan is made ahead only when nothing else can join it (no waiting request, no grammar)
and is launched ahead only when every request of it takes the same device path again
(`SpeculativePlanner.device_step_ok`); otherwise N lands first and the plan's
placeholders are replaced with N's real tokens and positions (`resolve`), so any path can
run it. Verification stays exact: a plan made ahead verifies the same drafts, at the same
positions, as the synchronous loop.
"""

from __future__ import annotations

from typing import Any

from deepinfer import batch_invariant
from deepinfer.engine.outputs import SchedulerOutput
from deepinfer.engine.request import PLACEHOLDER_TOKEN_ID, RequestStatus

from .runner import LaneInFlight, SpecDecoder

__all__ = ["SpeculativePlanner"]


class SpeculativePlanner:
    """The async loop's speculative side: whether the next step can be planned ahead of the
    one in flight, and what a plan made ahead needs before and after."""

    def __init__(self, spec: SpecDecoder, runner: Any, scheduler: Any, structured: Any) -> None:
        self.spec, self.runner, self.scheduler, self.structured = spec, runner, scheduler, structured
        #: steps planned ahead / of those, launched only after the previous one landed
        self.stats = {"planned_ahead": 0, "resolved": 0}

    def can_plan_after(self, in_flight: Any) -> bool:
        """Whether the step after ``in_flight`` (the runner's `LaunchedStep`) may be planned
        before it lands: its drafts are on the device, and nothing can join the next plan
        (a waiting request would bring a prefill, a grammar would need the host's tokens)."""
        lane = getattr(in_flight, "spec", None)
        return (isinstance(lane, LaneInFlight) and lane.device_drafts and not self.scheduler.waiting
                and not self.structured.grammars and not self.structured.has_pending())

    def mark(self, so: SchedulerOutput) -> None:
        """Before planning ahead of ``so``: its running requests' drafts are on the device."""
        running = [req for s in so.scheduled if (req := self.scheduler.requests.get(s.req_id)) is not None
                   and req.status == RequestStatus.RUNNING]
        for req, n in zip(running, self.spec.planned_ahead_lengths([r.req_id for r in running])):
            req.draft_token_ids, req.draft_confidences = [PLACEHOLDER_TOKEN_ID] * n, []
        self.stats["planned_ahead"] += 1

    def device_step_ok(self, so: SchedulerOutput) -> bool:
        """Whether ``so`` (planned ahead) runs the greedy lane and drafts behind its verify
        graph: the only path that reads its placeholders and shifted positions on the device.
        The same conditions as `SpecDecoder._execute`'s lane and the drafter's own."""
        runner, spec = self.runner, self.spec
        if not so.scheduled:
            return True
        # (bounded replay's cut is checked at host positions, which a shift lowers: not planned ahead)
        if (runner.token_buffer is None or spec.rule != "standard" or batch_invariant.enabled()
                or runner.batch_invariant or (runner.replay is not None and runner.replay.active)):
            return False
        if not all(r.needs_sample and not r.is_new and r.num_tokens == r.num_draft_tokens + 1
                   and r.sampling_params.is_greedy and not r.sampling_params.top_logprobs
                   and r.req_id not in self.structured.grammars for r in so.scheduled):
            return False
        verify = spec.verify_executor(runner)
        return (verify is not None and verify.takes_greedy_lane(so)
                and spec.drafter.can_draft_after_verify(so))

    def resolve(self, so: SchedulerOutput) -> None:
        """``so`` was planned ahead of a step that has now landed: feed its requests their
        real tokens (the bonus token, the drafts the device holds) at their real positions,
        and drop the requests that step finished. Any path can then run it."""
        keep = []
        for s in so.scheduled:
            if PLACEHOLDER_TOKEN_ID not in s.token_ids:
                keep.append(s)
                continue
            req = self.scheduler.requests.get(s.req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                so.num_batched_tokens -= s.num_tokens
                continue
            drafts = self.spec.device_drafts.pop(s.req_id).tokens[:s.num_draft_tokens]
            s.token_ids = [req.all_token_ids[-1]] + list(drafts)
            s.start_pos = req.num_tokens - 1
            s.output_len = req.num_output_tokens
            keep.append(s)
        so.scheduled = keep
        self.stats["resolved"] += 1
