"""The FastAPI application of `deepinfer serve`.

Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health``,
``/metrics``. Around every route: the body size limit (413), the optional Bearer key
(401 on ``/v1/*``), and one error shape: any failure answers
``{"error": {"message", "type", "param", "code"}}`` with its status (400 for a bad body,
naming the field; 503 + Retry-After when the waiting queue is full), and the server keeps
serving. A client that disconnects mid-stream closes the stream's generator, which aborts
its engine requests (their KV blocks are freed before the engine's next step).
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deepinfer.engine.async_client import AsyncEngineClient, EngineDeadError
from deepinfer.serve.handlers import Handlers
from deepinfer.serve.metrics import ServeMetrics
from deepinfer.serve.protocol import APIError, parse_body

__all__ = ["build_app"]

logger = logging.getLogger(__name__)


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def build_app(client: AsyncEngineClient, metrics: ServeMetrics, model_name: str, api_key: str | None = None,
              max_body_bytes: int = 4 * 2**20) -> FastAPI:
    """The app over a started client (the caller owns the client's lifetime)."""
    app = FastAPI(title="deepinfer", docs_url=None, redoc_url=None)
    handlers = Handlers(client, model_name)
    created = int(time.time())

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        if api_key is not None and request.url.path.startswith("/v1/"):
            auth = request.headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), api_key):
                return _error(APIError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                                       type_="authentication_error", code="invalid_api_key"))
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            return _error(APIError(413, f"the request body has {length} bytes; the limit is {max_body_bytes} "
                                        f"(--max-body-bytes)", param="body"))
        return await call_next(request)

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
            body, stream = await endpoint(await body_of(request))
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
                                            "max_model_len": client.core.config.max_model_len,
                                            "vocab_size": client.core.model_config.vocab_size}]}

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
