"""Grammar compilation off the step loop: a thread pool with a cache keyed by the spec.

Two stages, on purpose:

1. :meth:`GrammarCompilerPool.check` runs on the caller's thread at admission:
   ``backends.plan_spec`` (deepinfer's own rules, the backend choice and that backend's
   *parser*: milliseconds, no vocabulary work), so an invalid or unsupported spec raises
   ``InvalidRequestError`` before any request of the call is queued.
2. :meth:`GrammarCompilerPool.submit` returns a ``Future`` of the compiled grammar
   (the token-mask precomputation over the whole vocabulary, the slow part). The
   engine keeps the request out of the scheduler until the future is done, so one
   slow grammar never stalls the step loop or the other requests.

Futures are cached by ``StructuredOutputSpec.cache_key()`` (LRU, ``max_cached``
entries), so a batch of requests with one schema compiles it once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from deepinfer.errors import InvalidRequestError
from deepinfer.structured.backends import (GrammarPlan, backend_mode, clean_xgrammar_error, plan_spec,
                                           xgrammar_json_options)
from deepinfer.structured.spec import StructuredOutputSpec

if TYPE_CHECKING:
    import llguidance
    import xgrammar

__all__ = ["GrammarCompilerPool", "clean_xgrammar_error", "xgrammar_json_options"]

# xgrammar (0.2.x) writes the characters of length-bounded JSON strings (minLength /
# maxLength) as [^"\\\r\n], which admits raw control characters: invalid JSON (RFC 8259
# wants them escaped) that strict parsers reject. Its unbounded strings already exclude
# them; bounded ones get the same class.
_BOUNDED_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\r\\n]'


def valid_json_strings(ebnf: str) -> str:
    """A converted JSON-schema grammar (EBNF text) whose string characters are all legal JSON."""
    return ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


class GrammarCompilerPool:
    """Owns one ``xgrammar.GrammarCompiler``, llguidance's tokenizer (built on first use,
    from ``llg_tokenizer``) and the worker threads that compile with them.

    ``mode`` ("auto" | "xgrammar" | "llguidance"; default DEEPINFER_STRUCTURED_BACKEND at
    construction) is the backend policy of ``backends.plan_spec``."""

    def __init__(self, tokenizer_info: xgrammar.TokenizerInfo, max_workers: int = 2, max_cached: int = 256,
                 llg_tokenizer: Callable[[], llguidance.LLTokenizer] | None = None, mode: str | None = None) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.mode = backend_mode(mode)
        self._llg_factory, self._llg_tokenizer = llg_tokenizer, None
        self._plans: OrderedDict[tuple, GrammarPlan] = OrderedDict()
        # xgrammar's compiler is thread-safe; its own cache is off: ours keys by spec.
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_workers, cache_enabled=False)
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="deepinfer-grammar")
        self.max_cached = max_cached
        self._futures: OrderedDict[tuple, Future] = OrderedDict()

    # ----------------------------------------------------------- admission
    def plan(self, spec: StructuredOutputSpec) -> GrammarPlan:
        """The backend and source of ``spec`` (checked; cached by the spec's key)."""
        key = spec.cache_key()
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = plan_spec(spec, self.mode)
            while len(self._plans) > self.max_cached:
                self._plans.popitem(last=False)
        return plan

    def check(self, spec: StructuredOutputSpec) -> None:
        """Raise InvalidRequestError if no allowed backend enforces ``spec`` exactly (or it does not parse)."""
        if spec.cache_key() in self._futures:
            return  # parsed (and compiled or compiling) already
        try:
            plan = self.plan(spec)
            if plan.backend == "xgrammar" and plan.kind == "regex":  # an EBNF is parsed by plan_spec
                self._xgr.Grammar.from_regex(plan.source)
        except RuntimeError as e:
            raise InvalidRequestError(f"SamplingParams.structured_output: invalid {spec.kind}: "
                                      f"{clean_xgrammar_error(e)}", field="structured_output") from None

    def llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._llg_tokenizer is None:
            if self._llg_factory is None:
                raise RuntimeError("this GrammarCompilerPool was built without an llguidance tokenizer")
            self._llg_tokenizer = self._llg_factory()
        return self._llg_tokenizer

    # --------------------------------------------------------- compilation
    def _compile(self, spec: StructuredOutputSpec) -> Any:
        """xgrammar.CompiledGrammar or llg_backend.LLGCompiled."""
        plan = self.plan(spec)
        if plan.backend == "llguidance":
            from deepinfer.structured.llg_backend import LLGCompiled

            return LLGCompiled(self.llg_tokenizer(), plan.source)
        if plan.kind in ("json", "json_object"):
            grammar = self._xgr.Grammar.from_json_schema(plan.source, **xgrammar_json_options(spec))
            return self.compiler.compile_grammar(valid_json_strings(str(grammar)))
        if plan.kind == "regex":
            return self.compiler.compile_regex(plan.source)
        return self.compiler.compile_grammar(plan.source)

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
