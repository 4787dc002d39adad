"""Async scheduling on CPU with hand-made runner outputs: step N+1 is planned (with
placeholders) before step N's results are applied.

The fake "device" (test_scheduler.FakeRunner) runs each step when it is scheduled, in
order, and keeps the last sampled token per state slot, like AsyncRunner's device buffer:
placeholder inputs are filled from it and checked later against the tokens the scheduler
appended. Its results come back one step late, as in the async engine loop.
"""

from __future__ import annotations

from array import array

import pytest

from deepinfer.engine.async_scheduler import AsyncScheduler
from deepinfer.engine.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.engine.request import PLACEHOLDER_TOKEN_ID, Request, RequestStatus

from test_scheduler import (R, FakeRunner, _reference_outputs, all_free, make, setup,  # noqa: I001
                            stress_prompts, stress_scheduler)


class AsyncFakeRunner(FakeRunner):
    """FakeRunner whose placeholder inputs come from a per-slot buffer of last samples."""

    def __init__(self, sched, token_fn=None) -> None:
        super().__init__(sched, token_fn)
        self.last: dict[int, int] = {}
        self.filled: list[tuple[str, int, int]] = []  # (req_id, position, token) read from the buffer
        self.num_placeholders = 0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for s in so.scheduled:
            for j, tok in enumerate(s.token_ids):
                if tok == PLACEHOLDER_TOKEN_ID:
                    assert j == s.num_tokens - 1 and s.needs_sample, "a placeholder is only a decode input"
                    assert s.state_slot in self.last, "wrong gather: slot never sampled"
                    s.token_ids[j] = self.last.pop(s.state_slot)  # debug sentinel: read once
                    self.filled.append((s.req_id, s.start_pos + j, s.token_ids[j]))
                    self.num_placeholders += 1
        # The truth check of FakeRunner compares inputs with all_token_ids, which does not
        # hold in-flight tokens yet: extend a view with the filled ones while executing.
        saved = {}
        for s in so.scheduled:
            req = self.reqs[s.req_id]
            end = s.start_pos + s.num_tokens
            if end > req.num_tokens:
                saved[s.req_id] = req.all_token_ids
                req.all_token_ids = req.all_token_ids + array("q", s.token_ids[req.num_tokens - s.start_pos:])
        try:
            out = super().execute(so)
        finally:
            for rid, toks in saved.items():
                self.reqs[rid].all_token_ids = toks
        for s, toks in zip(so.scheduled, out.sampled_token_ids):
            if toks:
                self.last[s.state_slot] = toks[-1]
        return out


def drive_async(sched, runner: AsyncFakeRunner, arrivals=None, on_step=None) -> int:
    """The async loop: schedule N+1, run it on the 'device', then apply step N."""
    asched = AsyncScheduler(sched)
    arrivals = list(arrivals or [])
    pending = None
    steps = 0
    while sched.has_unfinished() or arrivals or pending is not None:
        for r in arrivals.pop(0) if arrivals else []:
            runner.add(r)
        so = asched.schedule()
        assert sched.num_running <= sched.config.max_num_seqs
        assert not set(so.preempted_req_ids) & {s.req_id for s in so.scheduled}
        out = runner.execute(so)  # empty steps too: they carry preempted ids
        if pending is not None:
            asched.update(*pending)
        if on_step is not None:
            on_step(asched, so)
        pending = (so, out) if so.scheduled else None
        if not so.scheduled:
            asched.inflight = None
        for req in sched.requests.values():  # placeholders never leak into token lists
            assert PLACEHOLDER_TOKEN_ID not in req.all_token_ids
            assert 0 <= req.num_output_placeholders <= 2
        sched.kv.assert_consistent()
        steps += 1
        assert steps < 10_000
    return steps


def check_filled(runner: AsyncFakeRunner) -> None:
    for rid, pos, tok in runner.filled:  # every gathered token is the one the request got
        assert runner.reqs[rid].all_token_ids[pos] == tok


def test_async_decode_matches_reference_and_uses_placeholders() -> None:
    prompts = {f"r{i}": (list(range(10 * i + 2, 10 * i + 9 + i)), 12) for i in range(4)}
    sched = make(blocks=256)
    runner = AsyncFakeRunner(sched)
    for rid, (p, mt) in prompts.items():
        runner.add(R(rid, p, mt))
    drive_async(sched, runner)
    assert {rid: r.output_token_ids for rid, r in runner.reqs.items()} == _reference_outputs(prompts)
    assert runner.num_placeholders > 0
    check_filled(runner)
    assert all_free(sched)


def test_finish_at_step_n_discards_planned_step_n_plus_1() -> None:
    # "a" samples the stop token 7 as its 3rd output; "b" runs on.
    script = {"a": [3, 4, 7, 9, 9, 9], "b": [5, 5, 5, 5, 5, 5]}
    sched = make(blocks=64)
    runner = AsyncFakeRunner(sched, token_fn=lambda req, n: script[req.req_id][n])
    a, b = R("a", [2, 3, 4], 6, stop_token_ids=[7]), R("b", [2, 3], 6)
    runner.add(a)
    runner.add(b)
    seen = {}

    def on_step(asched, so):
        if a.is_finished and "finish" not in seen:
            seen["finish"] = so  # the step planned before "a"'s stop token was known
            assert any(s.req_id == "a" for s in so.scheduled), "a's step N+1 was already planned"
            assert a.req_id not in sched.requests

    drive_async(sched, runner, on_step=on_step)
    assert a.output_token_ids == [3, 4, 7] and a.status == RequestStatus.FINISHED_STOPPED
    assert a.stop_reason == 7
    assert b.output_token_ids == [5] * 6
    assert "finish" in seen and all_free(sched)


def test_stop_string_finish_while_next_step_in_flight() -> None:
    # finish_request from outside (a stop string) after update(N), with N+1 in flight.
    sched = make(blocks=64)
    runner = AsyncFakeRunner(sched, token_fn=lambda req, n: 10 + n)
    a = R("a", [2, 3, 4], 8)
    runner.add(a)
    asched = AsyncScheduler(sched)
    so1 = asched.schedule()
    out1 = runner.execute(so1)  # prefill + first sample (11th position... token 10)
    so2 = asched.schedule()  # planned with a placeholder before out1 is applied
    assert so2.scheduled[0].token_ids == [PLACEHOLDER_TOKEN_ID] and a.num_output_placeholders == 2
    out2 = runner.execute(so2)
    asched.update(so1, out1)
    assert a.output_token_ids == [10] and a.num_output_placeholders == 1
    assert a.num_computed_tokens == 4  # 3 prompt tokens + the in-flight placeholder input
    sched.finish_request("a", "stop", stop_reason="xx")  # the detokenizer saw a stop string
    assert all_free(sched)
    asched.update(so2, out2)  # step N+1's token of a finished request is dropped
    assert a.output_token_ids == [10] and a.stop_reason == "xx" and all_free(sched)


def test_preemption_while_step_in_flight_keeps_its_token() -> None:
    # Pool of 5 blocks of 4: "a" and "b" (6-token prompts, 14 new tokens) cannot both finish.
    sched = make(blocks=5, budget=64)
    runner = AsyncFakeRunner(sched)
    a, b = R("a", [2] * 6, 14), R("b", [3] * 6, 14)
    runner.add(a)
    runner.add(b)
    events = []

    def on_step(asched, so):
        for rid in so.preempted_req_ids:
            events.append((rid, sched.requests[rid].num_output_tokens))

    drive_async(sched, runner, on_step=on_step)
    assert events and b.num_preemptions >= 1
    assert a.num_output_tokens == b.num_output_tokens == 14
    ref = _reference_outputs({"a": ([2] * 6, 14), "b": ([3] * 6, 14)})
    assert {"a": a.output_token_ids, "b": b.output_token_ids} == ref
    check_filled(runner)
    assert all_free(sched)


def test_preempted_request_gets_in_flight_token_by_hand() -> None:
    sched = make(blocks=5, budget=64)
    runner = AsyncFakeRunner(sched, token_fn=lambda req, n: 20 + n)
    a, b = R("a", [2] * 6, 14), R("b", [3] * 6, 14)
    runner.add(a)
    runner.add(b)
    asched = AsyncScheduler(sched)
    pending = None
    while True:  # step until a schedule() preempts "b" while b's sample is in flight
        so = asched.schedule()
        out = runner.execute(so)
        if so.preempted_req_ids:
            assert so.preempted_req_ids == ["b"] and b.status == RequestStatus.PREEMPTED
            assert b.num_output_placeholders == 0 and b.num_computed_tokens == 0
            before = b.num_output_tokens
            touched = asched.update(*pending)
            assert b in touched and b.num_output_tokens == before + 1  # not lost
            assert b.output_token_ids[-1] == 20 + before
            pending = (so, out)
            break
        if pending is not None:
            asched.update(*pending)
        pending = (so, out)
    asched.update(*pending)
    while sched.has_unfinished():
        so = asched.schedule()
        asched.update(so, runner.execute(so))
    assert b.output_token_ids == [20 + i for i in range(14)]
    assert a.output_token_ids == [20 + i for i in range(14)] and all_free(sched)


@pytest.mark.parametrize("chunked,caching", [(True, True), (True, False), (False, True)])
def test_async_stress_200_requests_match_huge_pool(chunked: bool, caching: bool) -> None:
    prompts = stress_prompts(4321)
    ref = _reference_outputs(prompts)
    sched = stress_scheduler(chunked, caching)
    runner = AsyncFakeRunner(sched)
    reqs = [R(rid, p, max_tokens=mt) for rid, (p, mt) in prompts.items()]
    drive_async(sched, runner, [reqs[i : i + 7] for i in range(0, len(reqs), 7)])
    assert sum(r.num_preemptions for r in reqs) > 10
    assert runner.num_placeholders > 100
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == ref[r.req_id][: len(r.output_token_ids)]
        assert r.num_output_tokens == min(r.sampling_params.max_tokens, 64 - r.num_prompt_tokens)
    check_filled(runner)
    assert all_free(sched)
    assert (sum(r.num_cached_tokens for r in reqs) > 0) == caching


def test_sync_scheduler_never_sees_placeholders() -> None:
    sched, runner = setup(R("a", [2, 3, 4], 5))
    while sched.has_unfinished():
        so = sched.schedule()
        assert all(PLACEHOLDER_TOKEN_ID not in s.token_ids for s in so.scheduled)
        sched.update(so, runner.execute(so))
    assert isinstance(runner.reqs["a"], Request) and runner.reqs["a"].num_output_placeholders == 0
