"""Backend-independent admission of a JSON schema: contradictions up front, exact rewrites.

Before either grammar backend sees a schema, :func:`normalize_schema` walks it and

* rejects count keywords (``minLength``, ``maxItems``...) that are not non-negative
  integers, where the request wrote them (``schema_counts.py``);
* rejects what no value (or no object / array / string / number) can satisfy, naming
  the keyword and its JSON path: ``type: []``, ``enum`` / ``const`` with no value of
  the schema's ``type``, a ``const`` outside its ``enum``, ``required`` properties a
  closed object cannot hold (``additionalProperties: false``), more ``required`` than
  ``maxProperties``, empty ``anyOf`` / ``oneOf`` / ``allOf``, and inverted bounds
  (``minimum > maximum``, ``minLength > maxLength``, ``minItems > maxItems``,
  ``minProperties > maxProperties``). The backends would otherwise emit *some* JSON
  (``{}``, ``0.00``) that fails the schema, or a value of another type. Such a
  contradiction is only fatal where it makes the whole schema unsatisfiable: an
  unsatisfiable *optional* property (or ``patternProperties`` / ``$defs`` member, or
  ``additionalProperties``) becomes ``false`` (exactly: it may not be present), an
  unsatisfiable ``anyOf`` / ``oneOf`` branch is dropped (it never matches), and an
  unsatisfiable ``not`` is dropped (its negation holds for every value);
* rewrites constructs into equivalent (or, for 64-bit bounds, narrower) ones every
  backend enforces exactly: ``enum`` values of the wrong ``type`` are dropped (they can
  never validate), ``format: date`` / ``date-time`` / ``time`` become exact calendar
  patterns (``patterns.py``), formats that JSON Schema does not define (``int32``,
  ``byte``, ``topic``...) are dropped (validators treat them as annotations), as is
  draft 3's ``utc-millisec`` on a numeric type (every number is a millisecond count), and
  ``uniqueItems: false`` (a no-op) is dropped;
* integer bounds past 64 bits (xgrammar fails on them with "Check failed"; llguidance
  clamps them, or fails / crashed below -2**63) are clamped into the 64-bit range when
  values remain, wherever only integers are numeric (``"integer"``, ``["integer",
  "null"]``...), which only narrows what is generated; a range wholly past 64 bits is
  rejected. A bound past 64 bits on a ``number`` is left to the backends, which refuse it.
"""

from __future__ import annotations

import math
import re
from typing import Any

from deepinfer.errors import InvalidRequestError
from deepinfer.structured.branch_pushdown import PushContext, push_down
from deepinfer.structured.oneof_rewrite import one_of_as_any_of
from deepinfer.structured.patterns import DATE_PATTERN, DATE_TIME_PATTERN, TIME_PATTERN

__all__ = ["normalize_schema", "schema_error", "SPEC_FORMATS", "INT64_MIN", "INT64_MAX"]

INT64_MIN, INT64_MAX = -(2**63 - 1024), 2**63 - 1024  # exact as doubles: both backends parse bounds as f64
#: Formats JSON Schema (2020-12, draft 3-7) defines; any other is an annotation, dropped.
SPEC_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6",
    "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template", "json-pointer",
    "relative-json-pointer", "regex", "color", "host-name", "ip-address", "utc-millisec", "phone", "style"})
_FORMAT_PATTERNS = {"date": DATE_PATTERN, "date-time": DATE_TIME_PATTERN, "time": TIME_PATTERN}
_TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")
_SUB = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "unevaluatedItems",
        "additionalItems", "contains", "not", "if", "then", "else")
_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_OBJECT_ONLY = ("properties", "required", "additionalProperties", "patternProperties", "minProperties",
                "maxProperties", "propertyNames", "dependencies", "dependentRequired", "dependentSchemas")
_BOUND_PAIRS = (("minLength", "maxLength", "string"), ("minItems", "maxItems", "array"),
                ("minProperties", "maxProperties", "object"))


class Unsatisfiable(InvalidRequestError):
    """A subschema no value satisfies (the enclosing schema may still be satisfiable without it)."""


def _unsat(where: str, message: str) -> Unsatisfiable:
    return Unsatisfiable(f"SamplingParams.structured_output: {where}: {message}", field="structured_output")


def schema_error(where: str, message: str) -> InvalidRequestError:
    """The admission error of a schema construct at JSON path ``where``."""
    return InvalidRequestError(f"SamplingParams.structured_output: {where}: {message}", field="structured_output")


def json_type(value: Any) -> str:
    """The JSON type of a decoded value ("integer" for 1 and 1.0, as JSON Schema says)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object", type(None): "null"}.get(
        type(value), "?")


def _fits(value: Any, types: set[str]) -> bool:
    t = json_type(value)
    return t in types or (t == "integer" and "number" in types)


def _types(schema: dict, where: str) -> set[str] | None:
    t = schema.get("type")
    if t is None:
        return None
    found = [t] if isinstance(t, str) else t
    if not isinstance(found, list) or any(x not in _TYPES for x in found):
        raise schema_error(f"{where}/type", f"'type' must be one of {list(_TYPES)} or a list of them, got {t!r}")
    if not found:
        raise _unsat(f"{where}/type", "'type': [] allows no value at all (unsatisfiable)")
    return set(found)


def _check_values(schema: dict, out: dict, types: set[str] | None, where: str) -> None:
    """enum / const against type and each other; drops enum values that can never validate."""
    if "enum" in schema:
        values = schema["enum"]
        if not isinstance(values, list) or not values:
            raise schema_error(f"{where}/enum", f"'enum' must be a non-empty list, got {values!r}")
        if types is not None:
            kept = [v for v in values if _fits(v, types)]
            if not kept:
                raise _unsat(f"{where}/enum", f"no value of 'enum' {values!r} is of 'type' {sorted(types)} "
                                                    f"(contradictory: nothing validates)")
            out["enum"] = kept
    if "const" in schema:
        c = schema["const"]
        if types is not None and not _fits(c, types):
            raise _unsat(f"{where}/const", f"'const' {c!r} is not of 'type' {sorted(types)} "
                                                 f"(contradictory: nothing validates)")
        if "enum" in out and not any(c == v and json_type(c) == json_type(v) for v in out["enum"]):
            raise _unsat(f"{where}/const", f"'const' {c!r} is not in 'enum' (contradictory)")


def _check_bounds(schema: dict, out: dict, types: set[str] | None, where: str) -> None:
    for lo, hi, kind in _BOUND_PAIRS:
        a, b = schema.get(lo), schema.get(hi)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > b and (types is None or kind in types):
            raise _unsat(f"{where}/{lo}", f"'{lo}' {a} > '{hi}' {b}: no {kind} satisfies both")
    lo_v = max((schema[k] for k in ("minimum", "exclusiveMinimum") if _num(schema.get(k))), default=None)
    hi_v = min((schema[k] for k in ("maximum", "exclusiveMaximum") if _num(schema.get(k))), default=None)
    if lo_v is not None and hi_v is not None:
        strict = schema.get("exclusiveMinimum") == lo_v or schema.get("exclusiveMaximum") == hi_v
        if lo_v > hi_v or (strict and lo_v == hi_v):
            raise _unsat(f"{where}/minimum", f"the lower bound {lo_v} is above the upper bound {hi_v}: "
                                                   f"no number satisfies both")
    if types is not None and "integer" in types and "number" not in types:  # bounds bind integers only
        _clamp_integer_bounds(schema, out, where)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _clamp_integer_bounds(schema: dict, out: dict, where: str) -> None:
    for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        v = schema.get(key)
        if not _num(v):
            continue
        low = key.endswith("inimum")
        if (low and v >= INT64_MAX) or (not low and v <= INT64_MIN):
            raise schema_error(f"{where}/{key}", f"integer range past 64 bits ({key} {v}): not supported "
                                                 f"by the grammar backends (their integers are 64-bit)")
        if v > INT64_MAX or v < INT64_MIN:  # only narrows: values past 64 bits are never generated
            out[key] = v = max(INT64_MIN, min(INT64_MAX, int(v)))
        if isinstance(v, int) and abs(v) > 2**53 and float(v) != v:
            out[key] = _double_inside(v, low)


def _double_inside(v: int, low: bool) -> int:
    """The nearest integer to ``v`` on the inside of the range (above a lower bound, below an
    upper one) that a double holds exactly: both backends read bounds as f64, and rounding
    9223372036854770000 to 9223372036854769664 let llguidance emit values below the minimum."""
    d = float(v)
    if (low and d < v) or (not low and d > v):
        d = math.nextafter(d, math.inf if low else -math.inf)
    return int(d)


def _check_object(schema: dict, where: str) -> None:
    """Object keywords no object satisfies: unsatisfiable when only objects are allowed (or no
    ``type`` is given); when ``type`` lists others, exactly "not an object" (the keywords bind
    objects only), so ``object`` leaves ``type``; when ``type`` excludes objects, the object
    keywords never apply and are dropped."""
    types = _types(schema, where)
    if types is not None and "object" not in types:  # e.g. "required" beside "type": "integer"
        for key in _OBJECT_ONLY:
            schema.pop(key, None)  # never applies (and xgrammar would refuse some)
        return
    try:
        _object_contradiction(schema, where)
    except Unsatisfiable:
        if types is None or types == {"object"}:
            raise  # without a type, object keywords say an object is meant: refused as before
        schema["type"] = [t for t in _TYPES if t != "object" and t in types]


def _object_contradiction(schema: dict, where: str) -> None:
    required = schema.get("required", [])
    if not isinstance(required, list):
        return
    if isinstance(schema.get("maxProperties"), int) and len(set(required)) > schema["maxProperties"]:
        raise _unsat(f"{where}/required", f"{len(set(required))} 'required' properties but 'maxProperties' "
                                                f"{schema['maxProperties']}: no object satisfies both")
    props = schema.get("properties", {}) if isinstance(schema.get("properties"), dict) else {}
    patterns = [p for p in schema.get("patternProperties", {})] if isinstance(
        schema.get("patternProperties"), dict) else []
    closed = schema.get("additionalProperties") is False
    for name in required:
        sub = props.get(name)
        matched = [p for p in patterns if _search(p, name)]
        if (closed and name not in props and not matched) or (sub is False and not matched):
            raise _unsat(f"{where}/required", f"required property {name!r} is not allowed by "
                                                    f"'additionalProperties': false or a 'false' schema "
                                                    f"(no object satisfies the schema)")


def _search(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return True  # unknown: do not call it unsatisfiable (the regex check reports a bad pattern)


def _rewrite_format(schema: dict, out: dict, where: str, types: set[str] | None) -> None:
    fmt = schema.get("format")
    if not isinstance(fmt, str) or fmt not in SPEC_FORMATS:
        out.pop("format", None)  # not a JSON Schema format: validators treat it as an annotation
        return
    if fmt == "utc-millisec" and types is not None and types <= {"number", "integer"}:
        # draft 3: a number of milliseconds since the epoch; every number is one
        del out["format"]
        return
    if fmt == "idn-email":  # narrowing: an ASCII address is an internationalized one too
        out["format"] = "email"
        return
    if fmt in _FORMAT_PATTERNS:
        if "pattern" in schema:
            raise schema_error(where, f"JSON schema 'format': {fmt!r} together with 'pattern' is not supported "
                                      f"(the {fmt} format is compiled as a pattern); keep one")
        del out["format"]
        out["pattern"] = _FORMAT_PATTERNS[fmt]


def _walk(schema: Any, where: str, ctx: PushContext) -> Any:
    if not isinstance(schema, dict):
        return _walk_node(schema, where, ctx)
    schema = push_down(schema, ctx)
    if schema is False:
        raise _unsat(where, "its keywords and those of its allOf / oneOf / anyOf / $ref contradict each "
                            "other (unsatisfiable)")
    inlined = ctx.take_fresh()
    try:
        return _walk_node(schema, where, ctx)
    finally:
        ctx.active -= inlined


def _walk_node(schema: Any, where: str, ctx: PushContext) -> Any:
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        raise schema_error(where, f"a JSON schema must be an object or a boolean, got {schema!r}")
    out = dict(schema)
    types = _types(schema, where)
    _check_values(schema, out, types, where)
    _check_bounds(schema, out, types, where)
    _rewrite_format(schema, out, where, types)
    if schema.get("uniqueItems") is False:
        del out["uniqueItems"]
    for key in _SUB:
        if key in schema and not isinstance(schema[key], list):
            try:
                out[key] = _walk(schema[key], f"{where}/{key}", ctx)
            except Unsatisfiable:
                if key == "not":  # "not" of nothing holds for every value
                    del out["not"]
                elif key in ("additionalProperties", "unevaluatedProperties"):
                    out[key] = False  # exactly: no such property can be present
                else:
                    raise
    if out.get("not") is True or out.get("not") == {}:
        raise Unsatisfiable(f"SamplingParams.structured_output: {where}/not: 'not' of a schema every value "
                            f"satisfies allows no value (unsatisfiable)", field="structured_output")
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    for key in _SUB_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: _walk_member(key, name, v, f"{where}/{key}/{name}", required, ctx)
                        for name, v in schema[key].items()}
    for key in _SUB_LISTS:
        if isinstance(schema.get(key), list):
            if not schema[key] and key in ("anyOf", "oneOf", "allOf"):
                raise schema_error(f"{where}/{key}", f"'{key}' must be a non-empty list (an empty one is invalid)")
            out[key] = _walk_list(key, schema[key], f"{where}/{key}", ctx)
    _check_object(out, where)  # after the members: a required property may have become false
    rewritten = one_of_as_any_of(out, ctx.root)
    if rewritten is not out and rewritten["anyOf"] is not out["oneOf"]:  # branches restricted: walk them
        rewritten["anyOf"] = _walk_list("anyOf", rewritten["anyOf"], f"{where}/oneOf", ctx)
    return rewritten


def _walk_member(key: str, name: str, sub: Any, where: str, required: list, ctx: PushContext) -> Any:
    """A member of ``properties`` / ``patternProperties`` / ``$defs`` ...: an unsatisfiable one
    becomes ``false`` (exactly what it allows: nothing); the enclosing object can still be
    satisfied without it unless it is required (then ``_check_object`` reports it)."""
    if isinstance(sub, list) and key == "dependencies":
        return sub  # a property dependency (names), not a schema
    try:
        return _walk(sub, where, ctx)
    except Unsatisfiable:
        if (key == "properties" and name in required) or key in ("dependentSchemas", "dependencies"):
            raise
        return False


def _walk_list(key: str, items: list, where: str, ctx: PushContext) -> list:
    """anyOf / oneOf branches that allow nothing (``false`` included) are dropped (they never
    match); allOf and prefixItems keep the error."""
    out, first = [], None
    for i, sub in enumerate(items):
        try:
            walked = _walk(sub, f"{where}/{i}", ctx)
            if walked is False and key in ("anyOf", "oneOf"):
                raise _unsat(f"{where}/{i}", "the branch is 'false' (it never matches)")
            out.append(walked)
        except Unsatisfiable as e:
            if key not in ("anyOf", "oneOf"):
                raise
            first = first or e
    if not out and first is not None:
        raise first
    return out


def normalize_schema(schema: dict) -> dict:
    """Raise InvalidRequestError (keyword and JSON path) for a contradictory schema; else
    return the rewritten schema that the backend checks and compile."""
    from deepinfer.structured.ref_hoist import hoist_refs, inline_false_refs
    from deepinfer.structured.schema_counts import check_counts

    out = hoist_refs(check_counts(schema))  # counts first: where the request wrote them
    for _ in range(4):  # a definition found unsatisfiable may make those that use it so
        out = _walk(out, "schema", PushContext.of(out))
        out, changed = inline_false_refs(out)
        if not changed:
            return out
    return _walk(out, "schema", PushContext.of(out))
