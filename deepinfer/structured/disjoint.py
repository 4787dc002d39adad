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
  ``enum`` values the other does not allow.

Anything not proved is "may overlap" (the caller refuses the ``oneOf``): a proof may be
missed, never invented.
"""

from __future__ import annotations

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


def _pinned(schema: Any, prop: str, root: Any) -> list | None:
    """The values property ``prop`` may take, when ``schema`` requires it and pins it."""
    schema = resolve_ref(schema, root)
    if not isinstance(schema, dict) or prop not in (schema.get("required") or []):
        return None
    props = schema.get("properties")
    sub = resolve_ref(props.get(prop), root) if isinstance(props, dict) else None
    if isinstance(sub, dict) and "const" in sub:
        return [sub["const"]]
    if isinstance(sub, dict) and isinstance(sub.get("enum"), list):
        return list(sub["enum"])
    return None


def _same(x: Any, y: Any) -> bool:
    return x == y and (isinstance(x, bool) == isinstance(y, bool))


def provably_disjoint(a: Any, b: Any, root: Any = None, within: set[str] | None = None) -> bool:
    """No value validates against both ``a`` and ``b`` (local refs resolved in ``root``; only
    values of the JSON types ``within`` considered, None = all)."""
    within = _widen(within)
    ta, tb = _meet(evident_types(a, root), within), _meet(evident_types(b, root), within)
    if ta is not None and tb is not None and not _meet(ta, tb):
        return True
    if (ta is not None and not ta) or (tb is not None and not tb):
        return True  # one branch allows no value of the enclosing types at all
    ra, rb = resolve_ref(a, root), resolve_ref(b, root)
    if isinstance(ra, dict) and isinstance(rb, dict):  # a required discriminator property
        req_a, req_b = ra.get("required") or [], rb.get("required") or []
        if isinstance(req_a, list) and isinstance(req_b, list):
            for prop in {p for p in req_a if isinstance(p, str)} & {p for p in req_b if isinstance(p, str)}:
                ca, cb = _pinned(ra, prop, root), _pinned(rb, prop, root)
                if ca is not None and cb is not None and not any(_same(x, y) for x in ca for y in cb):
                    # only objects carry the property: other types would still overlap
                    if (ta is not None and ta <= {"object"}) or (tb is not None and tb <= {"object"}):
                        return True
    return False
