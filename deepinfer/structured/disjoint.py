"""Proofs that two JSON subschemas share no value (so ``oneOf`` over them is ``anyOf``).

Both grammar backends enforce ``oneOf`` only as ``anyOf`` (xgrammar) or not at all
(llguidance), which is exact exactly when no value validates against two branches.
:func:`provably_disjoint` proves that from what a subschema evidently allows:

* its JSON types (``type``, or the types of its ``const`` / ``enum`` values, or the union
  of its ``anyOf`` / ``oneOf`` branches, or the intersection over ``allOf``), after
  following local ``$ref`` pointers into the root schema, and intersected with the types
  the enclosing schema allows (a ``oneOf`` beside ``"type": "object"`` only ever sees
  objects, so a branch with no ``type`` of its own cannot overlap a ``"type": "string"``
  branch there);
* a discriminator: a property both branches require, each pinning it to ``const`` /
  ``enum`` values the other does not allow, or to disjoint subschemas (proved the same way);
* a property one branch requires and the other forbids (``false``, or not listed where
  ``additionalProperties`` is ``false`` and no ``patternProperties`` name matches);
* ``const`` / ``enum`` values the other branch's values do not include.

Anything not proved is "may overlap" (the caller refuses the ``oneOf``): a proof may be
missed, never invented.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["provably_disjoint", "resolve_ref", "evident_types"]

_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
               type(None): "null"}
_MAX_DEPTH = 16  # $ref chains / nesting followed before giving up (unknown, not disjoint)


def resolve_ref(schema: Any, root: Any, depth: int = 0) -> Any:
    """``schema`` with a local ``{"$ref": "#/..."}`` (and chains of them) replaced by its target
    in ``root``; the schema itself when it has no ref, the ref is not local, or has siblings
    (then it is not the target alone)."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and depth < _MAX_DEPTH:
        ref = schema["$ref"]
        if root is None or not (ref == "#" or ref.startswith("#/")):
            return schema
        if any(k not in ("$ref", "description", "title", "$comment", "examples", "default") for k in schema):
            return schema
        target: Any = root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                return schema  # a dangling ref: the backend reports it
        schema, depth = target, depth + 1
    return schema


def _value_type(v: Any) -> str:
    t = _JSON_TYPES.get(type(v), "?")
    return "integer" if t == "number" and float(v).is_integer() else t


def evident_types(schema: Any, root: Any = None, depth: int = 0) -> set[str] | None:
    """JSON types ``schema`` can match when evident ("number" includes "integer"); None = any."""
    schema = resolve_ref(schema, root)
    if schema is False:
        return set()
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return None
    found: set[str] | None = None
    t = schema.get("type")
    if isinstance(t, str):
        found = _widen({t})
    elif isinstance(t, list) and all(isinstance(x, str) for x in t):
        found = _widen(set(t))
    if "const" in schema:
        found = _meet(found, _widen({_value_type(schema["const"])}))
    elif isinstance(schema.get("enum"), list):
        found = _meet(found, _widen({_value_type(v) for v in schema["enum"]}))
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            branches = [evident_types(b, root, depth + 1) for b in schema[key]]
            if all(b is not None for b in branches):
                found = _meet(found, set().union(*branches))  # type: ignore[arg-type]
    if isinstance(schema.get("allOf"), list):
        for b in schema["allOf"]:
            found = _meet(found, evident_types(b, root, depth + 1))
    if "$ref" in schema and len(schema) > 1:  # a ref with siblings: both hold
        found = _meet(found, evident_types({"$ref": schema["$ref"]}, root, depth + 1))
    return found


def _widen(types: set[str] | None) -> set[str] | None:
    if types is None:
        return None
    return types | {"number"} if "integer" in types else types


def _meet(a: set[str] | None, b: set[str] | None) -> set[str] | None:
    """Types both allow, None meaning any. Sets are widened ("integer" always brings "number"),
    so a plain intersection is empty exactly when no value has both."""
    if a is None or b is None:
        return b if a is None else a
    return a & b


def _values(schema: Any) -> list | None:
    if isinstance(schema, dict) and "const" in schema:
        return [schema["const"]]
    if isinstance(schema, dict) and isinstance(schema.get("enum"), list):
        return list(schema["enum"])
    return None


def _property(schema: dict, prop: str, root: Any) -> Any:
    """The subschema ``schema`` applies to property ``prop`` (None when unknown)."""
    props = schema.get("properties")
    if isinstance(props, dict) and prop in props:
        return resolve_ref(props[prop], root)
    patterns = schema.get("patternProperties")
    if isinstance(patterns, dict) and patterns:
        try:
            if any(re.search(p, prop) for p in patterns):
                return None
        except re.error:
            return None
    return resolve_ref(schema.get("additionalProperties", True), root)


def _same(x: Any, y: Any) -> bool:
    return x == y and (isinstance(x, bool) == isinstance(y, bool))


def _disjoint_values(a: Any, b: Any) -> bool:
    va, vb = _values(a), _values(b)
    return va is not None and vb is not None and not any(_same(x, y) for x in va for y in vb)


def _required(schema: dict) -> set[str]:
    req = schema.get("required")
    return {p for p in req if isinstance(p, str)} if isinstance(req, list) else set()


def _objects_disjoint(ra: dict, rb: dict, root: Any, depth: int) -> bool:
    """No object validates both: a property one requires whose value the other's subschema for
    it (``false`` when forbidden) can never share."""
    for prop in _required(ra) | _required(rb):
        sa, sb = _property(ra, prop, root), _property(rb, prop, root)
        if sa is not None and sb is not None and provably_disjoint(sa, sb, root, depth=depth + 1):
            return True
    return False


def provably_disjoint(a: Any, b: Any, root: Any = None, within: set[str] | None = None, depth: int = 0) -> bool:
    """No value validates against both ``a`` and ``b`` (local refs resolved in ``root``; only
    values of the JSON types ``within`` considered, None = all)."""
    if depth > _MAX_DEPTH:
        return False
    within = _widen(within)
    ta, tb = _meet(evident_types(a, root), within), _meet(evident_types(b, root), within)
    if ta is not None and tb is not None and not _meet(ta, tb):
        return True
    if (ta is not None and not ta) or (tb is not None and not tb):
        return True  # one branch allows no value of the enclosing types at all
    ra, rb = resolve_ref(a, root), resolve_ref(b, root)
    if _disjoint_values(ra, rb):
        return True
    for x, y, tx in ((ra, rb, ta), (rb, ra, tb)):  # every branch of x's anyOf / oneOf is disjoint from y
        branches = x.get("anyOf", x.get("oneOf")) if isinstance(x, dict) else None
        if isinstance(branches, list) and branches and all(
                provably_disjoint(z, y, root, tx, depth + 1) for z in branches):
            return True
    # only objects carry properties: other types would still overlap
    objects_only = (ta is not None and ta <= {"object"}) or (tb is not None and tb <= {"object"})
    return objects_only and isinstance(ra, dict) and isinstance(rb, dict) and _objects_disjoint(ra, rb, root, depth)
