"""ProcessEngineClient: the engine core in its own process, deltas to asyncio consumers.

    client = ProcessEngineClient({"model": path, "max_num_seqs": 64}, max_waiting=256)
    client.start()                           # returns once the engine process has built its core
    async for delta in client.generate("r1", prompt_ids, params):
        ...

Why a process: in one process the step loop and the server's event loop share one GIL.
The engine thread drops it in every torch op (a CUDA sync, a kernel launch) and then waits
for the event loop's Python (HTTP parsing, JSON, SSE writes for every stream) to hand it
back; with Python's 5 ms switch interval a step can wait milliseconds for the GIL. Here the
engine process has its own interpreter: it steps as `LLM.generate` does and sends one
pickled message per step (all its deltas plus an `EngineStats` snapshot) over a pipe.
A reader thread in the server's process unpickles it and posts the deltas to their loops
(`StreamingClient._dispatch`). Measured against the thread client by
``benchmarks/serve_h200.py`` (CPU with ``--tiny``, and on an H200).

The engine sends token ids only: each stream's text is decoded here, in the reader thread
(`IncrementalDetokenizer`, as the engine would), so detokenizing every stream every step
is off the engine's step (``LLM.generate`` decodes once, at the end). A request with stop
strings keeps its text in the engine, which must see it to stop the request at once.

Commands travel the other way on the same pipe: ``add``, ``abort`` (applied before the
engine's next step, so KV blocks are freed within one step), ``admit`` and ``stop``. The
admission checks run here, against the engine's `AdmissionView` (its config and KV
geometry, sent once at start-up: deepinfer/engine/admission_local.py); ``admit`` sends a
request to the engine process's worker threads only when it needs them (structured
output: the grammar compiles there) or the view refuses it (the engine words the error). The engine process exits when the pipe closes, so it
never outlives the server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing as mp
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any

from deepinfer.detokenizer import IncrementalDetokenizer
from deepinfer.engine.admission_local import AdmissionView, admit_locally
from deepinfer.engine.client_base import EngineDeadError, EngineStats, StepHook, StreamingClient
from deepinfer.engine.output_processor import StreamDelta
from deepinfer.errors import DeepInferError, InvalidRequestError
from deepinfer.sampling_params import SamplingParams

__all__ = ["ENGINE_SWITCH_INTERVAL_S", "ProcessEngineClient"]

#: sys.setswitchinterval of the engine process (seconds): how long its sender / admission threads
#: may wait for the step loop to hand over the GIL (benchmarks/serve_h200.py measures the effect)
ENGINE_SWITCH_INTERVAL_S = 0.0005

logger = logging.getLogger(__name__)


class ProcessEngineClient(StreamingClient):
    """Drives an `EngineCore` built in a spawned process from ``engine_kwargs`` (``EngineCore(**kwargs)``)."""

    def __init__(self, engine_kwargs: dict[str, Any], max_waiting: int = 256, on_step: StepHook | None = None,
                 start_timeout_s: float = 1800.0, switch_interval_s: float = ENGINE_SWITCH_INTERVAL_S) -> None:
        super().__init__(max_waiting, on_step)
        if not start_timeout_s > 0:
            raise ValueError(f"start_timeout_s must be > 0, got {start_timeout_s}")
        if not switch_interval_s > 0:
            raise ValueError(f"switch_interval_s must be > 0, got {switch_interval_s}")
        self.engine_kwargs = dict(engine_kwargs)
        self.start_timeout_s = start_timeout_s
        ctx = mp.get_context("spawn")  # CUDA cannot be forked
        self._conn, self._child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_main, args=(self._child_conn, self.engine_kwargs, switch_interval_s),
                                 name="deepinfer-engine", daemon=True)
        self._send_lock = threading.Lock()
        self._admits: dict[int, concurrent.futures.Future] = {}
        self._admit_ids = itertools.count()
        self._stats = EngineStats()
        self._reader = threading.Thread(target=self._read, name="deepinfer-engine-reader", daemon=True)
        self.config = self.model_config = self.tokenizer = self.model_dir = None
        #: the engine's admission checks, run here (deepinfer/engine/admission_local.py)
        self.admission: AdmissionView | None = None
        self.local_admits = 0  # requests admitted here, without a round trip to the engine process

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the engine process and wait until its core is built (raises its error if not)."""
        from deepinfer.tokenizer import load_tokenizer

        self._proc.start()
        self._child_conn.close()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._conn.poll(0.5):
            if not self._proc.is_alive():
                raise EngineDeadError(f"the engine process exited with {self._proc.exitcode} before it was ready")
            if time.monotonic() > deadline:
                self._proc.kill()
                raise EngineDeadError(f"the engine process was not ready within {self.start_timeout_s} s")
        kind, info = self._conn.recv()
        if kind == "error":
            self._proc.join(10)
            exc, text = info
            if exc is not None:  # a bad argument or checkpoint: raised as the thread client would
                raise exc
            raise EngineDeadError(f"the engine process failed to start:\n{text}")
        self.config, self.model_config, self.model_dir = info["config"], info["model_config"], info["model_dir"]
        self.tokenizer = load_tokenizer(info["tokenizer"])
        self.admission = info["admission"]
        self.admission.tokenizer = self.tokenizer
        self._reader.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (killed if it does not leave within ``timeout``); idempotent."""
        if self._proc.pid is None:  # never started
            return
        try:
            self._post_command("stop", None)
        except EngineDeadError:
            pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout)
        self._conn.close()

    @property
    def alive(self) -> bool:
        return self._proc.is_alive() and self._error is None

    # ---- load ----------------------------------------------------------------------------
    def num_waiting(self) -> int:
        return self._queued_adds + self._stats.num_waiting

    def num_running(self) -> int:
        return self._stats.num_running

    async def admit(self, prompt: str | None, ids: list[int] | None,
                    params: list[SamplingParams]) -> tuple[list[int], list[SamplingParams]]:
        if self.admission is not None:  # checked here; ids inline, a text prompt's tokenizing off the loop
            local = (admit_locally(self.admission, prompt, ids, params) if prompt is None else
                     await asyncio.get_running_loop().run_in_executor(
                         None, admit_locally, self.admission, prompt, ids, params))
            if local is not None:
                self.local_admits += 1
                return local
        fut: concurrent.futures.Future = concurrent.futures.Future()
        tag = next(self._admit_ids)
        self._admits[tag] = fut
        try:
            self._post_command("admit", (tag, prompt, ids, params))
            ok, result = await asyncio.wrap_future(fut)
        finally:
            self._admits.pop(tag, None)
        if not ok:
            raise result
        return result

    def _enqueue(self, kind: str, payload: Any) -> None:
        self._post_command(kind, payload)

    def _post_command(self, kind: str, payload: Any) -> None:
        try:
            with self._send_lock:
                self._conn.send((kind, payload))
        except (OSError, ValueError) as exc:  # the pipe is closed: the engine is gone
            raise EngineDeadError(f"the engine process is gone: {exc}") from None

    # ---- the reader thread -----------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                kind, payload = self._conn.recv()
                if kind == "step":
                    deltas, adds_taken, step_s, stats, refused = payload
                    with self._lock:
                        self._queued_adds -= adds_taken
                    self._stats = stats
                    for request_id, message in refused:
                        self._send(request_id, DeepInferError(message))
                    if step_s > 0:
                        self.busy_s += step_s
                        self.num_steps += 1
                    self._detokenize(deltas)
                    timings = self._dispatch(deltas)
                    if self.on_step is not None:
                        self.on_step(deltas, timings, step_s, stats)
                elif kind == "admitted":
                    tag, ok, result = payload
                    fut = self._admits.get(tag)
                    if fut is not None:
                        fut.set_result((ok, result))
                elif kind == "failed":
                    raise RuntimeError(payload)
        except (EOFError, OSError) as exc:
            self._die(exc)
        except BaseException as exc:  # noqa: BLE001 - every waiting consumer must hear of it
            logger.error("deepinfer engine process failed:\n%s", exc)
            self._die(exc)

    def _client_detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> Any:
        if params.stop:  # stop strings end the request in the engine: its text is decoded there
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens, None,
                                      params.include_stop_str_in_output)

    def _detokenize(self, deltas: list[StreamDelta]) -> None:
        """The text of deltas the engine sent as ids only (decoded here, off the engine's step)."""
        for d in deltas:
            stream = self._streams.get(d.request_id)
            detok = stream.detok if stream is not None else None
            if detok is None:
                continue
            d.text = detok.update(d.token_ids) if d.token_ids else ""
            if d.finished:
                d.text += detok.finish()

    def _die(self, exc: BaseException) -> None:
        self._error = exc
        err = EngineDeadError(f"the engine failed: {exc}")
        self._fail_all(err)
        for fut in list(self._admits.values()):
            if not fut.done():
                fut.set_result((False, err))


# ---- the engine process ---------------------------------------------------------------------
def _engine_main(conn: Any, engine_kwargs: dict[str, Any], switch_interval_s: float) -> None:
    """The engine process: build the core, then apply commands and step until told to stop."""
    from deepinfer.engine.admission import admit_generate
    from deepinfer.engine.client_base import engine_stats
    from deepinfer.engine.core import EngineCore

    # Ctrl-C reaches the whole process group: the server shuts this process down itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the sender and admission threads wait for the GIL while the step loop runs Python; with
    # Python's 5 ms interval a step's deltas could sit that long before they are sent
    sys.setswitchinterval(switch_interval_s)
    try:
        core = EngineCore(**engine_kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the server, which fails to start with it
        plain = isinstance(exc, (DeepInferError, ValueError, FileNotFoundError))  # a user's mistake: its message
        try:
            conn.send(("error", (exc if plain else None, traceback.format_exc())))
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its text is enough
            conn.send(("error", (None, traceback.format_exc())))
        return
    conn.send(("ready", {"config": core.config, "model_config": core.model_config, "model_dir": str(core.model_dir),
                         "admission": AdmissionView.of(core),
                         "tokenizer": str(core.config.tokenizer or core.model_dir)}))
    admitter = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="deepinfer-admit")
    # one sender thread pickles and writes: the step loop never waits on a full pipe
    outbox: queue.SimpleQueue = queue.SimpleQueue()

    def sender() -> None:
        try:
            while (msg := outbox.get()) is not None:
                conn.send(msg)
        except (OSError, ValueError):
            pass  # the server is gone; the step loop sees the closed pipe too

    send = outbox.put
    sending = threading.Thread(target=sender, name="deepinfer-engine-sender", daemon=True)
    sending.start()

    def admit(tag: int, prompt: str | None, ids: list[int] | None, params: list[SamplingParams]) -> None:
        kwargs = ({"prompts": [prompt] * len(params), "prompt_token_ids": None} if prompt is not None
                  else {"prompts": None, "prompt_token_ids": [ids] * len(params)})
        try:
            items, checked = admit_generate(core, sampling_params=params, **kwargs)
            send(("admitted", (tag, True, (items[0][1], checked))))
        except InvalidRequestError as exc:
            send(("admitted", (tag, False, exc)))
        except Exception as exc:  # noqa: BLE001 - the request's failure, not the engine's
            send(("admitted", (tag, False, DeepInferError(f"admission failed: {type(exc).__name__}: {exc}"))))

    try:
        while True:
            # block for a command only when there is nothing to step
            commands = [conn.recv()] if not core.has_unfinished() else []
            while conn.poll():
                commands.append(conn.recv())
            out, refused, adds = [], [], 0
            for kind, payload in commands:
                if kind == "stop":
                    return
                if kind == "admit":
                    admitter.submit(admit, *payload)
                elif kind == "add":
                    adds += 1
                    request_id, ids, params, prompt, stream_text = payload
                    try:
                        core.add_request(request_id, ids, params, prompt=prompt, stream=True,
                                         stream_text=stream_text)
                    except (DeepInferError, ValueError) as exc:  # a late refusal ends this request only
                        refused.append((request_id, str(exc)))
                else:
                    delta = core.abort(payload)
                    if delta is not None:
                        out.append(delta)
            step_s = 0.0
            if core.has_unfinished():
                t0 = time.perf_counter()
                out.extend(core.step())
                step_s = time.perf_counter() - t0
            if out or adds or refused or step_s:
                send(("step", (out, adds, step_s, engine_stats(core), refused)))
    except (EOFError, OSError):
        return  # the server is gone
    except BaseException:  # noqa: BLE001 - the server fails its requests with this
        send(("failed", traceback.format_exc()))
    finally:
        admitter.shutdown(wait=False, cancel_futures=True)
        outbox.put(None)
        sending.join(10)
