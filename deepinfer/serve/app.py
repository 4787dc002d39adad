"""The FastAPI application of `deepinfer serve`.

Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health``,
``/metrics``. Around every route: the body size limit (413), the optional Bearer key
(401 on ``/v1/*``), and one error shape: any failure answers
``{"error": {"message", "type", "param", "code"}}`` with its status (400 for a bad body,
naming the field; 503 + Retry-After when the waiting queue is full), and the server keeps
serving. A client that disconnects (mid-stream, or while a non-streamed answer is being
generated) aborts its engine requests: their KV blocks are freed before the engine's next step.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deepinfer.engine.client_base import EngineDeadError, StreamingClient
from deepinfer.serve.handlers import Handlers
from deepinfer.serve.metrics import ServeMetrics
from deepinfer.serve.protocol import APIError, parse_body

__all__ = ["build_app"]

logger = logging.getLogger(__name__)


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


class _Guard:
    """Auth and the declared body size, before a route runs. Plain ASGI (not Starlette's
    BaseHTTPMiddleware, under which ``Request.is_disconnected`` never sees a disconnect)."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            error = self._check(scope)
            if error is not None:
                await _error(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, scope: dict) -> APIError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"].startswith("/v1/"):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                return APIError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                                type_="authentication_error", code="invalid_api_key")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return APIError(413, f"the request body has {length} bytes; the limit is {self.max_body_bytes} "
                                 f"(--max-body-bytes)", param="body")
        return None


def build_app(client: StreamingClient, metrics: ServeMetrics, model_name: str, api_key: str | None = None,
              max_body_bytes: int = 4 * 2**20) -> FastAPI:
    """The app over a started client (the caller owns the client's lifetime)."""
    app = FastAPI(title="deepinfer", docs_url=None, redoc_url=None)
    handlers = Handlers(client, model_name)
    created = int(time.time())

    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    async def body_of(request: Request) -> dict[str, Any]:
        raw = b""
        async for chunk in request.stream():  # also bounds bodies sent without Content-Length
            raw += chunk
            if len(raw) > max_body_bytes:
                raise APIError(413, f"the request body exceeds the limit of {max_body_bytes} bytes "
                                    f"(--max-body-bytes)", param="body")
        return parse_body(raw)

    async def run(request: Request, endpoint: Any) -> Response:
        try:
            task = asyncio.ensure_future(endpoint(await body_of(request)))
            # a non-streamed answer is computed here: a client that leaves meanwhile cancels it,
            # which closes its delta streams and so aborts its engine requests
            while not (await asyncio.wait({task}, timeout=0.25))[0]:
                if await request.is_disconnected():
                    task.cancel()
                    return Response(status_code=499)
            body, stream = task.result()
        except APIError as exc:
            return _error(exc)
        except EngineDeadError as exc:
            return _error(APIError(500, str(exc), type_="server_error"))
        if stream is not None:
            return StreamingResponse(stream, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(body)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run(request, handlers.completions)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await run(request, handlers.chat)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "deepinfer",
                                            "max_model_len": client.config.max_model_len,
                                            "vocab_size": client.model_config.vocab_size}]}

    @app.get("/health")
    async def health() -> Response:
        if not client.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return _error(APIError(500, f"{type(exc).__name__}: {exc}", type_="server_error"))

    return app
