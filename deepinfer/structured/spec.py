"""What a request asks to be constrained to: :class:`StructuredOutputSpec`.

Two spellings reach the same spec (both validated cheaply, in
``SamplingParams.__post_init__``; nothing here imports xgrammar):

* ``SamplingParams(structured_output=...)`` with a spec object or a dict holding
  exactly one of ``{"json": schema}`` (dict or JSON text), ``{"regex": "..."}``,
  ``{"ebnf": "..."}`` or ``{"json_object": True}`` (any JSON object), plus the
  optional keys ``"trigger"`` and ``"any_whitespace"``;
* DeepInfer's ``so_args={"schema_type": "json"|"regex"|"ebnf", "schema": ...,
  "trigger": ...}``.

``trigger`` (a string, tokenized at admission, or a list of token ids) switches
the grammar on only once that token sequence has appeared in the output (e.g.
``"</think>"``); before it, generation is unconstrained.

Whether the schema/regex/grammar is *supported* is decided at admission by
:mod:`deepinfer.structured.checks` and xgrammar's parser (see ``manager.py``).
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from typing import Any

from deepinfer.errors import InvalidRequestError

__all__ = ["StructuredOutputSpec", "SPEC_KINDS", "spec_from_params"]

#: The constraint kinds; ``json_object`` means "any JSON object" (no schema).
SPEC_KINDS: tuple[str, ...] = ("json", "json_object", "regex", "ebnf")
_OPTION_KEYS = ("trigger", "any_whitespace")
_FIELD = "structured_output"


def _fail(message: str, field: str = _FIELD) -> InvalidRequestError:
    return InvalidRequestError(f"SamplingParams.{field}: {message}", field=field)


def _normalise_trigger(trigger: Any, field: str) -> str | tuple[int, ...] | None:
    """``None``, a non-empty str, or a non-empty sequence of token ids (>= 0) -> tuple."""
    if trigger is None:
        return None
    if isinstance(trigger, str):
        if not trigger:
            raise _fail("trigger must be a non-empty str or a non-empty list of token ids, got ''", field)
        return trigger
    if isinstance(trigger, (list, tuple)) and trigger and all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in trigger):
        return tuple(int(t) for t in trigger)
    raise _fail(f"trigger must be a non-empty str or a non-empty list of token ids >= 0, got {trigger!r}", field)


@dataclass(frozen=True)
class StructuredOutputSpec:
    """One request's output constraint.

    Attributes:
        kind: ``"json"`` (JSON Schema), ``"json_object"`` (any JSON object),
            ``"regex"`` (the whole output fully matches it) or ``"ebnf"``
            (xgrammar's EBNF, root rule ``root``).
        schema: the JSON Schema (dict, or its JSON text), the regex or the
            EBNF text; ``None`` for ``json_object``.
        trigger: token ids (tuple) or text after which the grammar applies;
            ``None``: from the first output token.
        any_whitespace: JSON only. False (default): one fixed layout on one line
            (``json.dumps`` separators ``", "`` and ``": "``), so the model cannot
            spend its token budget on free whitespace; True allows any whitespace
            between JSON tokens.
    """

    kind: str
    schema: str | dict | None = None
    trigger: str | tuple[int, ...] | None = None
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.kind not in SPEC_KINDS:
            raise _fail(f"kind must be one of {list(SPEC_KINDS)}, got {self.kind!r}")
        if self.kind == "json_object":
            if self.schema is not None:
                raise _fail("json_object takes no schema (it means any JSON object); use kind 'json'")
        elif self.kind == "json":
            self.schema_dict  # parse once now: bad JSON text is a construction error
        elif not isinstance(self.schema, str) or not self.schema:
            raise _fail(f"{self.kind} needs a non-empty str, got {self.schema!r}")
        if not isinstance(self.any_whitespace, bool):
            raise _fail(f"any_whitespace must be True or False, got {self.any_whitespace!r}")
        object.__setattr__(self, "trigger", _normalise_trigger(self.trigger, _FIELD))

    @property
    def schema_dict(self) -> dict:
        """The JSON Schema as a dict (``{"type": "object"}`` for json_object)."""
        if self.kind == "json_object":
            return {"type": "object"}
        if self.kind != "json":
            raise ValueError(f"a {self.kind} spec has no JSON schema")
        schema = self.schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise _fail(f"the JSON schema text is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise _fail(f"a JSON schema must be a dict (or JSON text of an object), got {self.schema!r}")
        return schema

    def cache_key(self) -> tuple[str, str, bool]:
        """Key of the compiled grammar: the trigger does not change the grammar."""
        text = json.dumps(self.schema_dict, sort_keys=True) if self.kind in ("json", "json_object") \
            else str(self.schema)
        return self.kind, text, self.any_whitespace

    # ---------------------------------------------------------------- parsing
    @classmethod
    def from_dict(cls, value: dict) -> StructuredOutputSpec:
        """``{"json": schema}`` / ``{"regex": ...}`` / ``{"ebnf": ...}`` / ``{"json_object": True}``."""
        kinds = [k for k in value if k in SPEC_KINDS]
        unknown = sorted((str(k) for k in value if k not in SPEC_KINDS and k not in _OPTION_KEYS))
        if len(kinds) != 1 or unknown:
            raise _fail(f"a dict needs exactly one of {list(SPEC_KINDS)} plus optional {list(_OPTION_KEYS)}; "
                        f"got keys {sorted(map(str, value))}")
        kind = kinds[0]
        schema = value[kind]
        if kind == "json_object":
            if schema is not True:
                raise _fail(f"json_object must be True, got {schema!r}")
            schema = None
        elif kind == "json" and not isinstance(schema, (dict, str)):
            raise _fail(f"json must be a JSON schema dict or its JSON text, got {schema!r}")
        return cls(kind, schema, value.get("trigger"), value.get("any_whitespace", False))

    @classmethod
    def from_so_args(cls, so_args: dict) -> StructuredOutputSpec:
        """DeepInfer's ``so_args`` (its shape is checked by SamplingParams first)."""
        try:
            return cls(so_args["schema_type"], so_args["schema"], so_args.get("trigger"))
        except InvalidRequestError as e:
            raise InvalidRequestError(str(e).replace(f"SamplingParams.{_FIELD}", "SamplingParams.so_args"),
                                      field="so_args") from None


def spec_from_params(params: Any) -> StructuredOutputSpec | None:
    """Resolve ``structured_output`` / ``so_args`` of a SamplingParams into one spec.

    Also rejects settings that would let a constrained output end before its
    grammar does while still reporting "stop" (stop strings, stop token ids), or
    run past its end (ignore_eos, min_tokens): a finished "stop" must always be
    a complete, valid output.
    """
    value, so_args = params.structured_output, params.so_args
    if value is not None and so_args is not None:
        # dataclasses.replace() passes back the spec that so_args produced: that is fine
        if not (isinstance(value, StructuredOutputSpec) and value == StructuredOutputSpec.from_so_args(so_args)):
            raise _fail("give either structured_output or so_args, not both")
    if isinstance(value, StructuredOutputSpec):
        spec = value
    elif isinstance(value, dict):
        spec = StructuredOutputSpec.from_dict(value)
    elif value is None:
        spec = StructuredOutputSpec.from_so_args(so_args) if so_args is not None else None
    else:
        raise _fail(f"must be None, a StructuredOutputSpec or a dict like {{'json': schema}}, "
                    f"got {type(value).__name__}")
    if spec is None:
        return None
    for name, bad in (("stop", bool(params.stop)), ("stop_token_ids", bool(params.stop_token_ids)),
                      ("ignore_eos", params.ignore_eos), ("min_tokens", params.min_tokens > 0)):
        if bad:
            raise _fail(f"cannot be combined with {name}: it could end the output before the grammar "
                        f"completes, or run past it (the grammar alone ends the output, with EOS)")
    return spec
