"""Output processing: detokenization, stop strings, stream deltas and final RequestOutputs.

The engine core hands every step's touched requests here. Per request one
:class:`~deepinfer.detokenizer.IncrementalDetokenizer` turns new token ids into text:

* a streamed request (``stream=True``, the server) is detokenized every step and gets a
  :class:`StreamDelta` with the new text, ids and logprobs; with ``stream_text=False`` (the
  process client, which detokenizes in the server's process, off the engine's step) its
  deltas carry ids and logprobs only, and its text is decoded once, for the final output;
* an offline request (``LLM.generate``) is detokenized while generating only when it has
  stop strings (the text is needed to find them), else once, when its output is built,
  and gets a delta only when it finishes (enough to move a progress bar).

A stop string that matches is reported back through ``finish`` (the scheduler frees the
request's blocks at once); the text is cut there, exactly as the offline output is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from deepinfer.detokenizer import IncrementalDetokenizer
from deepinfer.engine.request import Request
from deepinfer.outputs import RequestMetrics, RequestOutput

__all__ = ["OutputProcessor", "StreamDelta"]


@dataclass
class StreamDelta:
    """What one step added to one request (the final delta carries the whole output)."""

    request_id: str
    text: str  # new text since the previous delta (held-back stop-string prefixes excluded)
    token_ids: list[int]  # new output token ids
    logprobs: list[float] | None = None  # one per new token when the request asked for logprobs
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last delta
    stop_reason: int | str | None = None
    output: RequestOutput | None = None  # the full RequestOutput, on the last delta only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __reduce__(self) -> tuple:
        # pickled as its fields' tuple: a served engine sends one delta per stream per step to the
        # API process, and the default (a dict of attributes per object) costs ~2x to pickle and unpickle
        return (StreamDelta, (self.request_id, self.text, self.token_ids, self.logprobs, self.top_logprobs,
                              self.finish_reason, self.stop_reason, self.output))


@dataclass
class _State:
    req: Request
    prompt: str | None
    detok: IncrementalDetokenizer
    stream: bool
    stream_text: bool = True  # streamed deltas carry their text (else ids only; the client decodes)
    sent_tokens: int = 0  # output ids already reported in deltas (stream mode)


class OutputProcessor:
    """Per-request detokenizers and the deltas / outputs built from them."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def add(self, req: Request, prompt: str | None, stream: bool = False, stream_text: bool = True) -> None:
        """Track ``req`` from now on (before it can be scheduled). ``stream_text=False``: its
        deltas carry no text (stop strings still need it: such a request keeps its text here)."""
        sp = req.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, sp.skip_special_tokens, sp.stop,
                                       sp.include_stop_str_in_output)
        self._states[req.req_id] = _State(req, prompt, detok, stream, stream_text or bool(detok.stop))

    def process(self, touched: list[Request],
                finish: Callable[[str, str, str], None]) -> list[StreamDelta]:
        """Detokenize / check stop strings for the requests a step touched. ``finish(req_id,
        reason, stop_string)`` ends a request whose stop string matched (before its delta is
        built, so the delta is its last)."""
        deltas: list[StreamDelta] = []
        for req in touched:
            st = self._states.get(req.req_id)
            if st is None:
                continue
            detok = st.detok
            text = ""
            # offline requests without stop strings are decoded once, in output(): no text per step
            if not detok.finished and ((st.stream and st.stream_text) or detok.stop):
                text = detok.update(req.output_token_ids[len(detok.token_ids):])
                if detok.stopped_by is not None and not req.is_finished:
                    finish(req.req_id, "stop", detok.stopped_by)
            if st.stream:
                deltas.append(self._delta(st, text))
            elif req.is_finished:
                deltas.append(StreamDelta(req.req_id, "", [], finish_reason=req.finish_reason,
                                          stop_reason=req.stop_reason))
        return deltas

    def _delta(self, st: _State, text: str) -> StreamDelta:
        req, start = st.req, st.sent_tokens
        new = req.output_token_ids[start:]  # slices: already copies
        st.sent_tokens = len(req.output_token_ids)
        lps = req.output_logprobs[start:] if req.output_logprobs else None
        tops = (req.output_top_logprobs[start:] if req.output_top_logprobs and req.sampling_params.top_logprobs
                else None)
        delta = StreamDelta(req.req_id, text, new, lps, tops)
        if req.is_finished:
            if st.stream_text:
                if not st.detok.finished:
                    delta.text += st.detok.update(req.output_token_ids[len(st.detok.token_ids):])
                delta.text += st.detok.finish()
            delta.finish_reason, delta.stop_reason = req.finish_reason, req.stop_reason
            delta.output = self.output(req.req_id)
        return delta

    def aborted(self, req: Request) -> StreamDelta | None:
        """The last delta of a request ended from outside (abort); None if it is not tracked."""
        st = self._states.get(req.req_id)
        if st is None:
            return None
        if st.stream:
            return self._delta(st, "")
        return StreamDelta(req.req_id, "", [], finish_reason=req.finish_reason, stop_reason=req.stop_reason,
                           output=self.output(req.req_id))

    def output(self, req_id: str) -> RequestOutput:
        """The finished RequestOutput of ``req_id``; the request is no longer tracked."""
        st = self._states.pop(req_id)
        req, detok = st.req, st.detok
        if not detok.finished:
            detok.update(req.output_token_ids[len(detok.token_ids):])
        detok.finish()
        sp = req.sampling_params
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time,
                                 req.finished_time, req.num_prompt_tokens, req.num_cached_tokens,
                                 req.num_output_tokens, req.num_preemptions)
        return RequestOutput(
            request_id=req.req_id, prompt=st.prompt, prompt_token_ids=req.prompt_token_ids.tolist(), text=detok.text,
            token_ids=list(req.output_token_ids), finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            seq_seed=sp.seq_seed, logprobs=list(req.output_logprobs) or None,
            top_logprobs=list(req.output_top_logprobs) if sp.top_logprobs else None, metrics=metrics)

    def drop(self, req_id: str) -> None:
        """Forget ``req_id`` (its output will not be asked for)."""
        self._states.pop(req_id, None)
