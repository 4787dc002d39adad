"""Keywords beside ``anyOf`` / ``oneOf`` / ``allOf`` / ``$ref`` pushed into the branches.

xgrammar drops every validation keyword that sits beside a combinator, so such schemas
were refused; llguidance refuses some of them too (circular references with siblings).
The rewrites here are exact (same valid instances):

* ``S ∧ allOf[A, B]`` is the single schema ``merge(S, A, B)`` where the merges are exact
  (``schema_merge``); members that do not merge stay in a shorter ``allOf``;
* ``S ∧ oneOf[A, B]`` is ``oneOf[S ∧ A, S ∧ B]`` (a value failing S fails every branch;
  one passing S passes ``S ∧ A`` exactly when it passes A), likewise ``anyOf``; each
  ``S ∧ A`` is merged, or ``allOf[S, A]`` when it does not merge;
* ``S ∧ {"$ref": X}`` is ``merge(S, X)`` with the target inlined (its own refs kept) from
  draft 2019-09 on; up to draft 7 a ``$ref`` makes its siblings ignored (what validators
  of that draft do), so there they are dropped;
* ``oneOf`` of branches that only ``require`` properties (``{"required": ["a"]}``,
  ``{"required": ["b"]}``) is exactly one of them present: each branch also forbids the
  one name of every other branch it does not require (``{"properties": {"b": false}}``),
  and a non-object, which passes every branch, fails.

A ``not`` with a positive form (``not_rewrite``) joins the ``allOf`` first. A push that would copy more than ``MAX_COPY_CHARS`` of siblings or inline refs past
``MAX_INLINES`` per schema is skipped (the schema is left for the backends to judge).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from deepinfer.structured.disjoint import resolve_ref
from deepinfer.structured.not_rewrite import rewrite_not
from deepinfer.structured.schema_merge import ANNOTATIONS, merge_schemas

__all__ = ["PushContext", "push_down", "MAX_COPY_CHARS", "MAX_INLINES"]

MAX_COPY_CHARS = 200_000  # siblings x branches copied per schema
MAX_INLINES = 256  # $ref targets inlined per schema
_COMBINATORS = ("allOf", "oneOf", "anyOf", "$ref")
#: Keys whose values are not subschemas with keywords (kept with the outer schema).
_KEEP_OUTSIDE = ANNOTATIONS
_OLD_DRAFT = re.compile(r"^http://json-schema\.org/draft-0[3467]/schema#?$")


@dataclass
class PushContext:
    """Per-schema state: the root (for refs), its draft, the copy budgets used, and the refs
    inlined on the walk's current path (``active``: never inlined again below themselves, so a
    recursive definition is inlined once; ``fresh``: inlined at the node being pushed)."""

    root: Any
    old_draft: bool = False
    copied: int = 0
    inlined: int = 0
    active: set = field(default_factory=set)
    fresh: set = field(default_factory=set)

    def may_inline(self, ref: Any) -> bool:
        if not isinstance(ref, str) or ref in self.active or ref in self.fresh or self.inlined >= MAX_INLINES:
            return False
        self.inlined += 1
        self.fresh.add(ref)
        return True

    def take_fresh(self) -> set:
        """The refs inlined since the last call (the caller marks them active below the node)."""
        fresh, self.fresh = self.fresh - self.active, set()
        self.active |= fresh
        return fresh

    @classmethod
    def of(cls, root: Any) -> PushContext:
        draft = root.get("$schema") if isinstance(root, dict) else None
        return cls(root, old_draft=isinstance(draft, str) and bool(_OLD_DRAFT.match(draft)))


def _siblings(schema: dict, key: str) -> dict:
    return {k: v for k, v in schema.items() if k != key and k not in _KEEP_OUTSIDE}


def _outside(schema: dict) -> dict:
    return {k: v for k, v in schema.items() if k in _KEEP_OUTSIDE}


#: Keys of a ref target left out when it is inlined: definitions are reached through the
#: root (a copy of them is never referenced), the draft is the root's.
_NOT_INLINED = frozenset({"$defs", "definitions", "$schema", "$id", "id"})


def _target(ref: Any, ctx: PushContext) -> Any:
    """The target of a local ``$ref`` to inline, or None (not local, dangling, recursive on this
    path, or over budget)."""
    bare = {"$ref": ref}
    target = resolve_ref(bare, ctx.root)
    if target is bare or not ctx.may_inline(ref):
        return None
    return {k: v for k, v in target.items() if k not in _NOT_INLINED} if isinstance(target, dict) else target


def _resolved(branch: Any, ctx: PushContext) -> Any:
    """A branch that is only a local ``$ref`` (and annotations): its target."""
    if isinstance(branch, dict) and "$ref" in branch and not _siblings(branch, "$ref"):
        target = _target(branch["$ref"], ctx)
        if target is not None:
            return target
    return branch


def _meet(s: dict, branch: Any, ctx: PushContext) -> Any:
    merged = merge_schemas(s, _resolved(branch, ctx))
    return merged if merged is not None else {"allOf": [s, branch]}


def _exclusive_required(branches: list) -> list | None:
    """oneOf branches that only list ``required`` names, made pairwise exclusive (None if they
    are not all such branches, or excluding one would need an anyOf)."""
    sets = []
    for b in branches:
        if not isinstance(b, dict) or not isinstance(b.get("required"), list) or _siblings(b, "required"):
            return None
        sets.append(list(dict.fromkeys(b["required"])))
    if len(sets) < 2:
        return None
    out = []
    for i, mine in enumerate(sets):
        forbid, possible = {}, True
        for j, other in enumerate(sets):
            if j != i:
                missing = [n for n in other if n not in mine]
                if not missing:
                    possible = False  # every value with mine also has other's: never exactly one
                elif len(missing) == 1:
                    forbid[missing[0]] = False
                else:
                    return None
        if possible:
            out.append({**branches[i], "type": "object", "properties": forbid})
    return out or None


def _budget(ctx: PushContext, s: dict, n: int) -> bool:
    size = len(json.dumps(s, default=str)) * n
    if ctx.copied + size > MAX_COPY_CHARS:
        return False
    ctx.copied += size
    return True


def _push_ref(schema: dict, ctx: PushContext) -> dict:
    s = _siblings(schema, "$ref")
    if ctx.old_draft:
        return {**_outside(schema), "$ref": schema["$ref"]}
    target = _target(schema["$ref"], ctx)
    if target is None:
        return schema  # the backends judge it
    merged = merge_schemas(s, target)
    if merged is None:
        return schema
    return merged if merged is False else {**_outside(schema), **merged}


def _push_all_of(schema: dict, ctx: PushContext) -> dict:
    members = schema["allOf"]
    if not isinstance(members, list):
        return schema
    acc: Any = _siblings(schema, "allOf")
    rest = []
    for m in members:
        merged = merge_schemas(acc, _resolved(m, ctx))
        if merged is None:
            rest.append(m)
        else:
            acc = merged
    if acc is False:
        return False  # type: ignore[return-value]
    out = {**_outside(schema), **acc}
    if rest:
        out["allOf"] = [*out["allOf"], *rest] if isinstance(out.get("allOf"), list) else rest
    return out


def _push_branches(schema: dict, key: str, ctx: PushContext) -> dict:
    branches = schema[key]
    if not isinstance(branches, list):
        return schema
    if key == "oneOf":
        exclusive = _exclusive_required(branches)
        if exclusive is not None:  # pairwise exclusive now: exactly one is at least one
            branches, key = exclusive, ("oneOf" if "anyOf" in schema else "anyOf")
            schema = {k: v for k, v in schema.items() if k != "oneOf"}
    s = _siblings(schema, key)
    if not s:
        return {**schema, key: branches}
    if not _budget(ctx, s, len(branches)):
        return schema
    return {**_outside(schema), key: [_meet(s, b, ctx) for b in branches]}


def push_down(schema: Any, ctx: PushContext) -> Any:
    """``schema`` (one subschema object) with its combinators' siblings pushed into them
    (see the module docstring); its subschemas are not visited (the caller walks them)."""
    for _ in range(8):  # each pass removes one combinator's siblings; merges may bring others
        if not isinstance(schema, dict):
            return schema
        before = schema = rewrite_not(schema)
        if "$ref" in schema and _siblings(schema, "$ref"):
            schema = _push_ref(schema, ctx)
        elif isinstance(schema.get("allOf"), list) and (_siblings(schema, "allOf") or len(schema["allOf"]) > 1):
            schema = _push_all_of(schema, ctx)
        elif "oneOf" in schema:
            schema = _push_branches(schema, "oneOf", ctx)
        elif "anyOf" in schema:
            schema = _push_branches(schema, "anyOf", ctx)
        if schema is before or schema == before:
            return schema
    return schema
