"""Exact rewrites of a JSON schema into what llguidance implements, and its format check.

llguidance refuses ``oneOf``, ``dependencies`` / ``dependentRequired`` /
``dependentSchemas`` ("Unimplemented keys"), but enforces ``anyOf``, ``allOf`` (by
intersecting) and ``false`` subschemas exactly. These rewrites give it equivalent
schemas (same set of valid instances):

* ``oneOf`` whose branches are pairwise provably disjoint (``disjoint.py``, with local
  ``$ref`` followed and the enclosing schema's types taken into account) is ``anyOf``:
  at most one branch can match, so "exactly one" is "at least one";
* ``dependencies: {"a": ["b", "c"]}`` (and ``dependentRequired``) holds when ``a`` is
  absent or ``a``, ``b``, ``c`` are all present: ``anyOf [{"properties": {"a": false}},
  {"required": ["a", "b", "c"]}]``; a schema dependency ``{"a": S}`` (and
  ``dependentSchemas``) is ``anyOf [{"properties": {"a": false}}, {"allOf":
  [{"required": ["a"]}, S]}]``. Non-objects satisfy both forms, as they satisfy the
  original keyword. Each clause joins the schema's ``allOf`` (at most
  ``MAX_DEPENDENCY_CLAUSES`` per subschema).

:func:`check_llg_formats` then refuses formats llguidance only approximates, walking only
the subschema keywords (an annotation such as ``"self": {"format": "jsonschema"}`` is not
a schema) and every local ``$ref`` target.
"""

from __future__ import annotations

from typing import Any

from deepinfer.structured.disjoint import evident_types, provably_disjoint, resolve_ref
from deepinfer.structured.schema_rules import schema_error

__all__ = ["LLG_EXACT_FORMATS", "llg_rewrite", "check_llg_formats"]

#: Formats llguidance's grammar admits only values jsonschema's format checker accepts
#: (fuzzed: tests/test_structured_backends.py). date / date-time / time are patterns by then.
LLG_EXACT_FORMATS = frozenset({"email", "uuid", "ipv4", "ipv6", "hostname", "uri", "duration"})
#: Dependencies rewritten per subschema at most: each clause doubles llguidance's
#: intersection work, and past a few its parser exceeds its row limit mid-generation
#: (an error after queueing); more are left in place, and refused.
MAX_DEPENDENCY_CLAUSES = 4
_SUB = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "unevaluatedItems",
        "additionalItems", "contains", "not", "if", "then", "else")
_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def _subschemas(schema: dict, where: str) -> list[tuple[Any, str]]:
    """The direct subschemas of a schema object (schema keywords only) with their JSON paths."""
    out: list[tuple[Any, str]] = []
    for key in _SUB:
        if key in schema and not isinstance(schema[key], list):
            out.append((schema[key], f"{where}/{key}"))
    for key in _SUB_MAPS:
        if isinstance(schema.get(key), dict):
            out += [(v, f"{where}/{key}/{name}") for name, v in schema[key].items() if not isinstance(v, list)]
    for key in _SUB_LISTS:
        if isinstance(schema.get(key), list):
            out += [(v, f"{where}/{key}/{i}") for i, v in enumerate(schema[key])]
    return out


def _map(schema: Any, fn: Any) -> Any:
    """``fn`` applied bottom-up to every subschema object (schema keywords only)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUB:
        if key in out and not isinstance(out[key], list):
            out[key] = _map(out[key], fn)
    for key in _SUB_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {n: v if isinstance(v, list) else _map(v, fn) for n, v in out[key].items()}
    for key in _SUB_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_map(v, fn) for v in out[key]]
    return fn(out)


def _dependency_clauses(schema: dict) -> list[dict]:
    clauses = []
    for key in ("dependencies", "dependentRequired", "dependentSchemas"):
        deps = schema.get(key)
        if not isinstance(deps, dict):
            continue
        for name, dep in deps.items():
            absent = {"properties": {name: False}}
            if isinstance(dep, list) and key != "dependentSchemas":
                present: Any = {"required": [name, *[d for d in dep if d != name]]}
            elif isinstance(dep, (dict, bool)) and key != "dependentRequired":
                present = {"allOf": [{"required": [name]}, dep]}
            else:
                continue  # malformed: left in place for llguidance to refuse
            clauses.append({"anyOf": [absent, present]})
    return clauses


def _rewrite_one(root: Any) -> Any:
    def fn(s: dict) -> dict:
        clauses = _dependency_clauses(s)
        if 0 < len(clauses) <= MAX_DEPENDENCY_CLAUSES:
            for key in ("dependencies", "dependentRequired", "dependentSchemas"):
                s.pop(key, None)
            s["allOf"] = [*s.get("allOf", []), *clauses]
        branches = s.get("oneOf")
        if isinstance(branches, list):
            within = evident_types({k: v for k, v in s.items() if k != "oneOf"}, root)
            if all(provably_disjoint(branches[i], branches[j], root, within)
                   for i in range(len(branches)) for j in range(i + 1, len(branches))):
                del s["oneOf"]
                if "anyOf" in s:
                    s["allOf"] = [*s.get("allOf", []), {"anyOf": branches}]
                else:
                    s["anyOf"] = branches
        return s
    return fn


def llg_rewrite(schema: dict) -> dict:
    """The equivalent schema llguidance implements (see the module docstring)."""
    return _map(schema, _rewrite_one(schema))


def check_llg_formats(schema: Any, where: str = "schema", root: Any = None,
                      seen: set[str] | None = None) -> None:
    """Raise InvalidRequestError at the first format llguidance does not enforce exactly."""
    root = schema if root is None else root
    seen = set() if seen is None else seen
    if not isinstance(schema, dict):
        return
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in LLG_EXACT_FORMATS:
        raise schema_error(where, f"JSON schema format {fmt!r} is not enforced exactly by the llguidance "
                                  f"backend; exact formats: {sorted(LLG_EXACT_FORMATS)} and date/date-time/time")
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref not in seen:
        seen.add(ref)  # a target anywhere in the document (even under a non-schema key)
        target = resolve_ref({"$ref": ref}, root)
        if target is not schema and not (isinstance(target, dict) and target.get("$ref") == ref):
            check_llg_formats(target, ref, root, seen)
    for sub, path in _subschemas(schema, where):
        check_llg_formats(sub, path, root, seen)
