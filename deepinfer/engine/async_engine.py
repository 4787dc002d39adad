"""Async scheduling: plan and launch step N+1 before step N's results reach the host.

The default engine loop (``EngineConfig.async_scheduling``, on unless turned off). It is a
thin layer over the synchronous pieces:

* :class:`~deepinfer.engine.async_scheduler.AsyncScheduler` plans N+1 with placeholders
  for the tokens N is still sampling (the synchronous scheduler underneath);
* :class:`~deepinfer.engine.token_buffer.DeviceTokenBuffer` keeps the last sampled
  token per state slot on the device and fills the placeholders there;
* the runner's launch / sample / collect split (deepinfer/engine/model_runner.py) with
  results copied to pinned host memory on a side stream (deepinfer/engine/transfer.py).

One :meth:`AsyncStepLoop.step`, all on the calling thread::

    schedule N+1 -> launch N+1 -> [collect + update N] -> sample N+1 -> collect + update N
                                   (only when N+1's grammar mask needs N's token)

On a GPU every call before the collect only enqueues device work, so the device runs
N+1 right after N while the host updates N, detokenises, checks stop strings and plans
N+2. On CPU the device is the calling thread: the same order, no overlap, and torch
profiler traces hold every op (nothing runs on another thread).

Compositions:

* Structured output: N+1's forward is launched before N's token reaches the grammar;
  only N+1's sampling waits for N (collect, update, matcher advance, host bitmask fill),
  counted in ``stats.grammar_waits``. Matchers only ever see real tokens: they read
  ``output_token_ids`` after ``update``.
* Speculative decoding: N+1's drafts come from N's verification. A greedy-lane step
  that drafted behind its verify graph (MTP, graphed DSpark: `Drafter.draft_after_verify`)
  records its bonus token, next drafts and accepted count per state slot on the device,
  so N+1 is planned with ``1 + k`` placeholders at optimistic positions and launched
  before N lands; the device gathers its ids and shifts its positions
  (deepinfer/spec/plan_ahead.py). Any other step first lands the step in flight
  (``stats.speculative_syncs``): sampled or constrained requests, a queue of waiting
  requests. The confidence-scheduled budget comes from the previous plan's confidences,
  split with the newest the host has (``SpecDecoder.attach``; a plan made ahead:
  ``SpecDecoder.planned_ahead_lengths``, one block older): the rule DeepInfer's async
  scheduler uses (REFERENCE.md sections 3 and 8), and one that keeps verification lossless.
* The GPU fast path reads decode input ids from the device batch (already gathered), so
  it composes as is. Data-parallel / expert-parallel ranks keep the synchronous loop
  (``EngineCore.async_fallback`` says why).

Grammar advance, detokenization and stop strings after each update are the core's
(``EngineCore.process_outputs``); :meth:`AsyncStepLoop.step` returns their deltas.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from deepinfer.engine.async_scheduler import AsyncScheduler
from deepinfer.engine.model_runner import LaunchedStep
from deepinfer.engine.outputs import SchedulerOutput
from deepinfer.engine.request import PLACEHOLDER_TOKEN_ID
from deepinfer.engine.token_buffer import DeviceTokenBuffer
from deepinfer.profiling.markers import SCHEDULE, UPDATE, phase

# `core` is a deepinfer.engine.core.EngineCore; not imported, not even for type checking: the core builds
# this module's objects, and an import back would close an import cycle (tests/test_import_cycles.py)

__all__ = ["AsyncScheduler", "AsyncStats", "AsyncStepLoop", "DeviceTokenBuffer"]


@dataclass
class AsyncStats:
    """Counters of the async loop (``llm.async_loop.stats``)."""

    steps: int = 0  # steps scheduled
    overlapped: int = 0  # steps launched while the previous one was still in flight
    speculative_syncs: int = 0  # steps planned only after landing the previous one (drafts)
    grammar_waits: int = 0  # steps whose sampling (not forward) waited for the previous step's tokens
    wait_s: float = 0.0  # host seconds blocked on step results

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))


@dataclass
class _InFlight:
    so: SchedulerOutput
    step: LaunchedStep
    t_start: float


class AsyncStepLoop:
    """``EngineCore.step`` in async mode: at most one step in flight between calls."""

    def __init__(self, core: Any, debug: bool = False) -> None:
        self.core = core
        self.scheduler = AsyncScheduler(core.scheduler)
        spec = core.runner.spec
        self.tokens = DeviceTokenBuffer(core.config.max_num_seqs, core.runner.device, debug=debug,
                                        width=1 + core.config.num_speculative_tokens,
                                        storage=spec.token_storage if spec is not None else None)
        core.runner.token_buffer = self.tokens
        self.spec = core.runner.spec
        self.planner = None  # speculative steps planned ahead (deepinfer/spec/plan_ahead.py)
        if self.spec is not None:
            from deepinfer.spec.plan_ahead import SpeculativePlanner
            self.planner = SpeculativePlanner(self.spec, core.runner, core.scheduler, core.structured)
        self.stats = AsyncStats()
        self._pending: _InFlight | None = None
        self._records: list[tuple[SchedulerOutput, list, float]] = []  # applied, for metrics at step end
        self._deltas: list = []  # StreamDeltas of the steps applied during one step() call

    @property
    def busy(self) -> bool:
        return self._pending is not None

    @property
    def num_sync_fallbacks(self) -> int:
        """Steps that could not be planned before the previous one landed."""
        return self.stats.speculative_syncs

    def step(self) -> list:
        """Schedule and launch the next step, land the previous one; the landed steps' deltas."""
        core = self.core
        t_start = time.perf_counter()
        core.structured.admit_ready(core.scheduler)
        planner = self.planner
        if self._pending is not None and planner is not None:
            if planner.can_plan_after(self._pending.step):  # its drafts are on the device
                planner.mark(self._pending.so)
            else:
                self.stats.speculative_syncs += 1
                self._apply()
        with phase(SCHEDULE):
            so = self.scheduler.schedule()
        if self._pending is not None and planner is not None and not planner.device_step_ok(so):
            self.stats.speculative_syncs += 1
            self._apply()  # the step in flight lands: the plan gets its real tokens and positions
            planner.resolve(so)
        self.stats.steps += 1
        step = core.runner.launch(so)  # on a GPU: enqueued behind step N, nothing waits here
        if self._pending is not None:
            self.stats.overlapped += 1
            if self._mask_needs_pending(so):
                self.stats.grammar_waits += 1
                self._apply()  # N's tokens reach the matchers while N+1's forward runs
        core.runner.sample(step, core.structured.batch(so))
        self._check_hooks(so)
        prev, self._pending = self._pending, _InFlight(so, step, t_start)
        if prev is not None:
            self._apply(prev)
        if so.is_empty:  # nothing runs after it: land it now (carries finished / preempted ids)
            self._apply(record=False)
        for record in self._records:  # once per call, at its end: the profiler's step boundary
            core.metrics.record_step(*record)
        self._records.clear()
        deltas, self._deltas = self._deltas, []
        return deltas

    def _mask_needs_pending(self, so: SchedulerOutput) -> bool:
        """A constrained request samples in ``so`` and its previous token is still in flight."""
        grammars = self.core.structured.grammars
        if not any(r.needs_sample and r.req_id in grammars for r in so.scheduled):
            return False
        in_flight = {r.req_id for r in self._pending.so.scheduled if r.needs_sample}  # type: ignore[union-attr]
        return any(r.needs_sample and r.req_id in grammars and r.req_id in in_flight for r in so.scheduled)

    def _check_hooks(self, so: SchedulerOutput) -> None:
        """A runner path that bypasses build_batch / the recorded sample would feed -1 ids
        or leave stale last tokens: fail loudly instead (a cheap host check on the plan)."""
        if self.spec is not None or so.is_empty:
            return
        if self.tokens.filled is not so and any(PLACEHOLDER_TOKEN_ID in r.token_ids for r in so.scheduled):
            raise RuntimeError("async scheduling: the runner did not build inputs through build_batch, "
                               "so placeholder input ids were not gathered")
        if self.tokens.recorded is not so and any(r.needs_sample for r in so.scheduled):
            raise RuntimeError("async scheduling: the runner did not record its samples in the device "
                               "token buffer, so the next step's placeholders would read stale tokens")

    def _apply(self, item: _InFlight | None = None, record: bool = True) -> None:
        """Collect a step, update the scheduler, advance grammars / detokenize / stop strings."""
        if item is None:
            item, self._pending = self._pending, None
        assert item is not None
        core = self.core
        t_wait = time.perf_counter()
        out = core.runner.collect(item.step)
        self.stats.wait_s += time.perf_counter() - t_wait
        with phase(UPDATE):
            later = self.scheduler.inflight  # a step planned after this one, if any (before update clears it)
            in_flight = {r.req_id for r in later.scheduled} if later is not None and later is not item.so else set()
            touched = self.scheduler.update(item.so, out)
            if self.spec is not None:  # drafts for the next step go to running requests
                self.spec.attach(core.scheduler, core.structured, in_flight)
        self._deltas.extend(core.process_outputs(touched))
        if record:
            self._records.append((item.so, touched, item.t_start))

    def discard(self) -> None:
        """Drop the step in flight (abort path); its device work is allowed to finish."""
        item, self._pending = self._pending, None
        self.scheduler.inflight = None
        self._records.clear()
        self._deltas.clear()
        if item is not None:
            try:
                self.core.runner.collect(item.step)
            except BaseException:
                pass
