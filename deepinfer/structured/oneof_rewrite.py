"""``oneOf`` as ``anyOf`` where that is exact, one JSON type at a time.

Neither backend enforces "exactly one branch" (xgrammar reads ``oneOf`` as ``anyOf``,
llguidance refuses it), so a ``oneOf`` is admitted only as an ``anyOf`` that validates
the same values. :func:`one_of_as_any_of` proves that per JSON type ``t`` (null, boolean,
object, array, string, number):

* at most one branch can accept a value of type ``t``, or the branches that can are
  pairwise disjoint on ``t`` (``disjoint.provably_disjoint`` within ``{t}``): on ``t``
  "exactly one" is "at least one";
* or two branches accept *every* value of type ``t`` (their keywords all bind other types,
  e.g. ``{"required": ["a"]}`` on a string): every ``t`` value matches both, so ``oneOf``
  rejects type ``t`` altogether, and ``t`` leaves the branches' ``type``.

When every type is settled, ``oneOf`` becomes ``anyOf`` (each branch restricted to the
types left, if some were excluded); otherwise it stays (and admission refuses it).
"""

from __future__ import annotations

from typing import Any

from deepinfer.structured.disjoint import evident_types, provably_disjoint, resolve_ref
from deepinfer.structured.schema_merge import ANNOTATIONS, merge_schemas

__all__ = ["one_of_as_any_of"]

_KINDS = ("null", "boolean", "object", "array", "string", "number")
#: Keywords that bind values of one JSON type only (a value of any other type passes them).
_BINDS = {
    "object": {"properties", "required", "additionalProperties", "patternProperties", "propertyNames",
               "minProperties", "maxProperties", "dependencies", "dependentRequired", "dependentSchemas",
               "unevaluatedProperties"},
    "array": {"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "contains",
              "minContains", "maxContains", "unevaluatedItems"},
    "string": {"minLength", "maxLength", "pattern"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
}
_MAX_BRANCHES = 64  # pairwise proofs are quadratic


def _accepts(branch: Any, kind: str, root: Any) -> bool:
    types = evident_types(branch, root)
    return types is None or kind in types or (kind == "number" and "integer" in types)


def _accepts_all(branch: Any, kind: str, root: Any) -> bool:
    """Every value of JSON type ``kind`` validates against ``branch``."""
    branch = resolve_ref(branch, root)
    if branch is True:
        return True
    if not isinstance(branch, dict):
        return False
    binds_others = set().union(*(keys for k, keys in _BINDS.items() if k != kind))
    return all(k in ANNOTATIONS or k in binds_others for k in branch)


def _settle(branches: list, kind: str, root: Any) -> str | None:
    """"exact" / "excluded" for values of type ``kind``; None when unproved."""
    takers = [b for b in branches if _accepts(b, kind, root)]
    if len(takers) <= 1 or all(provably_disjoint(takers[i], takers[j], root, {kind})
                               for i in range(len(takers)) for j in range(i + 1, len(takers))):
        return "exact"
    if sum(_accepts_all(b, kind, root) for b in takers) >= 2:
        return "excluded"
    return None


def _restrict(branch: Any, types: list[str]) -> Any:
    only = {"type": types[0] if len(types) == 1 else types}
    merged = merge_schemas(only, branch)
    return merged if merged is not None else {"allOf": [only, branch]}


def one_of_as_any_of(schema: dict, root: Any) -> dict:
    """``schema`` with its ``oneOf`` replaced by an equivalent ``anyOf`` when provable (and no
    ``anyOf`` is there already); else ``schema`` itself."""
    branches = schema.get("oneOf")
    if not isinstance(branches, list) or not branches or "anyOf" in schema or len(branches) > _MAX_BRANCHES:
        return schema
    within = evident_types({k: v for k, v in schema.items() if k != "oneOf"}, root)
    kinds = [k for k in _KINDS if within is None or k in within or (k == "number" and "integer" in within)]
    verdicts = {k: _settle(branches, k, root) for k in kinds}
    if None in verdicts.values():
        return schema
    out = {k: v for k, v in schema.items() if k != "oneOf"}
    left = [k for k in kinds if verdicts[k] == "exact"]
    if len(left) < len(kinds):
        if not left:
            return schema  # nothing validates: left for the contradiction checks to name
        branches = [_restrict(b, left) for b in branches]
    out["anyOf"] = branches
    return out
