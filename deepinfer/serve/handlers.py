"""/v1/completions and /v1/chat/completions: checked bodies -> engine requests -> OpenAI responses.

A request with ``n`` choices is ``n`` engine requests (seed, seed + 1, ...). Streams are
Server-Sent Events (``data: {chunk}\\n\\n`` ... ``data: [DONE]``); with
``stream_options.include_usage`` a last chunk with empty ``choices`` carries the usage.
Chat text goes through deepseek-recipe's stream processor (thinking -> ``reasoning_content``,
DSML tool calls -> ``tool_calls``), as ``LLM.chat`` parses it offline.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import deepseek_recipe as dr

from deepinfer.chat.parse import _FINISH, parse_completion
from deepinfer.chat.render import render_prompt
from deepinfer.chat.requests import normalise_chat_inputs
from deepinfer.chat.runner import chat_sampling_params, replace_sampling_params
from deepinfer.engine.client_base import EngineOverloadedError, StreamingClient
from deepinfer.engine.output_processor import StreamDelta
from deepinfer.errors import InvalidRequestError
from deepinfer.sampling_params import SamplingParams
from deepinfer.serve.protocol import APIError, CommonFields, bad, common_fields, completion_params, completion_prompt
from deepinfer.structured.spec import StructuredOutputSpec

__all__ = ["Handlers"]

#: the chat fields the server handles itself (the recipe sees the rest of the body)
_SERVER_KEYS = ("n", "stream", "stream_options", "max_completion_tokens")


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Handlers:
    """The endpoints' logic over one engine client (thread or process: `StreamingClient`)."""

    def __init__(self, client: StreamingClient, model_name: str) -> None:
        self.client, self.model_name = client, model_name

    # ---- shared ------------------------------------------------------------------------
    def _check_model(self, f: CommonFields) -> None:
        if f.model is not None and f.model != self.model_name:
            raise APIError(404, f"model {f.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def _admit(self, prompt: str | None, ids: list[int] | None,
                     params: list[SamplingParams]) -> tuple[list[int], list[SamplingParams]]:
        """The engine's own admission checks, off the event loop (tokenizing, grammar compiles)."""
        try:
            return await self.client.admit(prompt, ids, params)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param=exc.field) from None

    def _submit(self, ids: list[int], params: list[SamplingParams], prompt: str | None) -> list[AsyncIterator]:
        base = uuid.uuid4().hex[:16]
        streams: list[AsyncIterator] = []
        try:
            for i, sp in enumerate(params):
                streams.append(self.client.generate(f"{base}-{i}", ids, sp, prompt))
        except EngineOverloadedError as exc:
            for i in range(len(streams)):  # choices queued before the queue filled up
                self.client.abort(f"{base}-{i}")
            raise APIError(503, str(exc), type_="server_overloaded", code="overloaded",
                           headers={"Retry-After": "1"}) from None
        return streams

    @staticmethod
    def _seeded(sp: SamplingParams, n: int) -> list[SamplingParams]:
        if n == 1:
            return [sp]
        if sp.seq_seed is None:
            return [sp] * n  # for_request() draws a fresh seed per choice
        return [replace_sampling_params(sp, seq_seed=(sp.seq_seed + i) % 2**64) for i in range(n)]

    async def _first_deltas(self, streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, StreamDelta]]:
        """Deltas of all choices, interleaved as they arrive; closing it aborts the unfinished ones."""
        if len(streams) == 1:  # one choice (nearly every request): no pump task and queue per delta
            async with aclosing(streams[0]) as only:
                async for d in only:
                    yield 0, d
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, it: AsyncIterator) -> None:
            try:
                async with aclosing(it):
                    async for d in it:
                        await queue.put((i, d))
            except BaseException as exc:  # noqa: BLE001 - re-raised on the consumer side
                await queue.put((i, exc))

        tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(streams)]
        try:
            live = len(streams)
            while live:
                i, d = await queue.get()
                if isinstance(d, BaseException):
                    raise d
                yield i, d
                if d.finished:
                    live -= 1
        finally:
            for t in tasks:
                t.cancel()

    def _token_logprobs(self, d: StreamDelta, top: int) -> list[dict[str, Any]]:
        tok = self.client.tokenizer
        out = []
        for j, t in enumerate(d.token_ids):
            s = tok.decode([t], skip_special_tokens=False)
            entry = {"token": s, "logprob": d.logprobs[j] if d.logprobs else None,
                     "bytes": list(s.encode("utf-8")), "top_logprobs": []}
            if top and d.top_logprobs:
                for tid, lp in d.top_logprobs[j][:top]:
                    ts = tok.decode([tid], skip_special_tokens=False)
                    entry["top_logprobs"].append({"token": ts, "logprob": lp, "bytes": list(ts.encode("utf-8"))})
            out.append(entry)
        return out

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict[str, Any]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # ---- /v1/completions -----------------------------------------------------------------
    async def completions(self, body: dict[str, Any]) -> tuple[dict[str, Any] | None, AsyncIterator[str] | None]:
        f = common_fields(body, chat=False, max_model_len=self.client.config.max_model_len)
        self._check_model(f)
        if body.get("echo"):
            raise bad("echo", "is not supported")
        if body.get("best_of") not in (None, 1):
            raise bad("best_of", "only 1 is supported")
        prompt, ids = completion_prompt(body)
        try:
            sp = completion_params(f, body)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param=exc.field) from None
        ids, params = await self._admit(prompt, ids, self._seeded(sp, f.n))
        streams = self._submit(ids, params, prompt)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        if f.stream:
            return None, self._completion_stream(streams, head, f, len(ids))
        texts = [""] * f.n
        lps: list[list] = [[] for _ in range(f.n)]
        finals: list[StreamDelta | None] = [None] * f.n
        async with aclosing(self._first_deltas(streams)) as deltas:
            async for i, d in deltas:
                texts[i] += d.text
                if f.logprobs:
                    lps[i].extend(self._token_logprobs(d, f.top_logprobs))
                if d.finished:
                    finals[i] = d
        choices = [{"index": i, "text": texts[i], "finish_reason": finals[i].finish_reason,
                    "logprobs": _legacy_logprobs(lps[i]) if f.logprobs else None} for i in range(f.n)]
        n_out = sum(len(d.output.token_ids) for d in finals if d is not None and d.output is not None)
        return {**head, "choices": choices, "usage": self._usage(len(ids), n_out)}, None

    async def _completion_stream(self, streams: list[AsyncIterator], head: dict, f: CommonFields,
                                 n_prompt: int) -> AsyncIterator[str]:
        n_out = 0
        async with aclosing(self._first_deltas(streams)) as deltas:
            async for i, d in deltas:
                n_out += len(d.token_ids)
                if not d.text and not d.finished:
                    continue
                choice = {"index": i, "text": d.text, "finish_reason": d.finish_reason,
                          "logprobs": _legacy_logprobs(self._token_logprobs(d, f.top_logprobs)) if f.logprobs
                          else None}
                yield sse({**head, "choices": [choice]})
        if f.include_usage:
            yield sse({**head, "choices": [], "usage": self._usage(n_prompt, n_out)})
        yield "data: [DONE]\n\n"

    # ---- /v1/chat/completions ------------------------------------------------------------
    async def chat(self, body: dict[str, Any]) -> tuple[dict[str, Any] | None, AsyncIterator[str] | None]:
        f = common_fields(body, chat=True, max_model_len=self.client.config.max_model_len)
        self._check_model(f)
        recipe_body = {k: v for k, v in body.items() if k not in _SERVER_KEYS}
        if f.max_tokens is not None:
            recipe_body["max_tokens"] = f.max_tokens
        recipe_body["model"] = self.model_name
        try:
            req = normalise_chat_inputs(recipe_body, self.client.model_config.model_type)[0]
            rendered = render_prompt(req.converted, self.client.tokenizer)
            sp = chat_sampling_params(req, None, len(rendered.token_ids), self.client.config.max_model_len)
            constraint = req.converted.inference_options.output_constraint
            if constraint is not None:
                sp = replace_sampling_params(sp, structured_output=_spec_of(constraint, req.thinking))
            if "top_k" in body:
                sp = replace_sampling_params(sp, top_k=body["top_k"])
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param=exc.field) from None
        ids, params = await self._admit(None, rendered.token_ids, self._seeded(sp, f.n))
        streams = self._submit(ids, params, None)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        if f.stream:
            return None, self._chat_stream(streams, head, f, req.converted, len(ids))
        texts = [""] * f.n
        lps: list[list] = [[] for _ in range(f.n)]
        finals: list[StreamDelta | None] = [None] * f.n
        async with aclosing(self._first_deltas(streams)) as deltas:
            async for i, d in deltas:
                texts[i] += d.text
                if f.logprobs:
                    lps[i].extend(self._token_logprobs(d, f.top_logprobs))
                if d.finished:
                    finals[i] = d
        choices, n_out = [], 0
        for i, d in enumerate(finals):
            out = d.output if d is not None else None
            n_out += len(out.token_ids) if out is not None else 0
            parsed = parse_completion(req.converted, texts[i], d.finish_reason if d else "abort",
                                      len(out.token_ids) if out else 0, len(ids))
            choices.append({"index": i, "message": parsed.to_message(), "finish_reason": parsed.finish_reason,
                            "logprobs": {"content": lps[i]} if f.logprobs else None})
        return {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": self._usage(len(ids), n_out)}, None

    async def _chat_stream(self, streams: list[AsyncIterator], head: dict, f: CommonFields, converted: Any,
                           n_prompt: int) -> AsyncIterator[str]:
        procs = []
        for _ in range(f.n):
            gen = dr.ChatCompletionRequest.chunk_generator(converted, head["id"], self.model_name)
            proc = dr.StreamProcessor(gen, converted.parsing_options, None)
            procs.append([proc, proc.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(
                prompt_tokens=n_prompt)))])
        n_out = 0
        async with aclosing(self._first_deltas(streams)) as deltas:
            async for i, d in deltas:
                n_out += len(d.token_ids)
                proc, chunks = procs[i]
                procs[i][1] = []
                if d.text and not proc.finished:
                    chunks += proc.push(dr.InferenceChunk.text(d.text, len(d.token_ids)))
                if d.finished:
                    if not proc.finished:
                        chunks += proc.push(dr.InferenceChunk.finish(_FINISH[d.finish_reason]))
                    chunks += proc.finish()
                logprobs = {"content": self._token_logprobs(d, f.top_logprobs)} if f.logprobs else None
                for k, chunk in enumerate(chunks):
                    c = json.loads(chunk.to_json())
                    c.pop("usage", None)
                    for choice in c["choices"]:
                        choice["index"] = i
                        if logprobs is not None and k == len(chunks) - 1:
                            choice["logprobs"] = logprobs
                    yield sse({**head, "choices": c["choices"]})
        if f.include_usage:
            yield sse({**head, "choices": [], "usage": self._usage(n_prompt, n_out)})
        yield "data: [DONE]\n\n"


def _spec_of(constraint: Any, thinking: bool) -> StructuredOutputSpec:
    """response_format as the engine's structured-output spec; in thinking mode the grammar
    starts after ``</think>`` (the answer), as the recipe parses it."""
    trigger = "</think>" if thinking else None
    kind, schema = str(constraint.kind), constraint.schema
    if kind == "json":
        return (StructuredOutputSpec("json", schema, trigger=trigger) if schema
                else StructuredOutputSpec("json_object", trigger=trigger))
    if kind == "regex":
        return StructuredOutputSpec("regex", schema, trigger=trigger)
    raise InvalidRequestError(f"response_format of kind {kind!r} is not supported (json_schema, json_object)",
                              field="response_format")


def _legacy_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The completions API's logprobs object from per-token entries."""
    offset, offsets = 0, []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}

