"""`deepinfer serve`: an OpenAI-compatible HTTP server over one engine core.

    deepinfer serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--api-key KEY]
                    [--max-waiting 256] [--max-body-bytes 4194304] [engine args as flags]

Every `EngineConfig` field is a flag (``--max-num-seqs 64``, ``--no-async-scheduling``);
flags left out fall back to ``DEEPINFER_*`` variables and the defaults, as ``LLM(...)`` does.
The server prints ``deepinfer serve: ready on http://HOST:PORT`` once it accepts requests;
``--port 0`` binds a port the OS picks and that line names it (deepinfer/serve/launch.py reads it).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import types
import typing
from typing import Any

__all__ = ["add_serve_arguments", "engine_kwargs", "serve"]

# fields that are not engine arguments a server takes (sources: bookkeeping; parallel sizes:
# the multi-rank engine has no step-level core to drive yet)
_SKIP = {"sources", "data_parallel_size", "expert_parallel_size"}


def _engine_fields() -> list[tuple[str, type, Any]]:
    from deepinfer.config import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    out = []
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SKIP:
            continue
        tp = hints[f.name]
        if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        out.append((f.name, tp, f.default))
    return out


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The server's flags and one flag per engine argument."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: a free port the OS picks (the ready line names it)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (default: no key)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the "
                   "checkpoint directory's name)")
    p.add_argument("--max-waiting", type=int, default=256, help="requests allowed to wait before the server "
                   "answers 503 with Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="largest request body (413 beyond)")
    p.add_argument("--gil-switch-interval-ms", type=float, default=5.0,
                   help="sys.setswitchinterval for this process (default: Python's 5 ms). With --engine-client "
                   "thread the engine thread drops the GIL in every torch op and must win it back from the event "
                   "loop; smaller values hand it back sooner (see the README's serving measurements)")
    p.add_argument("--engine-client", default="process", choices=["process", "thread"],
                   help="where the engine's step loop runs: its own process (default; the event loop's Python "
                   "never holds up a step) or a thread of the server's process (no pickling; shares the GIL "
                   "with HTTP). benchmarks/serve_h200.py measures both")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    engine = p.add_argument_group("engine arguments (EngineConfig; unset: DEEPINFER_* or the default)")
    for name, tp, _ in _engine_fields():
        flag = "--" + name.replace("_", "-")
        if tp is bool:
            engine.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None)
        else:
            engine.add_argument(flag, dest=name, type=tp, default=None)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags that were given."""
    return {name: getattr(args, name) for name, _, _ in _engine_fields() if getattr(args, name) is not None}


def make_client(kind: str, kwargs: dict[str, Any], max_waiting: int, on_step: Any = None) -> Any:
    """A started engine client of ``kind`` ("process" | "thread") over ``EngineCore(**kwargs)``."""
    if kind == "process":
        from deepinfer.engine.process_client import ProcessEngineClient

        client = ProcessEngineClient(kwargs, max_waiting=max_waiting, on_step=on_step)
    elif kind == "thread":
        from deepinfer.engine.async_client import AsyncEngineClient
        from deepinfer.engine.core import EngineCore

        client = AsyncEngineClient(EngineCore(**kwargs), max_waiting=max_waiting, on_step=on_step)
    else:
        raise ValueError(f"--engine-client must be 'process' or 'thread', got {kind!r}")
    client.start()
    return client


def bound_port(server: Any) -> int:
    """The port a started uvicorn server listens on (the one the OS picked for ``--port 0``)."""
    for srv in server.servers:
        for sock in srv.sockets:
            return int(sock.getsockname()[1])
    raise RuntimeError("uvicorn reports no listening socket")


def serve(args: argparse.Namespace) -> int:
    """Start the engine client (--engine-client), serve HTTP until interrupted."""
    import uvicorn

    from deepinfer.serve.app import build_app
    from deepinfer.serve.launch import READY_PREFIX
    from deepinfer.serve.metrics import ServeMetrics

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535] (0: a free port the OS picks), got {args.port}")
    if args.max_waiting < 1 or args.max_body_bytes < 1:
        raise ValueError("--max-waiting and --max-body-bytes must be >= 1")
    if not args.gil_switch_interval_ms > 0:
        raise ValueError(f"--gil-switch-interval-ms must be > 0, got {args.gil_switch_interval_ms}")
    # the engine thread drops the GIL in every small torch op and waits to get it back; a shorter
    # interval hands it to the HTTP loop sooner. Whether that pays is not settled: the CPU runs are in
    # README's serving section (numbers in docs/measurements.md), benchmarks/serve_h200.py decides on a GPU
    sys.setswitchinterval(args.gil_switch_interval_ms / 1000)
    logging.basicConfig(level=args.log_level.upper())
    client = make_client(args.engine_client, engine_kwargs(args), args.max_waiting)
    name = args.served_model_name or os.path.basename(os.path.normpath(str(client.model_dir)))
    metrics = ServeMetrics(name)
    client.on_step = metrics.on_step  # before the first request: no step has run yet
    app = build_app(client, metrics, name, api_key=args.api_key or None, max_body_bytes=args.max_body_bytes)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    original = server.startup

    async def startup(sockets: Any = None) -> None:
        await original(sockets)
        if server.started:
            port = bound_port(server) if args.port == 0 else args.port
            print(f"{READY_PREFIX}http://{args.host}:{port} (model {name!r})", flush=True)

    server.startup = startup  # type: ignore[method-assign]
    try:
        server.run()
    finally:
        client.shutdown()
    return 0
