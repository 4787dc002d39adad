"""The exact intersection of two JSON subschemas as one schema object, where one exists.

``merge_schemas(a, b)`` returns a schema that validates exactly the values both ``a`` and
``b`` validate, or None when it cannot be written without ``allOf`` (then the caller keeps
``allOf [a, b]``, which llguidance intersects itself and xgrammar refuses). ``False`` is a
valid answer (nothing validates both, e.g. two different ``const``). Keyword by keyword:

* ``type``: intersection ("integer" within "number"); ``enum`` / ``const``: common values;
* bounds: the tighter one (``minimum`` the larger, ``maxLength`` the smaller, ...);
  ``multipleOf``: the least common multiple of two integers; ``required``: the union;
  ``uniqueItems``: true if either;
* ``properties`` / ``additionalProperties`` / ``patternProperties``: a name listed on one
  side only meets the other side's ``additionalProperties`` (unless one of that side's
  patterns matches it), so the merged ``properties`` list every name with both constraints
  and ``additionalProperties`` is the merge of both. Patterns on one side with a
  constraining ``additionalProperties`` on the other cannot be merged this way (a name the
  pattern matches would escape the other side's ``additionalProperties``): None;
* ``items`` recursively; ``prefixItems`` on one side meets the other's ``items`` per slot;
* ``anyOf`` on both sides: the branch products (at most ``MAX_BRANCHES``); ``allOf``:
  concatenated; a combinator on one side is kept as is;
* anything else (``pattern``, ``format``, ``not``, ``$ref``, ...) must be equal on both
  sides or absent from one; draft 4's boolean ``exclusiveMinimum`` gives None.
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["merge_schemas", "ANNOTATIONS", "MAX_BRANCHES"]

#: Keys that never constrain a value (kept from ``a`` first, then ``b``).
ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default", "$schema", "$id", "id",
                         "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "markdownDescription",
                         "enumDescriptions", "markdownEnumDescriptions", "$anchor", "x-intellij-html-description"})
MAX_BRANCHES = 32  # anyOf x anyOf products larger than this stay allOf (grammar size)
_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains")
_OBJECT_KEYS = ("properties", "patternProperties", "additionalProperties")
_TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")


class _NoMerge(Exception):
    """The intersection needs allOf."""


def _type_set(t: Any) -> set[str]:
    found = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else None
    if found is None or not found <= set(_TYPES):
        raise _NoMerge
    return found


def _meet_types(a: Any, b: Any) -> Any:
    ta, tb = _type_set(a), _type_set(b)
    both = (ta & tb) | ({"integer"} if ("integer" in ta and "number" in tb) or
                        ("number" in ta and "integer" in tb) else set())
    both -= {"integer"} if "number" in both else set()
    out = [t for t in _TYPES if t in both]
    return out[0] if len(out) == 1 else out


def _same_value(x: Any, y: Any) -> bool:
    """JSON equality: 1 == 1.0, but true is not 1."""
    if isinstance(x, bool) or isinstance(y, bool):
        return isinstance(x, bool) and isinstance(y, bool) and x == y
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same_value(x[k], y[k]) for k in x)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_same_value(p, q) for p, q in zip(x, y))
    return type(x) is type(y) and x == y if not (_number(x) and _number(y)) else x == y


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_true(s: Any) -> bool:
    return s is True or s == {}


def _search(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        raise _NoMerge from None


def _name_constraint(s: dict, name: str) -> Any:
    """What ``s`` asks of property ``name`` through properties / additionalProperties (its
    patternProperties stay in the merged schema and keep applying)."""
    props = s.get("properties") or {}
    if name in props:
        return props[name]
    if any(_search(p, name) for p in (s.get("patternProperties") or {})):
        return True
    return s.get("additionalProperties", True)


def _merge_objects(a: dict, b: dict, out: dict, depth: int) -> None:
    for s, other in ((a, b), (b, a)):
        if s.get("patternProperties") and not _is_true(other.get("additionalProperties", True)):
            raise _NoMerge
    if not any(k in a or k in b for k in _OBJECT_KEYS):
        return
    names = list(dict.fromkeys([*(a.get("properties") or {}), *(b.get("properties") or {})]))
    if names or "properties" in a or "properties" in b:
        out["properties"] = {n: _merge(_name_constraint(a, n), _name_constraint(b, n), depth) for n in names}
    patterns = {**(a.get("patternProperties") or {})}
    for p, sub in (b.get("patternProperties") or {}).items():
        patterns[p] = _merge(patterns[p], sub, depth) if p in patterns else sub
    if patterns:
        out["patternProperties"] = patterns
    if "additionalProperties" in a or "additionalProperties" in b:
        out["additionalProperties"] = _merge(a.get("additionalProperties", True),
                                             b.get("additionalProperties", True), depth)


def _merge_arrays(a: dict, b: dict, out: dict, depth: int) -> None:
    if "prefixItems" in a and "prefixItems" in b:
        raise _NoMerge
    if "prefixItems" in a or "prefixItems" in b:
        s, other = (a, b) if "prefixItems" in a else (b, a)
        tail = other.get("items", True)
        if not isinstance(s["prefixItems"], list) or isinstance(tail, list):
            raise _NoMerge
        out["prefixItems"] = [_merge(p, tail, depth) for p in s["prefixItems"]]
    if "items" in a or "items" in b:
        ia, ib = a.get("items", True), b.get("items", True)
        if isinstance(ia, list) or isinstance(ib, list):
            raise _NoMerge
        out["items"] = _merge(ia, ib, depth)


def _merge_values(a: dict, b: dict, out: dict) -> bool:
    """enum / const; False when no value is common (the merge is ``false``)."""
    values = None
    for s in (a, b):
        if "const" in s:
            mine = [s["const"]]
        elif isinstance(s.get("enum"), list):
            mine = list(s["enum"])
        elif "enum" in s:
            raise _NoMerge
        else:
            continue
        values = mine if values is None else [v for v in values if any(_same_value(v, w) for w in mine)]
    if values is None:
        return True
    out.pop("enum", None)
    out.pop("const", None)
    if not values:
        return False
    if len(values) == 1 and ("const" in a or "const" in b):
        out["const"] = values[0]
    else:
        out["enum"] = values
    return True


def _merge_any_of(a: list, b: list, depth: int) -> list:
    if len(a) * len(b) > MAX_BRANCHES:
        raise _NoMerge
    return [_merge(x, y, depth) for x in a for y in b]


def _merge(a: Any, b: Any, depth: int) -> Any:
    if depth > 12:
        raise _NoMerge
    if a is False or b is False:
        return False
    if _is_true(a):
        return b
    if _is_true(b):
        return a
    if not isinstance(a, dict) or not isinstance(b, dict):
        raise _NoMerge
    if any(isinstance(s.get(k), bool) for s in (a, b) for k in ("exclusiveMinimum", "exclusiveMaximum")):
        raise _NoMerge  # draft 4: the flag modifies minimum / maximum, which may come from the other side
    if "unevaluatedProperties" in a or "unevaluatedProperties" in b or "unevaluatedItems" in a \
            or "unevaluatedItems" in b:
        raise _NoMerge
    out: dict = {k: v for k, v in b.items() if k not in a}
    out.update(a)
    if "type" in a and "type" in b:
        out["type"] = _meet_types(a["type"], b["type"])
    if not _merge_values(a, b, out):
        return False
    for key in _LOWER:
        if key in a and key in b:
            out[key] = max(a[key], b[key])
    for key in _UPPER:
        if key in a and key in b:
            out[key] = min(a[key], b[key])
    if "required" in a and "required" in b:
        out["required"] = list(dict.fromkeys([*a["required"], *b["required"]]))
    if "uniqueItems" in a and "uniqueItems" in b:
        out["uniqueItems"] = bool(a["uniqueItems"]) or bool(b["uniqueItems"])
    if "multipleOf" in a and "multipleOf" in b and a["multipleOf"] != b["multipleOf"]:
        x, y = a["multipleOf"], b["multipleOf"]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (x, y)):
            raise _NoMerge
        out["multipleOf"] = x * y // math.gcd(x, y)
    _merge_objects(a, b, out, depth + 1)
    _merge_arrays(a, b, out, depth + 1)
    if "allOf" in a and "allOf" in b:
        out["allOf"] = [*a["allOf"], *b["allOf"]]
    if "anyOf" in a and "anyOf" in b:
        out["anyOf"] = _merge_any_of(a["anyOf"], b["anyOf"], depth + 1)
    done = {"type", "enum", "const", "required", "uniqueItems", "multipleOf", "allOf", "anyOf",
            "prefixItems", "items", *_LOWER, *_UPPER, *_OBJECT_KEYS, *ANNOTATIONS}
    for key in a.keys() & b.keys() - done:
        if not _same_value(a[key], b[key]):
            raise _NoMerge
    return out


def merge_schemas(a: Any, b: Any) -> Any:
    """The exact intersection of subschemas ``a`` and ``b`` as one schema (a dict, or
    ``False`` when nothing validates both), or None when it needs ``allOf``. A ``$ref`` on
    either side must have been resolved by the caller (refs are compared, not followed)."""
    try:
        return _merge(a, b, 0)
    except (_NoMerge, TypeError):
        return None
