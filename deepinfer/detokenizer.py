"""Incremental (streaming) detokenization with stop-string handling.

Byte-level BPE splits many characters (most emoji, rare CJK ideographs) over
several tokens, so decoding tokens one at a time would yield broken UTF-8.
Following vLLM / TGI, two offsets into the full id list (prompt + output) are
kept:

* ``read_offset``: ids before it have already been turned into text;
* ``prefix_offset``: a few ids before ``read_offset`` used as decoding context
  (so a decoder that treats the first token specially, e.g. a leading-space
  rule, sees the same context as a full decode would).

Each step decodes ``ids[prefix_offset:read_offset]`` and
``ids[prefix_offset:]``; the difference is new text, taken only when the
longer decode does not end in U+FFFD (an incomplete character). Because
UTF-8 is self-synchronising and ``read_offset`` only ever lands after a
complete character, the concatenated deltas equal a one-shot decode.

Stop strings are looked for in the output text (so they may span token
boundaries). The first occurrence (the one that *completes* first; ties go to
the one that starts first) ends the output: the text is cut before it, or
after it with ``include_stop_str_in_output``. While streaming, the longest
tail of the text that is a proper prefix of some stop string is held back, so
no part of a stop string is ever emitted and then "taken back"; the final text
(the concatenation of all deltas) is exact.

Typical engine use::

    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["\\n\\n"])
    for new_ids in steps:                 # ids sampled this step
        delta = detok.update(new_ids)     # stream `delta` to the client
        if detok.stopped_by is not None:  # a stop string ended the output
            break
    else:
        delta = detok.finish()            # EOS / length: flush held-back text
"""

from __future__ import annotations

import operator
from typing import Iterable, Protocol, Sequence

__all__ = ["IncrementalDetokenizer", "INITIAL_CONTEXT_TOKENS"]

REPLACEMENT_CHAR = "\ufffd"
# Number of prompt tokens used as decoding context for the first output token.
INITIAL_CONTEXT_TOKENS = 5


class _Decoder(Protocol):  # deepinfer.tokenizer.Tokenizer or a raw tokenizers.Tokenizer
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Streams the text of one request's output tokens.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)``
            (a :class:`deepinfer.tokenizer.Tokenizer`, or a raw
            ``tokenizers.Tokenizer``).
        prompt_ids: the prompt's ids; only their last few are used, as context.
        skip_special_tokens: drop special tokens (BOS/EOS/pad...) from the text.
        stop: stop strings (non-empty); None or [] for none.
        include_stop_str_in_output: keep the matched stop string in the text.

    Attributes:
        text: the output text decoded so far (complete characters only; cut
            at the stop string once one matched). It may run ahead of what
            :meth:`update` has returned by the held-back tail.
        stopped_by: the stop string that ended the output, else None.
        finished: True once a stop string matched or :meth:`finish` was called;
            later :meth:`update` calls are ignored and return "".
        token_ids: the output ids passed to :meth:`update` (all of them, also
            those after a stop string within the same call).
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        stop: Iterable[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        stop_list = [] if stop is None else ([stop] if isinstance(stop, str) else list(stop))
        for s in stop_list:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        # dedupe, keep order
        self.stop: list[str] = list(dict.fromkeys(stop_list))
        self.include_stop_str_in_output = include_stop_str_in_output

        self.text: str = ""
        self.stopped_by: str | None = None
        self.finished: bool = False
        self.token_ids: list[int] = []

        # only the prompt's last few ids are ever decoded: copying the rest would cost O(prompt)
        self._ids: list[int] = [int(i) for i in prompt_ids[max(0, len(prompt_ids) - INITIAL_CONTEXT_TOKENS):]]
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - INITIAL_CONTEXT_TOKENS, 0)
        if self._prefix_offset < self._read_offset:
            context = self._decode(self._ids[self._prefix_offset : self._read_offset])
            if context.endswith(REPLACEMENT_CHAR):
                # The prompt ends inside a character: its last bytes cannot
                # be completed by output bytes without also rewriting prompt
                # text, so decode the output on its own.
                self._prefix_offset = self._read_offset
        self._emitted = 0  # chars of self.text already returned

    # ----------------------------------------------------------------- API
    def update(self, new_token_ids: int | Iterable[int]) -> str:
        """Feed newly generated ids; return the new text that is safe to stream."""
        try:
            new = [operator.index(new_token_ids)]  # a single id
        except TypeError:
            new = [int(i) for i in new_token_ids]  # type: ignore[union-attr]
        if self.finished:
            return ""
        if not new:
            return ""
        self.token_ids.extend(new)
        self._ids.extend(new)
        self._advance(final=False)
        return self._take_delta()

    def finish(self) -> str:
        """End of generation (EOS, length...): return everything not yet returned.

        Ids still waiting to complete a character are decoded as they are
        (U+FFFD for the incomplete bytes, as a full decode would give).
        Idempotent.
        """
        if not self.finished:
            if self._read_offset < len(self._ids):
                self._advance(final=True)
            self.finished = True
        return self._take_delta()

    @property
    def output_text(self) -> str:
        """Alias of :attr:`text`."""
        return self.text

    @property
    def pending_text(self) -> str:
        """Text decoded but held back because it could start a stop string."""
        return self.text[self._emitted :]

    # ----------------------------------------------------------- internals
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, final: bool) -> None:
        ids = self._ids
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        if not final and (new_text.endswith(REPLACEMENT_CHAR) or len(new_text) < len(prefix_text)):
            return  # incomplete character at the end: wait for more bytes
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        if not delta:
            return
        before = len(self.text)
        self.text += delta
        if self.stop:
            self._check_stop(before)

    def _check_stop(self, before: int) -> None:
        """Look for a stop string ending after position ``before`` of self.text."""
        text = self.text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stop:
            pos = text.find(s, max(0, before - len(s) + 1))
            if pos >= 0:
                cand = (pos + len(s), pos, s)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is None:
            return
        end, start, s = best
        self.text = text[: end if self.include_stop_str_in_output else start]
        self.stopped_by = s
        self.finished = True

    def _holdback(self) -> int:
        """Length of the longest tail of self.text that is a proper prefix of a stop string."""
        text = self.text
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def _take_delta(self) -> str:
        end = len(self.text)
        if not self.finished and self.stop:
            end = max(self._emitted, end - self._holdback())
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def __repr__(self) -> str:
        return (
            f"IncrementalDetokenizer(n_tokens={len(self.token_ids)}, text={self.text!r}, "
            f"stopped_by={self.stopped_by!r}, finished={self.finished})"
        )
