"""``check_structured``: the structured-output part of pre-queue request validation.

Everything about a request's structured-output spec that can be decided without the
model's vocabulary, on the caller's thread and before anything is queued: the spec's
shape (already checked by ``SamplingParams``), deepinfer's schema rules (contradictions,
keyword interactions, formats), the backend choice and that backend's parser
(``backends.plan_spec``). xgrammar's "Check failed" and llguidance's compile errors
surface here as ``InvalidRequestError`` on ``structured_output`` naming the keyword and
its JSON path. Token-level parts (the trigger's ids, the vocabulary-wide compilation)
are checked by the engine's ``StructuredOutputManager``.
"""

from __future__ import annotations

from typing import Any

from deepinfer.errors import InvalidRequestError
from deepinfer.structured.spec import StructuredOutputSpec

__all__ = ["check_structured"]


def check_structured(params: Any, mode: str | None = None, vocab_size: int | None = None) -> None:
    """Raise InvalidRequestError (field ``structured_output``) if ``params`` (a SamplingParams)
    asks for output no allowed backend can enforce exactly; None when it has no spec.

    Args:
        params: the request's SamplingParams (``structured_output`` is already a spec).
        mode: "auto" | "xgrammar" | "llguidance"; default DEEPINFER_STRUCTURED_BACKEND.
        vocab_size: when given, token-id triggers must lie in ``[0, vocab_size)``.
    """
    spec = getattr(params, "structured_output", None)
    if spec is None:
        return
    if not isinstance(spec, StructuredOutputSpec):
        raise InvalidRequestError(f"SamplingParams.structured_output: expected a StructuredOutputSpec after "
                                  f"validation, got {type(spec).__name__}", field="structured_output")
    from deepinfer.structured.backends import plan_spec

    plan = plan_spec(spec, mode)
    if plan.backend == "xgrammar" and plan.kind == "regex":  # an EBNF is parsed (and checked) by plan_spec
        import xgrammar as xgr

        from deepinfer.structured.backends import clean_xgrammar_error

        try:
            xgr.Grammar.from_regex(plan.source)
        except RuntimeError as e:
            raise InvalidRequestError(f"SamplingParams.structured_output: invalid {plan.kind}: "
                                      f"{clean_xgrammar_error(e)}", field="structured_output") from None
    trigger = spec.trigger
    if vocab_size is not None and isinstance(trigger, tuple) and any(not 0 <= t < vocab_size for t in trigger):
        raise InvalidRequestError(f"SamplingParams.structured_output: trigger token ids {trigger} must lie in "
                                  f"[0, {vocab_size})", field="structured_output")
