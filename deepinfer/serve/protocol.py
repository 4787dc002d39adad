"""OpenAI request bodies -> engine inputs, and OpenAI-style errors.

Every field the server reads is checked here with its allowed range, so a malformed body
gets a 400 whose ``error.param`` names the field (what the official clients surface),
never a 500 and never a stuck request. Chat bodies are then converted by deepseek-recipe
(`deepinfer.chat`), which checks the conversation itself.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from deepinfer.sampling_params import SamplingParams

__all__ = ["APIError", "CommonFields", "parse_body", "common_fields", "completion_prompt"]

#: the most choices one request may ask for (n); each is one engine request
MAX_N = 16
#: the most top logprobs per token (the engine's SamplingParams.top_logprobs limit)
MAX_TOP_LOGPROBS = 20


class APIError(Exception):
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}`` with a status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", param="body") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", param="body")
    return body


def _int(body: dict, name: str, lo: int, hi: int | None, default: Any) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise bad(name, f"must be an integer in {rng}, got {v!r}")
    return v


def _float(body: dict, name: str, lo: float, hi: float, default: Any) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise bad(name, f"must be a number in [{lo}, {hi}], got {v!r}")
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"must be true or false, got {v!r}")
    return v


@dataclass
class CommonFields:
    """Fields both endpoints share, checked."""

    model: str | None
    n: int
    stream: bool
    include_usage: bool
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    seed: int | None
    stop: list[str]
    logprobs: bool
    top_logprobs: int


def common_fields(body: dict[str, Any], chat: bool, max_model_len: int) -> CommonFields:
    """Check the shared fields of a completions / chat body (ranges in the messages)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"must be a string, got {model!r}")
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options", f"must be an object, got {opts!r}")
        if not stream:
            raise bad("stream_options", "is only allowed when stream is true")
        include_usage = _bool(opts, "include_usage", False)
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop):
        stops = list(stop)
    else:
        raise bad("stop", f"must be a non-empty string or a list of at most 4 of them, got {stop!r}")
    if chat:
        logprobs = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0)
        if top and not logprobs:
            raise bad("top_logprobs", "needs logprobs: true")
    else:  # the legacy API: logprobs is the number of top tokens
        top = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS - 0, None)
        logprobs, top = top is not None, top or 0
    max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    return CommonFields(
        model=model, n=_int(body, "n", 1, MAX_N, 1), stream=stream, include_usage=include_usage,
        max_tokens=_int(body, max_key, 1, max_model_len, None),
        temperature=_float(body, "temperature", 0.0, 2.0, None), top_p=_float(body, "top_p", 1e-9, 1.0, None),
        seed=_int(body, "seed", 0, 2**64 - 1, None), stop=stops, logprobs=logprobs, top_logprobs=top)


def completion_prompt(body: dict[str, Any]) -> tuple[str | None, list[int] | None]:
    """``prompt`` of a completions body: text, or token ids (one prompt per request here)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p:
            raise bad("prompt", "must not be empty")
        return p, None
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return None, list(p)
    raise bad("prompt", f"must be a non-empty string or a list of token ids (one prompt), got {p!r:.80}")


def completion_params(f: CommonFields, body: dict[str, Any]) -> SamplingParams:
    """The engine SamplingParams of a completions body (OpenAI defaults: temperature 1, 16 tokens)."""
    top_k = _int(body, "top_k", -1, None, -1)  # vLLM's extension, accepted the same way
    if top_k == 0:
        raise bad("top_k", "must be -1 (off) or >= 1, got 0")
    return SamplingParams(temperature=1.0 if f.temperature is None else f.temperature,
                          top_p=1.0 if f.top_p is None else f.top_p, top_k=top_k,
                          max_tokens=16 if f.max_tokens is None else f.max_tokens, stop=f.stop or None,
                          seq_seed=f.seed, top_logprobs=f.top_logprobs,
                          ignore_eos=_bool(body, "ignore_eos", False))
