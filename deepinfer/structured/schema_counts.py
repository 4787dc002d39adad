"""JSON Schema's non-negative-integer keywords, checked where they sit in the request's schema.

``minLength`` / ``maxLength``, ``minItems`` / ``maxItems``, ``minProperties`` /
``maxProperties`` and ``minContains`` / ``maxContains`` must be non-negative integers
(JSON Schema 2020-12, section 6; an integer-valued number such as ``2.0`` is one). Before,
``maxLength: -1`` or ``minItems: -1`` were admitted (xgrammar compiled them) and
``minLength: -1`` failed inside xgrammar with its own text; now each is refused at
admission naming the keyword and its JSON path (``schema/properties/tags/minItems``),
before any rewrite moves it. ``2.0`` is rewritten to ``2`` (both backends refuse floats).
Inverted pairs (``minLength > maxLength``...) are ``schema_rules``' contradictions.
"""

from __future__ import annotations

import math
from typing import Any

from deepinfer.errors import InvalidRequestError
from deepinfer.structured.schema_keys import SUBSCHEMA, SUBSCHEMA_LISTS, SUBSCHEMA_MAPS

__all__ = ["COUNT_KEYWORDS", "check_counts"]

COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                  "minContains", "maxContains")
# where subschemas sit: those xgrammar's check walks, plus the ones it ignores (a count
# there is still the request's mistake); their other values are data (enum, const...)
_SUB = SUBSCHEMA + ("contains", "not", "if", "then", "else")
_SUB_MAPS = SUBSCHEMA_MAPS + ("dependentSchemas", "dependencies")
_SUB_LISTS = SUBSCHEMA_LISTS


def _count(value: Any) -> int | None:
    """``value`` as a non-negative int, or None when it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and value >= 0:
        return int(value)
    return None


def check_counts(schema: Any, where: str = "schema") -> Any:
    """Raise InvalidRequestError (field ``structured_output``) naming the first keyword of
    ``COUNT_KEYWORDS`` whose value is not a non-negative integer, with its JSON path; else
    return ``schema`` (a copy where an integer-valued float became an int)."""
    if not isinstance(schema, dict):
        return schema  # booleans; other values are refused by schema_rules with their path
    out = dict(schema)
    for key in COUNT_KEYWORDS:
        if key in schema:
            n = _count(schema[key])
            if n is None:
                raise InvalidRequestError(f"SamplingParams.structured_output: {where}/{key}: '{key}' must be a "
                                          f"non-negative integer (0, 1, 2, ...), got {schema[key]!r}",
                                          field="structured_output")
            out[key] = n
    for key in _SUB:
        if key in schema and not isinstance(schema[key], list):
            out[key] = check_counts(schema[key], f"{where}/{key}")
    for key in _SUB_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: check_counts(sub, f"{where}/{key}/{name}") for name, sub in schema[key].items()}
    for key in _SUB_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [check_counts(sub, f"{where}/{key}/{i}") for i, sub in enumerate(schema[key])]
    return out
