"""Structured output specs and admission checks (no model).

Covers: the two spellings (structured_output / DeepInfer's so_args) with trigger,
shape errors, conflicting sampling settings, the schema/regex checks that reject
what xgrammar would silently weaken (re-probed against xgrammar, so an upgrade that
starts enforcing a keyword is noticed), and xgrammar parse errors rewrapped.
"""

from __future__ import annotations

import dataclasses
import datetime

import pytest

from deepinfer.errors import InvalidRequestError
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured import StructuredOutputSpec
from deepinfer.structured.checks import DATE_PATTERN, check_json_schema, check_regex

xgr = pytest.importorskip("xgrammar")

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("kwargs, kind, schema, trigger", [
    ({"structured_output": {"json": OBJ}}, "json", OBJ, None),
    ({"structured_output": {"json": '{"type": "string"}'}}, "json", '{"type": "string"}', None),
    ({"structured_output": {"regex": "[a-z]+", "trigger": "</think>"}}, "regex", "[a-z]+", "</think>"),
    ({"structured_output": {"ebnf": 'root ::= "a"', "trigger": [5, 6]}}, "ebnf", 'root ::= "a"', (5, 6)),
    ({"structured_output": {"json_object": True}}, "json_object", None, None),
    ({"structured_output": StructuredOutputSpec("regex", "x+")}, "regex", "x+", None),
    ({"so_args": {"schema_type": "json", "schema": OBJ}}, "json", OBJ, None),
    ({"so_args": {"schema_type": "regex", "schema": "a|b", "trigger": [9]}}, "regex", "a|b", (9,)),
])
def test_spellings(kwargs: dict, kind: str, schema: object, trigger: object) -> None:
    spec = SamplingParams(**kwargs).structured_output
    assert isinstance(spec, StructuredOutputSpec)
    assert (spec.kind, spec.schema, spec.trigger) == (kind, schema, trigger)


def test_dataclasses_replace_keeps_the_so_args_spec() -> None:
    p = SamplingParams(so_args={"schema_type": "regex", "schema": "a+", "trigger": [3]})
    q = dataclasses.replace(p, max_tokens=5)
    assert q.structured_output == p.structured_output and q.max_tokens == 5


def test_cache_key_ignores_trigger_and_dict_order() -> None:
    a = StructuredOutputSpec("json", {"type": "object", "required": [], "properties": {}}, trigger=[1])
    b = StructuredOutputSpec("json", '{"properties": {}, "required": [], "type": "object"}')
    assert a.cache_key() == b.cache_key()
    assert a.cache_key() != StructuredOutputSpec("json", OBJ, any_whitespace=True).cache_key()


@pytest.mark.parametrize("kwargs, field, fragment", [
    ({"structured_output": object()}, "structured_output", "a dict like"),
    ({"structured_output": {"json": OBJ, "regex": "a"}}, "structured_output", "exactly one of"),
    ({"structured_output": {"jsn": OBJ}}, "structured_output", "exactly one of"),
    ({"structured_output": {"json": "{not json"}}, "structured_output", "not valid JSON"),
    ({"structured_output": {"json": "[1]"}}, "structured_output", "must be a dict"),
    ({"structured_output": {"json": 3}}, "structured_output", "JSON schema dict"),
    ({"structured_output": {"regex": ""}}, "structured_output", "non-empty str"),
    ({"structured_output": {"json_object": 1}}, "structured_output", "must be True"),
    ({"structured_output": {"regex": "a", "trigger": []}}, "structured_output", "trigger"),
    ({"structured_output": {"regex": "a", "trigger": [-1]}}, "structured_output", "trigger"),
    ({"structured_output": {"regex": "a", "any_whitespace": "yes"}}, "structured_output", "any_whitespace"),
    ({"structured_output": {"regex": "a"}, "so_args": {"schema_type": "regex", "schema": "a"}},
     "structured_output", "not both"),
    ({"structured_output": {"regex": "a"}, "stop": ["x"]}, "structured_output", "stop"),
    ({"structured_output": {"regex": "a"}, "stop_token_ids": [3]}, "structured_output", "stop_token_ids"),
    ({"structured_output": {"regex": "a"}, "ignore_eos": True}, "structured_output", "ignore_eos"),
    ({"structured_output": {"regex": "a"}, "min_tokens": 2}, "structured_output", "min_tokens"),
    ({"so_args": {"schema_type": "json", "schema": "{bad"}}, "so_args", "not valid JSON"),
    ({"so_args": {"schema_type": "json", "schema": OBJ, "trigger": ""}}, "so_args", "trigger"),
    ({"so_args": {"schema_type": "json", "schema": OBJ, "x": 1}}, "so_args", "unknown keys ['x']"),
])
def test_shape_errors(kwargs: dict, field: str, fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert fragment in str(info.value) and f"SamplingParams.{field}" in str(info.value)
    assert info.value.field == field


# Each: a schema keyword xgrammar 0.2.x does not enforce (or only approximates), an
# instance that violates it, and what the rejection message names.
IGNORED_BY_XGRAMMAR = {
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,1]", "uniqueItems"),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]", "contains"),
    "not": ({"type": "integer", "not": {"const": 1}}, "1", "'not'"),
    "if": ({"type": "integer", "if": {"const": 1}, "then": {"const": 2}}, "1", "'if'"),
    "multipleOf": ({"type": "number", "multipleOf": 0.5}, "0.3", "multipleOf"),
    "format-iri": ({"type": "string", "format": "iri"}, '" "', "'iri' is not enforced"),
    "format-ipv4": ({"type": "string", "format": "ipv4"}, '"01.2.3.4"', "'ipv4' is only approximated"),
    "format-hostname": ({"type": "string", "format": "hostname"}, '"' + "a" * 70 + '"', "'hostname'"),
    # (mergeable allOf members are merged into one schema: only unmergeable ones reach here)
    "allOf": ({"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]}, '"a"', "allOf"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1", "oneOf"),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a":1}', "dependentRequired"),
    "$ref": ({"$ref": "http://example.com/x.json"}, "1", "$ref"),
    "lookahead": ({"type": "string", "pattern": "^(?=a)a+$"}, '"a"', "(?="),
}


@pytest.fixture(scope="module")
def byte_compiler() -> object:
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)], xgr.VocabType.RAW, vocab_size=256,
                             stop_token_ids=[0])
    return xgr.GrammarCompiler(info)


@pytest.mark.parametrize("name", sorted(IGNORED_BY_XGRAMMAR))
def test_weakened_keywords_are_rejected(name: str, byte_compiler: object) -> None:
    schema, violating, fragment = IGNORED_BY_XGRAMMAR[name]
    matcher = xgr.GrammarMatcher(byte_compiler.compile_json_schema(schema))  # type: ignore[attr-defined]
    assert matcher.accept_string(violating) and matcher.is_completed(), \
        f"xgrammar now enforces {name}: the check in deepinfer/structured/checks.py can be relaxed"
    with pytest.raises(InvalidRequestError) as info:
        check_json_schema({"type": "object", "properties": {"x": schema}, "required": ["x"]})
    assert fragment in str(info.value)


def test_date_format_is_compiled_as_an_exact_calendar_pattern(byte_compiler: object) -> None:
    assert check_json_schema({"type": "string", "format": "date"}) == {"type": "string", "pattern": DATE_PATTERN}
    loose = xgr.GrammarMatcher(byte_compiler.compile_json_schema({"type": "string", "format": "date"}))
    assert loose.accept_string('"2023-11-31"')  # why: xgrammar's own date format is loose
    exact = byte_compiler.compile_json_schema({"type": "string", "pattern": DATE_PATTERN})  # type: ignore
    for day in ("2024-02-29", "2000-02-29", "2023-11-30", "0001-01-01", "2023-11-31", "1900-02-29", "0000-01-01"):
        try:
            datetime.date.fromisoformat(day)
            expected = True
        except ValueError:
            expected = False
        m = xgr.GrammarMatcher(exact)
        assert (m.accept_string(f'"{day}"') and m.is_completed()) == expected, day
    with pytest.raises(InvalidRequestError, match="together with 'pattern'"):
        check_json_schema({"type": "string", "format": "date", "pattern": "^2"})


def test_error_names_the_location() -> None:
    with pytest.raises(InvalidRequestError, match=r"schema/properties/tags: .*'uniqueItems'"):
        check_json_schema({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}})


@pytest.mark.parametrize("schema", [
    {"oneOf": [{"type": "integer"}, {"type": "string"}]},
    {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
               {"type": "object", "properties": {"k": {"enum": ["b", "c"]}}, "required": ["k"]}]},
    {"allOf": [{"type": "integer", "minimum": 3}]},
    {"type": "integer", "multipleOf": 3},
    {"type": "string", "format": "date"},
    {"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x"},
    {"type": "array", "uniqueItems": False},
])
def test_supported_constructs_pass(schema: dict) -> None:
    check_json_schema(schema)


@pytest.mark.parametrize("regex, fragment", [
    (r"a\bb", r"'\b'"), (r"\Aab", r"'\A'"), (r"(a)\1", r"'\1'"), (r"(?=a)a", "lookaround"),
    (r"(?i)abc", "inline flags"), (r"a^b", "'^'"), (r"a$b", "'$'"), (r"[ab", "unterminated"),
    (r"ab\\" + "\\", "lone backslash"),
])
def test_regex_rejections(regex: str, fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_regex(regex)
    assert fragment in str(info.value)


def test_regex_dot_is_newline_free_and_classes_untouched() -> None:
    assert check_regex(r"^a.b[.^$]\.c$") == r"^a[^\n]b[.^$]\.c$"
    assert check_regex(r"[]a.]x") == r"[]a.]x"
    rewritten = check_json_schema({"properties": {"s": {"type": "string", "pattern": "a.b"}},
                                   "patternProperties": {"^x.$": {"type": "integer"}}})
    assert rewritten["properties"]["s"]["pattern"] == r"a[^\n]b"
    assert list(rewritten["patternProperties"]) == [r"^x[^\n]$"]
