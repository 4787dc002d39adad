"""What both async engine clients share: per-request delta streams on asyncio loops,
timings, backpressure and the engine snapshot the server's metrics read.

The engine side (a thread of this process, `deepinfer.engine.async_client`, or another
process, `deepinfer.engine.process_client`) hands each step's deltas to
:meth:`StreamingClient._dispatch`; it stamps the requests' timings and posts the deltas to
their consumers' event loops, one ``call_soon_threadsafe`` per loop per step. A consumer
that falls behind gets the deltas that piled up merged into one (as vLLM's output collector
does), so a slow event loop sends fewer, larger stream chunks instead of falling further
behind. A consumer whose event loop has closed can no longer read: its request is aborted.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from deepinfer.engine.output_processor import StreamDelta
from deepinfer.errors import DeepInferError
from deepinfer.sampling_params import SamplingParams

__all__ = ["EngineDeadError", "EngineOverloadedError", "EngineStats", "RequestTiming", "StreamingClient",
           "engine_stats", "merge_deltas"]

logger = logging.getLogger(__name__)


class EngineOverloadedError(DeepInferError):
    """The bounded waiting queue is full; retry later."""


class EngineDeadError(RuntimeError):
    """The engine stopped after an error; the client cannot serve."""


@dataclass
class RequestTiming:
    """Host clocks (time.monotonic) of one request as its client saw it."""

    submitted: float
    first_token: float | None = None
    last_token: float | None = None
    num_output_tokens: int = 0
    itls: list[float] = field(default_factory=list)  # per-token gaps after the first


@dataclass
class EngineStats:
    """Engine state after a step, as /metrics shows it (taken where the engine runs)."""

    num_running: int = 0
    num_waiting: int = 0  # scheduler's waiting queue + requests whose grammar still compiles
    kv_usage: float = 0.0  # fraction of blocks in use, fullest group
    spec_acceptance: float | None = None  # accepted / verified drafts (None without speculation)
    spec_mean_accepted: float | None = None


def engine_stats(core: Any) -> EngineStats:
    """A snapshot of ``core`` (an EngineCore) for the metrics hook."""
    sched = core.scheduler
    usage = core.kv_manager.usage()
    stats = EngineStats(sched.num_running, sched.num_waiting + len(core.structured.pending),
                        max(usage.values()) if usage else 0.0)
    spec = getattr(core.runner, "spec", None)
    if spec is not None:
        m = spec.metrics
        proposed = sum(m.proposed)
        stats.spec_acceptance = sum(m.accepted) / proposed if proposed else 0.0
        stats.spec_mean_accepted = m.mean_accepted_length
    return stats


#: the metrics hook: (deltas of one engine turn, their requests' timings, step seconds, engine snapshot)
StepHook = Callable[[list[StreamDelta], dict[str, RequestTiming], float, EngineStats], None]


def merge_deltas(a: StreamDelta, b: StreamDelta) -> StreamDelta:
    """``a`` then ``b`` of one request as one delta (``b`` may be the last)."""
    lps = a.logprobs + b.logprobs if a.logprobs is not None and b.logprobs is not None else (a.logprobs or b.logprobs)
    tops = (a.top_logprobs + b.top_logprobs if a.top_logprobs is not None and b.top_logprobs is not None
            else (a.top_logprobs or b.top_logprobs))
    return StreamDelta(a.request_id, a.text + b.text, a.token_ids + b.token_ids, lps, tops, b.finish_reason,
                       b.stop_reason, b.output)


@dataclass
class _Stream:
    """One request's deltas (or the exception that ends it) on its consumer's loop."""

    loop: asyncio.AbstractEventLoop
    timing: RequestTiming
    detok: Any = None  # the client's own IncrementalDetokenizer when the engine sends ids only
    items: deque = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, item: StreamDelta | BaseException) -> None:  # on ``loop``
        self.items.append(item)
        self.ready.set()


class StreamingClient:
    """Streams, timings and backpressure; subclasses run the engine and implement
    :meth:`_enqueue` (a command for the engine), :meth:`num_waiting` / :meth:`num_running`,
    :meth:`admit` and the ``config`` / ``model_config`` / ``tokenizer`` / ``model_dir`` it serves."""

    config: Any
    model_config: Any
    tokenizer: Any
    model_dir: Any

    def __init__(self, max_waiting: int, on_step: StepHook | None) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.max_waiting = max_waiting
        #: called after every engine turn on the thread that received its deltas
        self.on_step = on_step
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._queued_adds = 0  # adds handed to the engine side that it has not taken yet
        self._error: BaseException | None = None
        #: engine-side numbers read by /metrics
        self.num_steps = 0
        self.busy_s = 0.0  # seconds the engine spent stepping

    # ---- what subclasses provide --------------------------------------------------------
    def _enqueue(self, kind: str, payload: Any) -> None:
        raise NotImplementedError

    def num_waiting(self) -> int:
        """Requests not yet running: queued for the engine, compiling a grammar or waiting to be scheduled."""
        raise NotImplementedError

    def num_running(self) -> int:
        raise NotImplementedError

    async def admit(self, prompt: str | None, ids: list[int] | None,
                    params: list[SamplingParams]) -> tuple[list[int], list[SamplingParams]]:
        """The engine's admission checks (`admit_generate`) for ``len(params)`` choices of one
        prompt, off the event loop: (prompt ids, resolved params) or InvalidRequestError."""
        raise NotImplementedError

    # ---- requests ----------------------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               prompt: str | None = None) -> _Stream:
        """Queue a checked request (called on the event loop); its deltas arrive on the returned stream."""
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error!r}")
        with self._lock:
            if self.num_waiting() >= self.max_waiting:
                raise EngineOverloadedError(
                    f"the waiting queue is full ({self.max_waiting} requests, --max-waiting); retry later")
            if request_id in self._streams:
                raise DeepInferError(f"request id {request_id!r} is already in use")
            stream = _Stream(asyncio.get_running_loop(), RequestTiming(time.monotonic()),
                             self._client_detokenizer(prompt_token_ids, params))
            self._streams[request_id] = stream
            self._queued_adds += 1
        # stream_text: whether the engine puts text in this request's deltas
        self._enqueue("add", (request_id, prompt_token_ids, params, prompt, stream.detok is None))
        return stream

    def _client_detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> Any:
        """A detokenizer this side runs for the request (None: the engine sends its text)."""
        return None

    def abort(self, request_id: str) -> None:
        """End a request; its blocks are freed before the engine's next step."""
        self._enqueue("abort", request_id)

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None) -> AsyncIterator[StreamDelta]:
        """Queue a request now (raising EngineOverloadedError at once when the queue is full)
        and return the iterator of its deltas; the last has ``finished`` set. Closing the
        iterator early (client disconnect, cancellation) aborts the request."""
        return self._deltas(request_id, self.submit(request_id, prompt_token_ids, params, prompt))

    async def _deltas(self, request_id: str, stream: _Stream) -> AsyncIterator[StreamDelta]:
        finished = False
        items = stream.items
        try:
            while True:
                if not items:
                    stream.ready.clear()
                    await stream.ready.wait()
                    continue
                item = items.popleft()
                if isinstance(item, BaseException):
                    raise item
                # deltas that arrived while the consumer was busy go out as one
                while not item.finished and items and not isinstance(items[0], BaseException):
                    item = merge_deltas(item, items.popleft())
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def timing(self, request_id: str) -> RequestTiming | None:
        stream = self._streams.get(request_id)
        return stream.timing if stream is not None else None

    # ---- the engine side's delivery --------------------------------------------------------
    def _dispatch(self, deltas: list[StreamDelta]) -> dict[str, RequestTiming]:
        """Hand deltas to their consumers' loops; return the timings of their requests."""
        now = time.monotonic()
        timings: dict[str, RequestTiming] = {}
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, StreamDelta]]] = {}
        with self._lock:
            for d in deltas:
                stream = self._streams.get(d.request_id)
                if stream is None:
                    continue
                t = timings[d.request_id] = stream.timing
                if d.token_ids:
                    if t.first_token is None:
                        t.first_token = now
                        t.itls.extend([0.0] * (len(d.token_ids) - 1))  # tokens of one step arrive together
                    else:
                        gap = (now - t.last_token) / len(d.token_ids)
                        t.itls.extend([gap] * len(d.token_ids))
                    t.last_token = now
                    t.num_output_tokens += len(d.token_ids)
                if d.finished:
                    del self._streams[d.request_id]
                by_loop.setdefault(stream.loop, []).append((stream, d))
        for loop, items in by_loop.items():
            if not _post(loop, _put_all, items):
                self._orphaned([d.request_id for _, d in items if not d.finished])
        return timings

    def _orphaned(self, request_ids: list[str]) -> None:
        """Abort requests whose consumer's event loop has closed (nobody can read them)."""
        for rid in request_ids:
            with self._lock:
                self._streams.pop(rid, None)
            logger.info("aborting request %s: its consumer's event loop is closed", rid)
            self.abort(rid)

    def _send(self, request_id: str, item: Any) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            _post(stream.loop, stream.put, item)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            _post(stream.loop, stream.put, exc)


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> bool:
    """Run ``fn`` on a consumer's loop; False when that loop has closed."""
    if loop.is_closed():
        return False
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # closed between the check and the call
        return False
    return True


def _put_all(items: list[tuple[_Stream, StreamDelta]]) -> None:
    for stream, delta in items:
        stream.put(delta)
