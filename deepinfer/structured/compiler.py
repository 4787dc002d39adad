"""Grammar compilation off the step loop: a thread pool with a cache keyed by the spec.

Two stages, on purpose:

1. :meth:`GrammarCompilerPool.check` runs on the caller's thread at admission:
   deepinfer's own checks (``checks.py``) plus xgrammar's *parser* (``Grammar.from_*``,
   milliseconds, no vocabulary work), so an invalid or unsupported spec raises
   ``InvalidRequestError`` before any request of the call is queued.
2. :meth:`GrammarCompilerPool.submit` returns a ``Future`` of the compiled grammar
   (the token-mask precomputation over the whole vocabulary, the slow part). The
   engine keeps the request out of the scheduler until the future is done, so one
   slow grammar never stalls the step loop or the other requests.

Futures are cached by ``StructuredOutputSpec.cache_key()`` (LRU, ``max_cached``
entries), so a batch of requests with one schema compiles it once.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from deepinfer.errors import InvalidRequestError
from deepinfer.structured.checks import check_json_schema, check_regex
from deepinfer.structured.spec import StructuredOutputSpec

if TYPE_CHECKING:
    import xgrammar

__all__ = ["GrammarCompilerPool", "clean_xgrammar_error"]

_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


# xgrammar (0.2.x) writes the characters of length-bounded JSON strings (minLength /
# maxLength) as [^"\\\r\n], which admits raw control characters: invalid JSON (RFC 8259
# wants them escaped) that strict parsers reject. Its unbounded strings already exclude
# them; bounded ones get the same class.
_BOUNDED_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\r\\n]'


def valid_json_strings(ebnf: str) -> str:
    """A converted JSON-schema grammar (EBNF text) whose string characters are all legal JSON."""
    return ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


def clean_xgrammar_error(error: BaseException) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix."""
    return _LOG_PREFIX.sub("", str(error).strip())


class GrammarCompilerPool:
    """Owns one ``xgrammar.GrammarCompiler`` and the worker threads that use it."""

    def __init__(self, tokenizer_info: xgrammar.TokenizerInfo, max_workers: int = 2, max_cached: int = 256) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        # xgrammar's compiler is thread-safe; its own cache is off: ours keys by spec.
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_workers, cache_enabled=False)
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="deepinfer-grammar")
        self.max_cached = max_cached
        self._futures: OrderedDict[tuple, Future] = OrderedDict()

    # ----------------------------------------------------------- admission
    def prepare(self, spec: StructuredOutputSpec) -> tuple[str, Any]:
        """deepinfer's checks; returns (kind, what to hand xgrammar) with regexes rewritten."""
        if spec.kind in ("json", "json_object"):
            return spec.kind, check_json_schema(spec.schema_dict)
        if spec.kind == "regex":
            return "regex", check_regex(str(spec.schema))
        return "ebnf", spec.schema

    def check(self, spec: StructuredOutputSpec) -> None:
        """Raise InvalidRequestError if ``spec`` is unsupported or does not parse."""
        if spec.cache_key() in self._futures:
            return  # parsed (and compiled or compiling) already
        kind, source = self.prepare(spec)
        try:
            if kind in ("json", "json_object"):
                self._xgr.Grammar.from_json_schema(source, **self._json_options(spec))
            elif kind == "regex":
                self._xgr.Grammar.from_regex(source)
            elif kind == "ebnf":
                self._xgr.Grammar.from_ebnf(source)
        except RuntimeError as e:
            raise InvalidRequestError(f"SamplingParams.structured_output: invalid {kind}: "
                                      f"{clean_xgrammar_error(e)}", field="structured_output") from None

    @staticmethod
    def _json_options(spec: StructuredOutputSpec) -> dict[str, Any]:
        # strict_mode: no properties/items beyond the schema's (output stays valid;
        # it only narrows what "additional" allows by default). json_object keeps any keys.
        return {"any_whitespace": spec.any_whitespace, "strict_mode": spec.kind == "json"}

    # --------------------------------------------------------- compilation
    def _compile(self, spec: StructuredOutputSpec) -> xgrammar.CompiledGrammar:
        kind, source = self.prepare(spec)
        if kind in ("json", "json_object"):
            grammar = self._xgr.Grammar.from_json_schema(source, **self._json_options(spec))
            return self.compiler.compile_grammar(valid_json_strings(str(grammar)))
        if kind == "regex":
            return self.compiler.compile_regex(source)
        return self.compiler.compile_grammar(source)

    def submit(self, spec: StructuredOutputSpec) -> Future:
        """Future of the compiled grammar for ``spec`` (shared with earlier equal specs)."""
        key = spec.cache_key()
        fut = self._futures.get(key)
        if fut is not None and not (fut.cancelled() or (fut.done() and fut.exception() is not None)):
            self._futures.move_to_end(key)
            return fut
        fut = self.pool.submit(self._compile, spec)
        self._futures[key] = fut
        while len(self._futures) > self.max_cached:
            self._futures.popitem(last=False)  # running futures stay alive with their requests
        return fut

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
