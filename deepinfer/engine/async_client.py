"""AsyncEngineClient: the engine core's step loop on a background thread, deltas to asyncio.

    client = AsyncEngineClient(core, max_waiting=256)
    client.start()
    async for delta in client.generate("r1", prompt_ids, params):   # one StreamDelta per step
        ...                                                         # leaving early aborts r1

Why a thread, not a process: the core's step releases the GIL in torch (CPU kernels, CUDA
launches and syncs), and deltas reach the event loop by ``call_soon_threadsafe`` with no
serialisation; a process would pickle every delta both ways. Measured on CPU (2 cores,
deepinfer-tiny): see ``profiling/serve_overhead.py`` and the README's serving section.

Only the engine thread touches the core (add, step, abort): the event loop hands it
commands through a queue, read before every step. So an abort frees the request's KV
blocks before the next step is scheduled ("within one step"), whatever the loop is doing.

Backpressure: requests waiting (queued here, compiling a grammar, or in the scheduler's
waiting queue) are bounded by ``max_waiting``; past it :meth:`generate` raises
:class:`EngineOverloadedError` at once (the server answers 503 with Retry-After).
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

__all__ = ["AsyncEngineClient", "EngineOverloadedError", "EngineDeadError", "RequestTiming"]

logger = logging.getLogger(__name__)


class EngineOverloadedError(DeepInferError):
    """The bounded waiting queue is full; retry later."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an error; the client cannot serve."""


@dataclass
class RequestTiming:
    """Host clocks (time.monotonic) of one request as its client saw it."""

    submitted: float
    first_token: float | None = None
    last_token: float | None = None
    num_output_tokens: int = 0
    itls: list[float] = field(default_factory=list)  # per-token gaps after the first


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    timing: RequestTiming


class AsyncEngineClient:
    """Drives one `EngineCore` from a background thread for asyncio consumers."""

    def __init__(self, core: Any, max_waiting: int = 256,
                 on_step: Callable[[list[StreamDelta], dict[str, RequestTiming], float], None] | None = None) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.core = core
        self.max_waiting = max_waiting
        #: called on the engine thread after every step: (deltas, their requests' timings, step seconds)
        self.on_step = on_step
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._commands: deque[tuple[str, Any]] = deque()
        self._streams: dict[str, _Stream] = {}
        self._queued_adds = 0
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        #: engine-side numbers read by /metrics (written by the engine thread only)
        self.num_steps = 0
        self.busy_s = 0.0  # seconds the engine thread spent stepping

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    # ---- load ----------------------------------------------------------------------------
    def num_waiting(self) -> int:
        """Requests not yet running: queued here, compiling a grammar or waiting in the scheduler."""
        core = self.core
        return self._queued_adds + len(core.structured.pending) + core.scheduler.num_waiting

    def num_running(self) -> int:
        return self.core.scheduler.num_running

    # ---- requests ----------------------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               prompt: str | None = None) -> _Stream:
        """Queue a checked request (called on the event loop); its deltas arrive on the returned stream."""
        if self._error is not None:
            raise EngineDeadError(f"the engine thread stopped: {self._error!r}")
        with self._wake:
            if self.num_waiting() >= self.max_waiting:
                raise EngineOverloadedError(
                    f"the waiting queue is full ({self.max_waiting} requests, --max-waiting); retry later")
            if request_id in self._streams:
                raise DeepInferError(f"request id {request_id!r} is already in use")
            stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), RequestTiming(time.monotonic()))
            self._streams[request_id] = stream
            self._queued_adds += 1
            self._commands.append(("add", (request_id, prompt_token_ids, params, prompt)))
            self._wake.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """End a request; its blocks are freed before the engine's next step."""
        with self._wake:
            self._commands.append(("abort", request_id))
            self._wake.notify()

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None) -> AsyncIterator[StreamDelta]:
        """Queue a request now (raising EngineOverloadedError at once when the queue is full)
        and return the iterator of its deltas; the last has ``finished`` set. Closing the
        iterator early (client disconnect, cancellation) aborts the request."""
        return self._deltas(request_id, self.submit(request_id, prompt_token_ids, params, prompt))

    async def _deltas(self, request_id: str, stream: _Stream) -> AsyncIterator[StreamDelta]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
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

    # ---- the engine thread -------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        try:
            while True:
                with self._wake:
                    while not self._stop and not self._commands and not core.has_unfinished():
                        self._wake.wait()
                    if self._stop:
                        break
                    commands, self._commands = self._commands, deque()
                out: list[StreamDelta] = []
                for kind, payload in commands:
                    out.extend(self._apply(kind, payload))
                if core.has_unfinished():
                    t0 = time.perf_counter()
                    out.extend(core.step())
                    dt = time.perf_counter() - t0
                    self.busy_s += dt
                    self.num_steps += 1
                else:
                    dt = 0.0
                timings = self._dispatch(out)
                if self.on_step is not None:
                    self.on_step(out, timings, dt)
        except BaseException as exc:  # noqa: BLE001 - every waiting consumer must hear of it
            logger.exception("deepinfer engine thread failed")
            self._error = exc
            self._fail_all(EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}"))

    def _apply(self, kind: str, payload: Any) -> list[StreamDelta]:
        core = self.core
        if kind == "add":
            request_id, ids, params, prompt = payload
            with self._lock:
                self._queued_adds -= 1
            try:
                core.add_request(request_id, ids, params, prompt=prompt, stream=True)
            except DeepInferError as exc:  # checked before submit; a late refusal ends this request only
                self._send(request_id, exc)
            except ValueError as exc:
                self._send(request_id, DeepInferError(str(exc)))
            return []
        delta = core.abort(payload)
        return [delta] if delta is not None else []

    def _dispatch(self, deltas: list[StreamDelta]) -> dict[str, RequestTiming]:
        """Hand deltas to their consumers' loops; return the timings of their requests."""
        now = time.monotonic()
        timings: dict[str, RequestTiming] = {}
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StreamDelta]]] = {}
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
                by_loop.setdefault(stream.loop, []).append((stream.queue, d))
        for loop, items in by_loop.items():
            _post(loop, _put_all, items)
        return timings

    def _send(self, request_id: str, item: Any) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            _post(stream.loop, stream.queue.put_nowait, item)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            _post(stream.loop, stream.queue.put_nowait, exc)


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn`` on a consumer's loop; a loop that has closed has no one left to tell."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        logger.debug("dropped a delta: its event loop is closed")


def _put_all(items: list[tuple[asyncio.Queue, StreamDelta]]) -> None:
    for queue, delta in items:
        queue.put_nowait(delta)
