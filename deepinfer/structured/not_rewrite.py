"""``not`` rewritten into positive keywords where the complement is expressible exactly.

Neither backend implements ``not``. Some negations have an exact positive form:

* ``not {"required": [a, b]}``: an object lacking ``a`` or lacking ``b`` (a non-object
  passes ``required``, so fails its ``not``): ``anyOf [{"type": "object", "properties":
  {"a": false}}, ...]`` (one name: just that branch);
* ``not {"type": T}``: ``{"type": <every JSON type but T>}``;
* ``not {"anyOf": [A, B]}``: ``allOf [not A, not B]``, each rewritten the same way.

:func:`rewrite_not` moves such a ``not`` into the schema's ``allOf`` (``branch_pushdown``
then merges it); any other ``not`` stays (and admission refuses it).
"""

from __future__ import annotations

from typing import Any

from deepinfer.structured.schema_merge import ANNOTATIONS

__all__ = ["rewrite_not", "positive_complement"]

_TYPES = ("null", "boolean", "object", "array", "number", "string")


def _only(schema: dict, key: str) -> bool:
    return key in schema and all(k == key or k in ANNOTATIONS for k in schema)


def positive_complement(schema: Any, depth: int = 0) -> Any:
    """A schema validating exactly the values ``schema`` rejects, or None when not expressible."""
    if schema is False:
        return True
    if schema is True or not isinstance(schema, dict) or depth > 4:
        return None
    if _only(schema, "required") and isinstance(schema["required"], list) and schema["required"]:
        names = [n for n in dict.fromkeys(schema["required"]) if isinstance(n, str)]
        if len(names) != len(set(schema["required"])):
            return None
        absent = [{"type": "object", "properties": {n: False}} for n in names]
        return absent[0] if len(absent) == 1 else {"anyOf": absent}
    if _only(schema, "type"):
        t = schema["type"]
        types = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else None
        if types is None or not types <= {*_TYPES, "integer"} or ("integer" in types and "number" not in types):
            return None  # "not integer" keeps non-integral numbers: no type says that
        rest = [x for x in _TYPES if x not in types]
        return False if not rest else {"type": rest[0] if len(rest) == 1 else rest}
    if _only(schema, "anyOf") and isinstance(schema["anyOf"], list) and schema["anyOf"]:
        parts = [positive_complement(b, depth + 1) for b in schema["anyOf"]]
        return None if any(p is None for p in parts) else {"allOf": parts}
    return None


def rewrite_not(schema: dict) -> dict:
    """``schema`` with its ``not`` replaced by an ``allOf`` member when expressible; else itself."""
    if "not" not in schema:
        return schema
    positive = positive_complement(schema["not"])
    if positive is None:
        return schema
    out = {k: v for k, v in schema.items() if k != "not"}
    out["allOf"] = [*out["allOf"], positive] if isinstance(out.get("allOf"), list) else [positive]
    return out
