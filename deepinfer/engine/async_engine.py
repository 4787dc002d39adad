"""Async scheduling: plan step N+1 while step N runs (vLLM v1's idea, a thin layer).

Three pieces, none of which forks the synchronous scheduler or runner:

* :class:`AsyncScheduler` wraps :class:`~deepinfer.engine.scheduler.Scheduler`. After
  ``schedule()`` it advances ``num_computed_tokens`` of every scheduled request at once
  and counts one ``num_output_placeholders`` per request that samples, so the next
  ``schedule()`` feeds the not-yet-known token (``PLACEHOLDER_TOKEN_ID``) and samples the
  one after it. ``update(N)`` (applied after step N+1 was planned) rewinds the in-flight
  counts, lets the base ``update`` append the real tokens and run stop checks, then puts
  step N+1's counts back. A request finished at step N has its step-N+1 work discarded
  (the base update skips unknown requests; its blocks were freed at the finish). A
  request preempted while its step was in flight keeps its token: it is appended here.
* :class:`AsyncRunner` wraps a :class:`~deepinfer.engine.model_runner.ModelRunner`: a
  device tensor ``last_tokens[state_slot]`` receives every sampled token on the device,
  and the next step's placeholder input ids are gathered from it on the device (no host
  round trip). Steps run in order in one worker thread, which returns a future whose
  ``result()`` is the ``ModelRunnerOutput``; the main thread schedules, applies updates
  and detokenizes meanwhile (torch releases the GIL inside ops). ``debug=True`` poisons
  consumed slots with -1 and asserts on the device that no placeholder survives a gather.
* :class:`AsyncStepLoop` is the engine loop: schedule N+1 -> submit N+1 -> wait N ->
  update N -> stop strings / detokenize N.

Fallbacks (hooks for the next issues): a step whose in-flight predecessor holds a request
with structured output is scheduled synchronously (its grammar mask needs the previous
token; ``StructuredOutputManager.advance`` only ever sees real tokens); with speculative
decoding the engine keeps the synchronous loop (``LLM`` does not build this loop).
Placeholders never reach logits processors, penalties or matchers: those read
``output_token_ids`` / ``all_token_ids``, which only ever hold real tokens.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from deepinfer.engine.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.engine.request import PLACEHOLDER_TOKEN_ID, Request, RequestStatus
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.stop import check_stop
from deepinfer.profiling.markers import SCHEDULE, UPDATE, phase

if TYPE_CHECKING:
    from deepinfer.engine.model_runner import ModelRunner
    from deepinfer.llm import LLM

__all__ = ["AsyncScheduler", "AsyncRunner", "AsyncStepLoop"]


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
            if s.needs_sample:
                req.num_output_placeholders += 1
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
                    req.num_output_placeholders -= 1
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


class AsyncRunner:
    """Runs steps of ``runner`` in order in one worker thread; keeps last sampled tokens
    on the device, indexed by state slot, and fills placeholder input ids from them."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int, debug: bool = False) -> None:
        self.runner, self.debug = runner, debug
        self.last_tokens = torch.full((max_num_seqs,), PLACEHOLDER_TOKEN_ID, dtype=torch.long,
                                      device=runner.device)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-step")
        self._step: SchedulerOutput | None = None  # the step the worker is running
        self._gathered = self._sampled = False  # the hooks ran for self._step
        self._build_batch, self._sample = runner.build_batch, runner.sampler.sample
        runner.build_batch = self._build_batch_hook  # type: ignore[method-assign]
        runner.sampler.sample = self._sample_hook  # type: ignore[method-assign]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.runner.build_batch = self._build_batch  # type: ignore[method-assign]
        self.runner.sampler.sample = self._sample  # type: ignore[method-assign]

    def submit(self, so: SchedulerOutput, grammar: Any = None) -> Future[ModelRunnerOutput]:
        """Run ``so`` after every earlier step (an empty one too: it carries preempted /
        finished ids for runners that keep per-request state)."""
        return self._pool.submit(self._run, so, grammar)

    def _run(self, so: SchedulerOutput, grammar: Any) -> ModelRunnerOutput:
        self._step, self._gathered, self._sampled = so, False, False
        try:
            out = self.runner.execute(so, grammar=grammar)
        finally:
            self._step = None
        # A runner that bypasses build_batch / sampler.sample would feed -1 ids or leave
        # stale last tokens: fail loudly instead (a cheap host check on the plan).
        if not self._gathered and any(PLACEHOLDER_TOKEN_ID in r.token_ids for r in so.scheduled):
            raise RuntimeError("async scheduling: the runner did not build inputs through build_batch, "
                               "so placeholder input ids were not gathered")
        if not self._sampled and any(r.needs_sample for r in so.scheduled):
            raise RuntimeError("async scheduling: the runner did not sample through sampler.sample, "
                               "so the device buffer of last tokens was not updated")
        return out

    # ---- hooks the runner calls inside execute (worker thread) -------------------------
    def _build_batch_hook(self, so: SchedulerOutput):
        batch = self._build_batch(so)
        self._gathered = True
        rows: list[int] = []
        slots: list[int] = []
        offset = 0
        for r in so.scheduled:
            for j, tok in enumerate(r.token_ids):
                if tok == PLACEHOLDER_TOKEN_ID:
                    rows.append(offset + j)
                    slots.append(r.state_slot)
            offset += r.num_tokens
        if rows:  # gather on the device: step N's samples never visit the host here
            dev = batch.input_ids.device
            rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
            slots_t = torch.tensor(slots, dtype=torch.long, device=dev)
            batch.input_ids[rows_t] = self.last_tokens[slots_t]
            if self.debug:  # a slot is read once; a second read (wrong gather) sees -1
                self.last_tokens[slots_t] = PLACEHOLDER_TOKEN_ID
        if self.debug:
            torch._assert_async((batch.input_ids >= 0).all(), "async scheduling: unfilled placeholder input id")
        return batch

    def _sample_hook(self, logits: torch.Tensor, params: Any):
        out = self._sample(logits, params)
        so = self._step
        if so is not None:
            slots = [r.state_slot for r in so.scheduled if r.needs_sample]
            if len(slots) == out.token_ids.shape[0]:
                idx = torch.tensor(slots, dtype=torch.long, device=self.last_tokens.device)
                self.last_tokens[idx] = out.token_ids.to(self.last_tokens.device, non_blocking=True)
                self._sampled = True
        return out


class AsyncStepLoop:
    """``LLM.step`` in async mode: at most one step in flight between calls."""

    def __init__(self, llm: LLM, debug: bool = False) -> None:
        self.llm = llm
        self.scheduler = AsyncScheduler(llm.scheduler)
        self.runner = AsyncRunner(llm.runner, llm.config.max_num_seqs, debug=debug)
        self._pending: tuple[SchedulerOutput, Any, float] | None = None
        #: steps scheduled synchronously because a constrained request was in flight
        self.num_sync_fallbacks = 0
        #: host seconds spent blocked on step results (the rest of a step is host work)
        self.wait_s = 0.0

    @property
    def busy(self) -> bool:
        return self._pending is not None

    def _needs_sync(self) -> bool:
        """Structured output fallback: a constrained request's next mask needs its token."""
        if self._pending is None:
            return False
        grammars = self.llm.structured.grammars
        return any(s.req_id in grammars for s in self._pending[0].scheduled)

    def step(self, detoks: dict, bar: Any = None) -> None:
        llm = self.llm
        t_start = time.perf_counter()
        llm.structured.admit_ready(llm.scheduler)
        if self._needs_sync():
            self.num_sync_fallbacks += 1
            self._apply(detoks, bar)
        with phase(SCHEDULE):
            so = self.scheduler.schedule()
        prev = self._pending
        fut = self.runner.submit(so, grammar=llm.structured.batch(so))
        if so.is_empty:  # nothing new runs: just land the step in flight
            fut.result()
            self._pending = None
        else:
            self._pending = (so, fut, t_start)
        if prev is not None:
            self._apply(detoks, bar, prev)
        if so.is_empty:
            self.scheduler.inflight = None

    def _apply(self, detoks: dict, bar: Any, item: tuple | None = None) -> None:
        if item is None:
            item, self._pending = self._pending, None
        so, fut, t_start = item
        t_wait = time.perf_counter()
        out = fut.result()
        self.wait_s += time.perf_counter() - t_wait
        with phase(UPDATE):
            touched = self.scheduler.update(so, out)
        self.llm._after_update(touched, detoks, bar)
        self.llm.metrics.record_step(so, touched, t_start)

    def discard(self) -> None:
        """Wait for the step in flight and drop its results (abort path)."""
        item, self._pending = self._pending, None
        self.scheduler.inflight = None
        if item is not None:
            try:
                item[1].result()
            except BaseException:
                pass
