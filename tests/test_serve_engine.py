"""EngineCore and AsyncEngineClient without HTTP: streamed deltas add up to the offline
output, an abort frees the request's KV blocks within one engine step, the waiting queue
is bounded, a request whose consumer's event loop closed is aborted, a slow consumer's
merged deltas add up, and LLM is a client of the core (no subclass, no callback into LLM)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine.async_client import AsyncEngineClient, EngineOverloadedError
from deepinfer.engine.core import EngineCore

ENGINE = {"max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 256}


@pytest.fixture(scope="module")
def llm():
    return LLM(**ENGINE)


def test_llm_is_a_client_of_the_core(llm):
    assert type(llm.engine) is EngineCore and llm.scheduler is llm.engine.scheduler
    assert not hasattr(LLM, "_after_update")
    llm.config = llm.config  # writes go to the core, where the engine reads them
    assert "config" not in vars(llm)


def test_core_stream_deltas_equal_offline_output(llm):
    core = llm.engine
    sp = SamplingParams(max_tokens=20, temperature=0.9, seq_seed=5, stop=[" the"], top_logprobs=1)
    ref = llm.generate(["The old man and"], sp, use_tqdm=False)[0]
    ids = core.tokenizer.encode("The old man and")
    core.add_request("s", ids, sp.for_request(), prompt="The old man and", stream=True)
    deltas = []
    while core.has_unfinished():
        deltas += [d for d in core.step() if d.request_id == "s"]
    assert "".join(d.text for d in deltas) == ref.text
    assert [t for d in deltas for t in d.token_ids] == ref.token_ids
    assert deltas[-1].finished and deltas[-1].finish_reason == ref.finish_reason
    assert deltas[-1].output.text == ref.text and len(core.outputs) == 0


def test_abort_frees_blocks_within_one_step(llm):
    core = llm.engine
    freed: list[tuple[int, float]] = []  # (engine steps done, KV usage) right after the abort ran
    client = AsyncEngineClient(core, max_waiting=4)
    real_abort = core.abort

    def abort(request_id: str):
        delta = real_abort(request_id)
        freed.append((client.num_steps, max(core.kv_manager.usage().values())))
        return delta

    core.abort = abort
    client.start()
    try:
        async def run() -> tuple[int, list]:
            sp = SamplingParams(max_tokens=200, ignore_eos=True, seq_seed=1).for_request()
            got, steps_at_abort = [], None
            gen = client.generate("long", list(range(10, 40)), sp)
            async for d in gen:
                got.append(d)
                if len(got) == 3:
                    steps_at_abort = client.num_steps
                    await gen.aclose()  # what a disconnect does
                    break
            for _ in range(400):
                if freed:
                    break
                await asyncio.sleep(0.01)
            return steps_at_abort, got

        steps_at_abort, got = asyncio.run(run())
        (steps_when_freed, usage), = freed
        assert usage == 0.0  # every block of the request is back in the pool
        assert steps_when_freed - steps_at_abort <= 1  # at most the step already running when it closed
        assert core.scheduler.requests == {} and len(core.outputs) == 0
    finally:
        client.shutdown()
        del core.abort


def test_waiting_queue_is_bounded(llm):
    core = llm.engine
    client = AsyncEngineClient(core, max_waiting=3)  # not started: nothing leaves the queue
    sp = SamplingParams(max_tokens=4).for_request()

    async def run() -> None:
        for i in range(3):
            client.submit(f"w{i}", [10, 11], sp)
        with pytest.raises(EngineOverloadedError, match="waiting queue is full"):
            client.submit("w3", [10, 11], sp)

    asyncio.run(run())
    assert client.num_waiting() == 3
    client.start()  # the queued three run and finish
    deadline = threading.Event()
    for _ in range(200):
        if client.num_waiting() == 0 and not core.has_unfinished():
            break
        deadline.wait(0.05)
    client.shutdown()
    assert not core.has_unfinished() and len(core.outputs) == 0


def test_request_whose_event_loop_closed_is_aborted(llm):
    """A consumer's loop that closes without closing its stream (a notebook cell's loop torn
    down, a worker thread gone) can never read again: the request is aborted, its blocks freed."""
    core = llm.engine
    aborted: list[str] = []
    real_abort = core.abort

    def abort(request_id: str):
        aborted.append(request_id)
        return real_abort(request_id)

    core.abort = abort
    client = AsyncEngineClient(core, max_waiting=4)
    client.start()
    loop = asyncio.new_event_loop()
    try:
        sp = SamplingParams(max_tokens=200, ignore_eos=True, seq_seed=3).for_request()
        gens = []  # kept referenced: the generator is never finalized

        async def first() -> None:
            gens.append(client.generate("orphan", list(range(10, 40)), sp))
            await gens[0].__anext__()

        loop.run_until_complete(first())
        loop.close()  # no aclose(): the generator's finally never runs
        for _ in range(600):
            if aborted and not core.has_unfinished():
                break
            threading.Event().wait(0.01)
        assert aborted == ["orphan"]
        assert core.scheduler.requests == {} and max(core.kv_manager.usage().values()) == 0.0
        assert len(core.outputs) == 0 and client.timing("orphan") is None
    finally:
        client.shutdown()
        del core.abort


def test_merged_deltas_of_a_slow_consumer_add_up(llm):
    """Deltas that pile up while a consumer is busy reach it merged: the same text, ids and
    logprobs as the offline output, in fewer pieces."""
    core = llm.engine
    sp = SamplingParams(max_tokens=24, temperature=0.9, seq_seed=9, top_logprobs=1, ignore_eos=True)
    ref = llm.generate(["A slow reader"], sp, use_tqdm=False)[0]
    ids = core.tokenizer.encode("A slow reader")
    client = AsyncEngineClient(core, max_waiting=4)
    client.start()
    try:
        async def run() -> list:
            got = []
            async for d in client.generate("slow", ids, sp.for_request(), prompt="A slow reader"):
                got.append(d)
                # hold the loop while the engine takes three more steps (or ends the request)
                until, deadline = client.num_steps + 3, time.monotonic() + 10
                while client.num_steps < until and client.core.has_unfinished() and time.monotonic() < deadline:
                    time.sleep(0.002)
            return got

        got = asyncio.run(run())
    finally:
        client.shutdown()
    assert len(got) < len(ref.token_ids)  # merged
    assert "".join(d.text for d in got) == ref.text
    assert [t for d in got for t in d.token_ids] == ref.token_ids
    assert [x for d in got for x in d.logprobs] == pytest.approx(ref.logprobs, abs=1e-5)
    assert [x for d in got for x in d.top_logprobs] == ref.top_logprobs
    assert got[-1].finish_reason == "length" and got[-1].output.token_ids == ref.token_ids
