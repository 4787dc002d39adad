"""AsyncEngineClient: the engine core's step loop on a background thread, deltas to asyncio.

    client = AsyncEngineClient(core, max_waiting=256)
    client.start()
    async for delta in client.generate("r1", prompt_ids, params):   # one StreamDelta per step
        ...                                                         # leaving early aborts r1

The other client, `deepinfer.engine.process_client.ProcessEngineClient`, runs the core in
its own process; `deepinfer serve --engine-client` picks one (the process is the default:
the two are measured side by side by ``benchmarks/serve_h200.py``). In this one the step
loop and the event loop share one GIL: the engine thread drops it in every torch op and
must win it back from the event loop's Python (HTTP, JSON, SSE), which slows each step
when many streams are served.

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
from typing import Any

from deepinfer.engine.admission import admit_generate
from deepinfer.engine.client_base import (EngineDeadError, EngineOverloadedError, EngineStats, RequestTiming,
                                          StepHook, StreamingClient, engine_stats)
from deepinfer.engine.output_processor import StreamDelta
from deepinfer.errors import DeepInferError
from deepinfer.sampling_params import SamplingParams

__all__ = ["AsyncEngineClient", "EngineOverloadedError", "EngineDeadError", "EngineStats", "RequestTiming"]

logger = logging.getLogger(__name__)


class AsyncEngineClient(StreamingClient):
    """Drives one `EngineCore` from a background thread for asyncio consumers."""

    def __init__(self, core: Any, max_waiting: int = 256, on_step: StepHook | None = None) -> None:
        super().__init__(max_waiting, on_step)
        self.core = core
        self._wake = threading.Condition(self._lock)
        self._commands: deque[tuple[str, Any]] = deque()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)

    # what the server reads of the engine it serves
    @property
    def config(self) -> Any:
        return self.core.config

    @property
    def model_config(self) -> Any:
        return self.core.model_config

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def model_dir(self) -> Any:
        return self.core.model_dir

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
        core = self.core
        return self._queued_adds + len(core.structured.pending) + core.scheduler.num_waiting

    def num_running(self) -> int:
        return self.core.scheduler.num_running

    async def admit(self, prompt: str | None, ids: list[int] | None,
                    params: list[SamplingParams]) -> tuple[list[int], list[SamplingParams]]:
        kwargs = ({"prompts": [prompt] * len(params), "prompt_token_ids": None} if prompt is not None
                  else {"prompts": None, "prompt_token_ids": [ids] * len(params)})
        items, checked = await asyncio.get_running_loop().run_in_executor(
            None, lambda: admit_generate(self.core, sampling_params=params, **kwargs))
        return items[0][1], checked

    def _enqueue(self, kind: str, payload: Any) -> None:
        with self._wake:
            self._commands.append((kind, payload))
            self._wake.notify()

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
                    self.on_step(out, timings, dt, engine_stats(core))
        except BaseException as exc:  # noqa: BLE001 - every waiting consumer must hear of it
            logger.exception("deepinfer engine thread failed")
            self._error = exc
            self._fail_all(EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}"))

    def _apply(self, kind: str, payload: Any) -> list[StreamDelta]:
        core = self.core
        if kind == "add":
            request_id, ids, params, prompt, stream_text = payload
            with self._lock:
                self._queued_adds -= 1
            try:
                core.add_request(request_id, ids, params, prompt=prompt, stream=True, stream_text=stream_text)
            except DeepInferError as exc:  # checked before submit; a late refusal ends this request only
                self._send(request_id, exc)
            except ValueError as exc:
                self._send(request_id, DeepInferError(str(exc)))
            return []
        delta = core.abort(payload)
        return [delta] if delta is not None else []
