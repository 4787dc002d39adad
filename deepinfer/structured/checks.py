"""Reject what xgrammar would silently weaken, before anything compiles.

xgrammar 0.2.x turns some JSON Schema keywords and regex constructs into a
*larger* language with at most a log warning (probed one by one; see
tests/test_structured_spec.py, which re-probes them so an xgrammar upgrade that
starts enforcing one shows up). A constraint that is silently weakened produces
output that parses but does not validate, so these are errors here, each naming
the keyword and where it sits in the schema.

Probed as enforced (allowed): type, enum, const, properties, required,
additionalProperties, patternProperties, propertyNames, unevaluatedProperties,
maxProperties, items (schema), prefixItems, unevaluatedItems, minItems, maxItems,
minimum/maximum/exclusive* (integer and number), multipleOf (integer), minLength,
maxLength, pattern, the formats in ``ENFORCED_FORMATS``, anyOf, local $ref.
Probed as ignored (rejected): see ``_IGNORED`` and the conditional rules below,
and keywords that meet in one subschema (``_check_interactions``: siblings of
anyOf / oneOf / allOf / $ref, enum with other keywords, multipleOf with bounds,
pattern or format with length bounds). Formats were fuzzed against jsonschema's
FormatChecker: several are only approximated (``APPROXIMATED_FORMATS``, rejected).
A schema rejected here may still be enforced exactly by the llguidance backend
(``backends.py`` chooses); contradictions are found before, in ``schema_rules``.

Regexes (``regex`` specs and ``pattern``) follow Python ``re`` semantics for the
checks users run afterwards: ``.`` is rewritten to ``[^\\n]`` (xgrammar lets it
match a newline), and constructs xgrammar drops or misreads are rejected.
"""

from __future__ import annotations

from typing import Any

from deepinfer.errors import InvalidRequestError
from deepinfer.structured.disjoint import provably_disjoint
from deepinfer.structured.schema_keys import SUBSCHEMA, SUBSCHEMA_LISTS, SUBSCHEMA_MAPS
from deepinfer.structured.patterns import DATE_PATTERN, DATE_TIME_PATTERN, TIME_PATTERN  # noqa: F401
from deepinfer.structured.schema_rules import normalize_schema

__all__ = ["check_json_schema", "check_xgrammar", "check_regex", "rewrite_regexes", "provably_disjoint", "VALIDATION_KEYWORDS", "ENFORCED_FORMATS", "APPROXIMATED_FORMATS", "DATE_PATTERN"]

#: "format" values whose xgrammar grammar admits only values jsonschema's FormatChecker
#: accepts (fuzzed: random walks through each format's grammar, every result checked).
#: date / date-time / time never reach here: ``schema_rules`` compiles them as exact patterns.
ENFORCED_FORMATS = frozenset({"email", "duration", "uuid", "uri", "uri-reference", "json-pointer"})
#: Formats xgrammar only approximates (fuzzing found e.g. 01.2.3.4 for ipv4, 70-character
#: hostname labels): not xgrammar's; the llguidance backend takes ipv4 / ipv6 / hostname.
APPROXIMATED_FORMATS = frozenset({"ipv4", "ipv6", "hostname", "uri-template", "relative-json-pointer"})
#: Keywords that constrain a value (everything else is an annotation or unknown, which
#: validators ignore). xgrammar drops every one of them that sits beside anyOf / oneOf /
#: allOf / $ref (probed: ``required`` and even ``type`` beside ``anyOf`` are not enforced),
#: and every one beside ``enum`` / ``const`` but ``type``.
VALIDATION_KEYWORDS = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties",
    "propertyNames", "unevaluatedProperties", "minProperties", "maxProperties", "items", "prefixItems",
    "additionalItems", "unevaluatedItems", "minItems", "maxItems", "uniqueItems", "contains", "minContains",
    "maxContains", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
    "maxLength", "pattern", "format", "$ref", "anyOf", "oneOf", "allOf", "not", "if", "then", "else",
    "dependentRequired", "dependentSchemas", "dependencies"})
_COMBINATORS = ("anyOf", "oneOf", "allOf", "$ref")
_NUMERIC_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
#: Validation keywords xgrammar accepts but does not enforce.
_IGNORED = ("contains", "minContains", "maxContains", "not", "if", "then", "else", "dependentRequired",
            "dependentSchemas", "dependencies", "contentEncoding", "contentMediaType", "contentSchema",
            "$dynamicRef", "$recursiveRef")
#: Letter escapes xgrammar's regex parser understands (others: literal letter or error).
_LETTER_ESCAPES = frozenset("dDwWsSnrtfvxu")


def _err(where: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"SamplingParams.structured_output: {where}: {message}", field="structured_output")


# ------------------------------------------------------------------------- regex
def check_regex(regex: str, where: str = "regex") -> str:
    """Return ``regex`` with ``.`` made newline-free; raise on unsupported syntax."""
    out: list[str] = []
    i, n, in_class = 0, len(regex), False
    while i < n:
        c = regex[i]
        if c == "\\":
            if i + 1 >= n:
                raise _err(where, f"regex {regex!r} ends with a lone backslash")
            e = regex[i + 1]
            if (e.isascii() and e.isalpha() and e not in _LETTER_ESCAPES) or e in "123456789":
                raise _err(where, f"regex escape '\\{e}' at position {i} is not supported by the grammar "
                                  f"backend (word boundaries, \\A/\\Z, unicode classes and backreferences are not)")
            out.append(regex[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            out.append(c)
            # ']' right after '[' or '[^' is a literal, not the end of the class
            j = i + 1 + (regex[i + 1:i + 2] == "^")
            if regex[j:j + 1] == "]":
                out.append(regex[i + 1:j + 1])
                i = j + 1
            else:
                i += 1
            continue
        elif c == "(" and regex[i + 1:i + 2] == "?" and regex[i + 2:i + 3] != ":":
            raise _err(where, f"regex group '{regex[i:i + 4]}...' at position {i} is not supported "
                              f"(lookaround, named groups, inline flags and comments are not; '(?:' is)")
        elif c == "^" and i != 0:
            raise _err(where, f"regex anchor '^' at position {i} is only supported at the start")
        elif c == "$" and i != n - 1:
            raise _err(where, f"regex anchor '$' at position {i} is only supported at the end")
        elif c == ".":
            out.append("[^\\n]")  # Python's '.', not xgrammar's (which also matches '\n')
            i += 1
            continue
        out.append(c)
        i += 1
    if in_class:
        raise _err(where, f"regex {regex!r} has an unterminated character class")
    return "".join(out)


# ------------------------------------------------------------------- JSON schema
def _optional_group_with_repeat(regex: str) -> bool:
    """Whether ``regex`` has a group made optional or repeated (``(...)?``, ``(...)*``) whose body
    repeats something itself (``+``, ``*``, ``{``): xgrammar's JSON-schema pattern conversion
    lets such a group skip its leading part (``^1(x[a-z]+)?$`` accepted "1ab"; probed)."""
    stack: list[tuple[int, bool]] = []  # (start, body has a repeat)
    i, in_class = 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "(":
            stack.append((i, False))
        elif c in "+*{" and stack:
            stack[-1] = (stack[-1][0], True)
        elif c == ")" and stack:
            _, repeats = stack.pop()
            if repeats and regex[i + 1:i + 2] in ("?", "*"):
                return True
            if repeats and stack:
                stack[-1] = (stack[-1][0], True)
        i += 1
    return False


def _check_keywords(schema: dict, where: str, root: Any) -> None:
    if schema.get("pattern") in (TIME_PATTERN, DATE_TIME_PATTERN):
        # xgrammar's JSON-pattern conversion accepts e.g. "11:29:322-12:12" for the time
        # pattern (an optional fraction group before the zone alternation is misread)
        raise _err(where, "JSON schema format 'time' / 'date-time' is not enforced exactly by the xgrammar backend")
    if isinstance(schema.get("pattern"), str) and _optional_group_with_repeat(schema["pattern"]):
        raise _err(where, "JSON schema 'pattern' with an optional group that repeats inside is not enforced "
                          "exactly by the xgrammar backend (it can skip the group's leading part)")
    required, props = schema.get("required"), schema.get("properties")
    if isinstance(required, list):
        listed = props if isinstance(props, dict) else {}
        missing = [r for r in required if r not in listed]
        if missing:  # strict mode (no unlisted keys) drops such a requirement instead of refusing
            raise _err(where, f"JSON schema 'required' names {missing[:5]} not listed in 'properties': the "
                              f"xgrammar backend does not enforce them")
    for key in _IGNORED:
        if key in schema:
            raise _err(where, f"JSON schema keyword {key!r} is not enforced by the grammar backend; "
                              f"remove it or express the constraint with supported keywords")
    if schema.get("uniqueItems") is True:
        raise _err(where, "JSON schema keyword 'uniqueItems': true is not enforced by the grammar backend")
    if "multipleOf" in schema and (schema.get("type") != "integer" or not isinstance(schema["multipleOf"], int)):
        raise _err(where, "JSON schema keyword 'multipleOf' is only enforced for type 'integer' with an "
                          "integer divisor")
    fmt = schema.get("format")
    if fmt in APPROXIMATED_FORMATS:
        raise _err(where, f"JSON schema format {fmt!r} is only approximated by the grammar backend (it admits "
                          f"values a format checker rejects); use a 'pattern' instead. Exact formats: "
                          f"{sorted(ENFORCED_FORMATS)}")
    if fmt is not None and fmt not in ENFORCED_FORMATS:
        raise _err(where, f"JSON schema format {fmt!r} is not enforced by the grammar backend; "
                          f"supported formats: {sorted(ENFORCED_FORMATS)}")
    _check_interactions(schema, where)
    ref = schema.get("$ref")
    if ref is not None and not (ref == "#" or str(ref).startswith("#/")):
        raise _err(where, f"JSON schema $ref {ref!r}: only local references ('#/...') are supported")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise _err(where, "JSON schema 'allOf' with more than one subschema is not enforced by the grammar "
                          "backend; merge the subschemas into one")
    if isinstance(schema.get("items"), list):
        raise _err(where, "JSON schema 'items' as a list (draft-07 tuples) is not supported; use 'prefixItems'")
    branches = schema.get("oneOf")
    if isinstance(branches, list):
        for i in range(len(branches)):
            for j in range(i + 1, len(branches)):
                if not provably_disjoint(branches[i], branches[j], root):
                    raise _err(where, f"JSON schema 'oneOf' branches {i} and {j} may overlap, and the grammar "
                                      f"backend would enforce only anyOf; give branches distinct 'type's or a "
                                      f"required 'const' discriminator property, or use 'anyOf'")


def _check_interactions(schema: dict, where: str) -> None:
    """Keywords xgrammar drops when they meet others in one subschema."""
    validating = sorted(k for k in schema if k in VALIDATION_KEYWORDS)
    for key in _COMBINATORS:
        if key in schema:
            beside = [k for k in validating if k != key]
            if beside:
                raise _err(where, f"JSON schema keywords {beside} beside {key!r} are not enforced by the xgrammar "
                                  f"backend (it drops them); move them into every branch")
    for key in ("enum", "const"):
        beside = [k for k in validating if k not in (key, "type", "enum", "const")]
        if key in schema and beside:
            raise _err(where, f"JSON schema keywords {beside} beside {key!r} are not enforced by the xgrammar "
                              f"backend; list only the values that satisfy them")
    bounds = [k for k in _NUMERIC_BOUNDS if k in schema]
    if "multipleOf" in schema and bounds:
        raise _err(where, f"JSON schema 'multipleOf' together with {bounds} is not enforced by the xgrammar "
                          f"backend (it drops multipleOf)")
    lengths = [k for k in ("minLength", "maxLength") if k in schema]
    for key in ("pattern", "format"):
        if key in schema and lengths:
            raise _err(where, f"JSON schema {key!r} together with {lengths} is not enforced by the xgrammar "
                              f"backend (it drops the length bounds)")


def _closed(schema: dict) -> bool:
    """Only the listed properties can appear (xgrammar's strict mode closes an object whose
    additionalProperties is absent; a patternProperties name could still match)."""
    return schema.get("additionalProperties", False) is False and not schema.get("patternProperties") \
        and schema.get("unevaluatedProperties", False) is False


def _walk(schema: Any, where: str, xgrammar: bool = True, root: Any = None) -> Any:
    """Check one subschema (xgrammar's rules unless ``xgrammar`` is False) and return a copy
    with its regexes rewritten."""
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        raise _err(where, f"a JSON schema must be an object or a boolean, got {schema!r}")
    if xgrammar:
        _check_keywords(schema, where, root)
    out = dict(schema)
    if isinstance(schema.get("pattern"), str):
        out["pattern"] = check_regex(schema["pattern"], f"{where}/pattern")
    for key in SUBSCHEMA:
        if key in schema and not isinstance(schema[key], list):
            out[key] = _walk(schema[key], f"{where}/{key}", xgrammar, root)
    for key in SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            sub = {}
            for name, value in schema[key].items():
                if xgrammar and value is False and key == "properties":
                    if not _closed(schema):
                        raise _err(f"{where}/{key}/{name}", "a forbidden property ('false' schema) of an open "
                                                            "object is not expressible in the xgrammar backend")
                    continue  # forbidden in a closed object (strict mode): dropping it changes nothing
                new_name = check_regex(name, f"{where}/{key}") if key == "patternProperties" else name
                sub[new_name] = _walk(value, f"{where}/{key}/{name}", xgrammar, root)
            out[key] = sub
    for key in SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [_walk(s, f"{where}/{key}/{i}", xgrammar, root) for i, s in enumerate(schema[key])]
    return out


def check_xgrammar(schema: dict) -> dict:
    """xgrammar's part of admission, on a schema ``normalize_schema`` returned: raise
    InvalidRequestError naming the first construct xgrammar would weaken (by JSON pointer,
    e.g. ``schema/properties/tags``); else return the schema to compile (regexes rewritten)."""
    return _walk(schema, "schema", root=schema)


def rewrite_regexes(schema: dict) -> dict:
    """Only the regex rules (Python ``re`` semantics, unsupported syntax rejected): the
    part of this module the llguidance backend needs too."""
    return _walk(schema, "schema", xgrammar=False, root=schema)


def check_json_schema(schema: dict) -> dict:
    """Backend-independent rules (``schema_rules``) then xgrammar's: the schema to compile."""
    return check_xgrammar(normalize_schema(schema))
