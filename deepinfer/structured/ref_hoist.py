"""Local ``$ref`` targets that sit outside the schema keywords, moved under ``$defs``.

The admission passes (``schema_rules``, ``checks``, ``llg_rewrites``) walk a schema through
its schema keywords only (``properties``, ``items``, ``$defs``, ...): a value under any other
key is an annotation. But a ``$ref`` may point anywhere in the document, e.g.
``"#/resourceDefinitions/connectionManagers"`` (Azure's schemas): the backends follow it,
while the passes never saw the target, so a keyword xgrammar drops there (a ``required``
name ``properties`` does not list) went unchecked. :func:`hoist_refs` copies each such target
to ``$defs/deepinfer-ref-<i>`` and points its refs there: the same schema, every part walked.

:func:`inline_false_refs` replaces a bare ``{"$ref": ...}`` to a definition that admission
found unsatisfiable (now ``false``) by ``false`` itself: llguidance refuses the reference
("schema is false") where it accepts the literal (a property that may not be present).
"""

from __future__ import annotations

from typing import Any

__all__ = ["hoist_refs", "inline_false_refs"]

_SUB = frozenset({"additionalProperties", "unevaluatedProperties", "propertyNames", "items", "unevaluatedItems",
                  "additionalItems", "contains", "not", "if", "then", "else"})
_SUB_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                       "dependencies"})
_SUB_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems", "items"})
_VALUES = frozenset({"enum", "const", "default", "examples"})


def _refs(node: Any, out: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/"):
            out.add(ref)
        for key, value in node.items():
            if key not in _VALUES:
                _refs(value, out)
    elif isinstance(node, list):
        for value in node:
            _refs(value, out)


def _walked(parts: list[str]) -> bool:
    """Whether the pointer ``parts`` reaches a subschema through schema keywords only."""
    i = 0
    while i < len(parts):
        key = parts[i]
        if key in _SUB_MAPS or (key in _SUB_LISTS and i + 1 < len(parts) and parts[i + 1].isdigit()):
            i += 2
        elif key in _SUB:
            i += 1
        else:
            return False
    return i == len(parts)


def _target(root: Any, parts: list[str]) -> Any:
    node = root
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _replace(node: Any, mapping: dict[str, str]) -> Any:
    if isinstance(node, dict):
        out = {k: (v if k in _VALUES else _replace(v, mapping)) for k, v in node.items()}
        if isinstance(out.get("$ref"), str) and out["$ref"] in mapping:
            out["$ref"] = mapping[out["$ref"]]
        return out
    if isinstance(node, list):
        return [_replace(v, mapping) for v in node]
    return node


def hoist_refs(schema: dict) -> dict:
    """``schema`` with every local ``$ref`` target outside the schema keywords copied under
    ``$defs`` (and its refs redirected); the schema itself when there is none."""
    refs: set[str] = set()
    _refs(schema, refs)
    mapping, targets = {}, {}
    for i, ref in enumerate(sorted(refs)):
        parts = [p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")]
        target = _target(schema, parts)
        if not _walked(parts) and isinstance(target, (dict, bool)):
            name = f"deepinfer-ref-{i}"
            mapping[ref], targets[name] = f"#/$defs/{name}", target
    if not mapping:
        return schema
    out = _replace(schema, mapping)
    defs = dict(out.get("$defs") or {}) if isinstance(out.get("$defs"), dict) else {}
    defs.update({name: _replace(t, mapping) for name, t in targets.items()})
    out["$defs"] = defs
    return out


def _is_false_ref(node: Any, targets: set[str]) -> bool:
    return isinstance(node, dict) and node.get("$ref") in targets and all(
        k in ("$ref", "description", "title", "$comment", "examples", "default") for k in node)


def _inline(node: Any, targets: set[str]) -> Any:
    if isinstance(node, dict):
        return {k: (v if k in _VALUES else (False if _is_false_ref(v, targets) else _inline(v, targets)))
                for k, v in node.items()}
    if isinstance(node, list):
        return [False if _is_false_ref(v, targets) else _inline(v, targets) for v in node]
    return node


def inline_false_refs(schema: dict) -> tuple[dict, bool]:
    """``schema`` with bare refs to ``false`` members of ``$defs`` / ``definitions`` replaced by
    ``false``, and whether any was."""
    targets = {f"#/{key}/{name.replace('~', '~0').replace('/', '~1')}"
               for key in ("$defs", "definitions") if isinstance(schema.get(key), dict)
               for name, sub in schema[key].items() if sub is False}
    if not targets:
        return schema, False
    out = _inline(schema, targets)
    return out, out != schema
