"""Async scheduling, host side: the synchronous scheduler plus in-flight bookkeeping.

:class:`AsyncScheduler` wraps :class:`~deepinfer.engine.scheduler.Scheduler` (no fork).
After ``schedule()`` it advances ``num_computed_tokens`` of every scheduled request at
once and counts one ``num_output_placeholders`` per request that samples (``1 + drafts`` for a
speculative step: every draft accepted, the optimistic count a plan made ahead of it
uses, deepinfer/spec/plan_ahead.py), so the next ``schedule()`` feeds the not-yet-known
token (``PLACEHOLDER_TOKEN_ID``) and samples the one after it. ``update(N)`` (applied after step N+1 was planned) rewinds the in-flight
counts, lets the base ``update`` append the real tokens and run stop checks, then puts
step N+1's counts back. A request finished at step N has its step-N+1 work discarded
(the base update skips unknown requests; its blocks were freed at the finish). A request
preempted while its step was in flight keeps its token: it is appended here.

Placeholders never enter ``all_token_ids`` / ``output_token_ids``: stop checks, the
detokenizer and grammar matchers only ever see real tokens.
"""

from __future__ import annotations

import time
from typing import Any

from deepinfer.engine.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.stop import check_stop

__all__ = ["AsyncScheduler"]


class AsyncScheduler:
    """The synchronous scheduler plus in-flight bookkeeping; at most one step in flight
    when ``schedule()`` is called (the loop applies step N before planning N+2)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.base = scheduler
        self.inflight: SchedulerOutput | None = None  # the newest scheduled, not yet updated step

    def __getattr__(self, name: str) -> Any:  # requests, running, waiting, kv, finish_request, ...
        return getattr(self.base, name)

    def schedule(self) -> SchedulerOutput:
        # Invariant on return: for every scheduled request, num_computed_tokens already counts
        # this step's tokens and num_output_placeholders this step's sample; a request
        # preempted now has no placeholders (its in-flight token is appended by update()).
        out = self.base.schedule()
        for rid in out.preempted_req_ids:
            self.base.requests[rid].num_output_placeholders = 0
        for s in out.scheduled:
            req = self.base.requests[s.req_id]
            req.num_computed_tokens += s.num_tokens
            if s.needs_sample:  # speculative: optimistic, every draft accepted plus the bonus
                req.num_output_placeholders += 1 + s.num_draft_tokens
        self.inflight = out
        return out

    def update(self, so: SchedulerOutput, ro: ModelRunnerOutput) -> list[Request]:
        """Apply step ``so``'s results while ``self.inflight`` (a later step, or ``so``
        itself) may still run; return the requests with new tokens or that finished."""
        later = {s.req_id: s for s in self.inflight.scheduled} if self.inflight is not so and self.inflight else {}
        index = {rid: k for k, rid in enumerate(ro.req_ids)}
        rewound: list[Request] = []
        touched: list[Request] = []
        for s in so.scheduled:
            req = self.base.requests.get(s.req_id)
            if req is None:
                continue  # finished / aborted after being scheduled: its tokens are dropped
            if req.status == RequestStatus.RUNNING:
                nxt = later.get(s.req_id)
                req.num_computed_tokens -= s.num_tokens + (nxt.num_tokens if nxt is not None else 0)
                if s.needs_sample:
                    req.num_output_placeholders -= 1 + s.num_draft_tokens
                rewound.append(req)
            elif s.needs_sample and (k := index.get(s.req_id)) is not None:
                touched.extend(self._append_preempted(req, ro, k))
        touched += self.base.update(so, ro)
        for req in rewound:
            if req.status == RequestStatus.RUNNING and (nxt := later.get(req.req_id)) is not None:
                req.num_computed_tokens += nxt.num_tokens
            assert req.is_finished or req.num_output_placeholders >= 0
        if self.inflight is so:
            self.inflight = None
        return touched

    def _append_preempted(self, req: Request, ro: ModelRunnerOutput, k: int) -> list[Request]:
        """A request preempted while its sampling step ran: keep its token (recompute
        later covers it), with the same stop checks as ``Scheduler.update``."""
        tokens = ro.sampled_token_ids[k]
        lps = ro.logprobs[k] if ro.logprobs is not None else None
        tops = ro.top_logprobs[k] if ro.top_logprobs is not None else None
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        for j, tok in enumerate(tokens):
            req.append_output_token(tok, lps[j] if lps else None, tops[j] if tops else None)
            stop = check_stop(req, self.base.config.max_model_len)
            if stop is not None:
                req.stop_reason = stop[1]
                self.base.waiting.remove(req)
                self.base._finish(req, stop[0])
                break
        return [req]
