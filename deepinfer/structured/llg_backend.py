"""The llguidance backend: JSON schemas that xgrammar cannot enforce exactly.

Same contract as the xgrammar path, so the rest of the engine does not know which
backend a request has:

* :func:`build_llg_tokenizer` makes llguidance's view of the vocabulary from the same
  token table as xgrammar's (``vocab.token_bytes``): equal bytes per id, the logits
  width as ``n_vocab``, ids without bytes marked special (never allowed), EOS the
  only stop token.
* :class:`LLGCompiled` is one compiled grammar (llguidance builds its lexer when the
  first matcher is made; later matchers are deep copies of that one, which is cheap).
* :class:`LLGMatcher` has the methods of ``xgrammar.GrammarMatcher`` that
  :class:`~deepinfer.structured.matcher.RequestGrammar` uses (``accept_token``,
  ``rollback``, ``is_terminated``, ``is_completed``, ``fill_next_token_bitmask``),
  writing the same int32 bitmask layout (bit ``i % 32`` of word ``i // 32`` allows
  token ``i``), which xgrammar's kernel applies to the logits.

Two behaviours differ from xgrammar's and are adapted here: a rejected token puts an
llguidance matcher into a permanent error state (so a token is checked with
``validate_tokens`` before it is consumed, and a speculative draft the grammar
rejects leaves the matcher as it was), and llguidance "stops" as soon as only EOS
can follow (so *terminated* means here what it means for xgrammar: EOS consumed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from deepinfer.errors import InvalidRequestError

if TYPE_CHECKING:
    import llguidance

__all__ = ["JSON_OPTIONS", "LLGCompiled", "LLGMatcher", "build_llg_tokenizer", "llg_grammar"]

#: The layout of deepinfer's JSON (the xgrammar path's ``any_whitespace=False``):
#: ``json.dumps`` separators, no free whitespace.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                                "lenient": False, "coerce_one_of": False}


class _TokenTable:
    """The object ``llguidance.TokenizerWrapper`` reads: token bytes, EOS, specials, encode."""

    def __init__(self, table: Sequence[bytes], eos_token_id: int, encode: Any) -> None:
        # ids with no bytes (special tokens, ids past the tokenizer) get a unique
        # placeholder and are marked special: llguidance then never allows them
        self.tokens = [t if t else f"<|deepinfer-special-{i}|>".encode() for i, t in enumerate(table)]
        self.special_token_ids = [i for i, t in enumerate(table) if not t or i == eos_token_id]
        self.eos_token_id, self.bos_token_id = eos_token_id, None
        self._encode = encode

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._encode(text))


def build_llg_tokenizer(table: Sequence[bytes], eos_token_id: int, encode: Any) -> llguidance.LLTokenizer:
    """llguidance's tokenizer over ``table`` (bytes per id, ``len(table)`` = logits width)."""
    import llguidance as llg

    wrapper = llg.TokenizerWrapper(_TokenTable(table, eos_token_id, encode))
    return llg.LLTokenizer(wrapper, n_vocab=len(table), eos_token=eos_token_id)


def llg_grammar(schema: dict, any_whitespace: bool = False) -> str:
    """llguidance grammar text for a JSON schema; raise InvalidRequestError naming llguidance's
    reason when it would not enforce the schema (unimplemented keyword, unsatisfiable schema)."""
    import llguidance as llg

    options = dict(JSON_OPTIONS)
    if any_whitespace:
        options.update(whitespace_flexible=True, item_separator=",", key_separator=":")
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)  # type: ignore[arg-type]
    except ValueError as e:
        raise InvalidRequestError(f"SamplingParams.structured_output: schema: llguidance: {e}",
                                  field="structured_output") from None
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error or messages:  # a warning means something is approximated: not exact, so refused
        raise InvalidRequestError(f"SamplingParams.structured_output: schema: llguidance: {'; '.join(messages)}",
                                  field="structured_output")
    return grammar


class LLGCompiled:
    """One compiled llguidance grammar; :meth:`new_matcher` gives a fresh matcher."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        import llguidance as llg

        self.tokenizer, self.grammar = tokenizer, grammar
        self.vocab_size, self.eos = tokenizer.vocab_size, tokenizer.eos_token
        self._template = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if self._template.is_error():
            raise InvalidRequestError(f"SamplingParams.structured_output: schema: llguidance: "
                                      f"{self._template.get_error()}", field="structured_output")

    def new_matcher(self) -> LLGMatcher:
        return LLGMatcher(self._template.deep_copy(), self.eos)


class LLGMatcher:
    """An ``llguidance.LLMatcher`` behind xgrammar's ``GrammarMatcher`` methods."""

    def __init__(self, matcher: llguidance.LLMatcher, eos: int) -> None:
        self.matcher, self.eos = matcher, eos
        self._last: list[int] = []  # consumed tokens (only whether the last is EOS matters)

    def accept_token(self, token: int) -> bool:
        """Consume ``token`` if the grammar allows it; False (state unchanged) if not."""
        if self.is_terminated():
            return False
        # EOS is allowed exactly when the output is a complete match; validate_tokens says 0
        # for it once llguidance has stopped (only EOS can follow), so it is not asked
        allowed = self.matcher.is_accepting() if token == self.eos else self.matcher.validate_tokens([token]) == 1
        if not allowed:
            return False
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"llguidance rejected token {token} it had validated: {self.matcher.get_error()}")
        self._last.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            if not self.matcher.rollback(num_tokens):
                raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: {self.matcher.get_error()}")
            del self._last[-num_tokens:]

    def is_terminated(self) -> bool:
        """EOS was consumed: nothing may follow."""
        return bool(self._last) and self._last[-1] == self.eos

    def is_completed(self) -> bool:
        """The output so far is a complete match (EOS would be accepted)."""
        return self.matcher.is_accepting()

    def fill_next_token_bitmask(self, bitmask: Any, row: int = 0) -> None:
        """Write the allowed tokens into ``bitmask[row]`` (int32 host tensor, xgrammar's layout)."""
        view = bitmask[row]
        if self.is_terminated():  # like xgrammar: nothing is allowed after EOS
            view.fill_(0)
            return
        self.matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())
        if self.matcher.is_error():
            raise RuntimeError(f"llguidance mask computation failed: {self.matcher.get_error()}")
