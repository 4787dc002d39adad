"""Structured-output admission and the two backends (xgrammar, llguidance).

Each silently weakened schema of issue 27 either is rejected up front naming its keyword,
or compiles and then every completed random walk through its grammar validates
(jsonschema with the 2020-12 format checker). Random walks with uniformly random allowed
bytes reach far more of a grammar than a model does. The backend choice is tested both
ways (auto picks each backend; forcing one makes the other's schemas fail or move), and
the llguidance matcher is held to xgrammar's bitmask contract.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.errors import InvalidRequestError
from deepinfer.structured.admission import check_structured
from deepinfer.structured.backends import plan_spec
from deepinfer.structured.spec import StructuredOutputSpec

from structured_common import BYTE_EOS, allowed_ids, byte_pool, random_walks

pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")
V = jsonschema.Draft202012Validator

#: The issue's hand-made cases: (schema, None if it must compile, else a fragment of the rejection).
ISSUE_CASES = {
    "required_beside_anyOf": ({"type": "object", "properties": {"reqField": {"type": "string", "maxLength": 3},
                                                                "x": {"type": "integer"}},
                               "required": ["reqField"], "anyOf": [{"properties": {"x": {"type": "integer"}}},
                                                                   {"properties": {"y": {"type": "integer"}}}]},
                              None),
    "multipleOf_with_minimum": ({"type": "integer", "multipleOf": 7, "minimum": 10}, None),
    "pattern_with_minLength": ({"type": "string", "pattern": "^$", "minLength": 1}, "Unsatisfiable"),
    "enum_against_type": ({"enum": ["Explicit", "Anonymous"], "type": "object"}, "schema/enum"),
    "required_not_in_closed_properties": ({"properties": {}, "required": ["a"], "additionalProperties": False},
                                          "schema/required"),
    "type_empty": ({"type": []}, "schema/type"),
}
#: Schemas that only llguidance enforces exactly (auto must choose it), each walked and validated.
LLG_ONLY = {
    "allOf": {"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "^[ab]{1,3}$"}]},  # patterns: no merge
    "type_beside_anyOf": {"type": "string", "pattern": "^a", "anyOf": [{"maxLength": 3}, {"pattern": "^[ab]+$"}]},
    "enum_with_maxLength": {"enum": ["aaaa", "b", "cc"], "maxLength": 2},
    "pattern_with_maxLength": {"type": "string", "pattern": "^a*$", "maxLength": 3},
    "format_with_maxLength": {"type": "string", "format": "email", "maxLength": 12},
    "ipv4": {"type": "string", "format": "ipv4"},
    "date_time": {"type": "string", "format": "date-time"},  # xgrammar misreads the exact pattern
    "time": {"type": "string", "format": "time"},
    "ipv6": {"type": "string", "format": "ipv6"},
    "hostname": {"type": "string", "format": "hostname"},
    "number_multipleOf": {"type": "number", "multipleOf": 0.25, "minimum": 1, "maximum": 3},
    "integer_fractional_bound": {"type": "integer", "minimum": 2.5, "maximum": 9},
    "ref_with_siblings": {"$defs": {"s": {"type": "string", "pattern": "^a"}}, "$ref": "#/$defs/s",
                          "pattern": "^[ab]{1,3}$"},
    "disjoint_oneOf_beside_type": {"type": "object", "oneOf": [
        {"properties": {"k": {"const": "a"}}, "required": ["k"]},
        {"properties": {"k": {"const": "b"}, "n": {"type": "integer", "multipleOf": 3, "minimum": 1}},
         "required": ["k", "n"]}]},
}
#: Schemas that were llguidance's until the siblings of their combinators were pushed into the
#: branches (``branch_pushdown``): now xgrammar's, exactly.
XGRAMMAR_AFTER_PUSHDOWN = {
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"properties": {"b": {"type": "string", "maxLength": 3}}, "required": ["b"]}]},
    "type_beside_anyOf": {"type": "string", "anyOf": [{"maxLength": 3}, {"pattern": "^a+$"}]},
    "ref_with_siblings": {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2},
    "disjoint_oneOf_beside_type": {"type": "object", "oneOf": [
        {"properties": {"k": {"const": "a"}}, "required": ["k"]},
        {"properties": {"k": {"const": "b"}, "n": {"type": "integer"}}, "required": ["k", "n"]}]},
}


def _validates(schema: dict, text: str) -> bool:
    return V(schema, format_checker=V.FORMAT_CHECKER).is_valid(json.loads(text))


def _walk_and_validate(pool, schema: dict, seed: int, walks: int = 40) -> tuple[str, int]:  # type: ignore
    spec = StructuredOutputSpec("json", schema)
    pool.check(spec)
    compiled = pool.submit(spec).result()
    texts = [t for t in random_walks(compiled, walks, seed) if t is not None]
    for text in texts:
        assert _validates(schema, text), f"{pool.plan(spec).backend} seed={seed}: {text!r} fails {schema}"
    return pool.plan(spec).backend, len(texts)


@pytest.fixture(scope="module")
def pool():  # type: ignore[no-untyped-def]
    return byte_pool("auto")


def test_integer_bounds_past_64_bits_narrow_on_both_backends(fresh_seed: int) -> None:
    schema = {"type": "integer", "minimum": -(2**70), "maximum": 2**64}
    for mode in ("xgrammar", "llguidance"):
        backend, completed = _walk_and_validate(byte_pool(mode), schema, fresh_seed, walks=20)
        assert backend == mode and completed >= 10


@pytest.mark.parametrize("name", sorted(ISSUE_CASES))
def test_issue_cases_validate_or_are_rejected_up_front(name: str, pool, fresh_seed: int) -> None:  # type: ignore
    schema, rejected = ISSUE_CASES[name]
    if rejected is not None:
        with pytest.raises(InvalidRequestError) as info:
            check_structured(SamplingParams(structured_output={"json": schema}))
        assert rejected in str(info.value) and info.value.field == "structured_output"
        return
    backend, completed = _walk_and_validate(pool, schema, fresh_seed)
    assert completed >= 10, f"{name}: only {completed} walks completed on {backend}"


@pytest.mark.parametrize("name", sorted(LLG_ONLY))
def test_auto_takes_llguidance_where_only_it_is_exact(name: str, pool, fresh_seed: int) -> None:  # type: ignore
    schema = LLG_ONLY[name]
    with pytest.raises(InvalidRequestError):  # xgrammar alone: rejected, naming why
        plan_spec(StructuredOutputSpec("json", schema), "xgrammar")
    backend, completed = _walk_and_validate(pool, schema, fresh_seed)
    assert backend == "llguidance" and completed >= 5, (backend, completed)


@pytest.mark.parametrize("name", sorted(XGRAMMAR_AFTER_PUSHDOWN))
def test_pushed_down_siblings_are_xgrammars(name: str, pool, fresh_seed: int) -> None:  # type: ignore
    backend, completed = _walk_and_validate(pool, XGRAMMAR_AFTER_PUSHDOWN[name], fresh_seed)
    assert backend == "xgrammar" and completed >= 5, (backend, completed)


def test_selection_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    simple = StructuredOutputSpec("json", {"type": "object", "properties": {"a": {"type": "integer"}}})
    ipv4 = StructuredOutputSpec("json", {"type": "string", "format": "ipv4"})
    assert plan_spec(simple, "auto").backend == "xgrammar" and plan_spec(ipv4, "auto").backend == "llguidance"
    assert plan_spec(simple, "llguidance").backend == "llguidance"
    with pytest.raises(InvalidRequestError, match="'ipv4' is only approximated"):
        plan_spec(ipv4, "xgrammar")
    unique = StructuredOutputSpec("json", {"type": "array", "uniqueItems": True})
    with pytest.raises(InvalidRequestError, match="uniqueItems.*the llguidance backend cannot either"):
        plan_spec(unique, "auto")
    # the environment variable is the default policy, read when a pool is built
    monkeypatch.setenv("DEEPINFER_STRUCTURED_BACKEND", "llguidance")
    assert plan_spec(simple).backend == "llguidance" and byte_pool().plan(simple).backend == "llguidance"
    monkeypatch.setenv("DEEPINFER_STRUCTURED_BACKEND", "xgrammar")
    with pytest.raises(InvalidRequestError, match="ipv4"):
        check_structured(SamplingParams(structured_output={"json": ipv4.schema}))
    monkeypatch.setenv("DEEPINFER_STRUCTURED_BACKEND", "bogus")
    with pytest.raises(Exception, match="DEEPINFER_STRUCTURED_BACKEND"):
        plan_spec(simple)


def test_grammar_layer_errors_are_admission_errors() -> None:
    # an integer range wholly past 64 bits: xgrammar fails with "Check failed" and llguidance
    # clamps (or crashes); rejected up front naming the keyword
    with pytest.raises(InvalidRequestError, match=r"schema/properties/n/minimum: integer range past 64 bits"):
        check_structured(SamplingParams(structured_output={"json": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": 2**64}}}}))
    with pytest.raises(InvalidRequestError, match=r"^SamplingParams.structured_output: invalid regex"):
        check_structured(SamplingParams(structured_output={"regex": "(ab"}))


def test_llguidance_bitmask_equals_xgrammar(fresh_seed: int) -> None:
    """Same schema on both backends: identical masks at every step of one walk, rollback included."""
    import random

    # no strings: the backends write different (valid) subsets of JSON string escapes
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "bc"]},
                                                        "maxItems": 2},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 300},
                                               "ok": {"type": "boolean"}},
              "required": ["tags", "n"], "additionalProperties": False}
    grammars = []
    for mode in ("xgrammar", "llguidance"):
        p = byte_pool(mode)
        spec = StructuredOutputSpec("json", schema)
        from deepinfer.structured.matcher import RequestGrammar

        grammars.append(RequestGrammar(p.submit(spec).result()))
        assert p.plan(spec).backend == mode
    rng, masks = random.Random(fresh_seed), torch.zeros((2, 9), dtype=torch.int32)
    steps = 0
    while not grammars[0].is_terminated and steps < 80:
        for row, g in enumerate(grammars):
            g.fill(masks, row)
        # xgrammar never allows ids without bytes; bits past the vocabulary are not compared
        a, b = allowed_ids(masks, 0), allowed_ids(masks, 1)
        assert a == b, f"step {steps}: xgrammar {a} vs llguidance {b}"
        t = rng.choice(a)
        for g in grammars:
            g.accept(t)
            if steps % 5 == 4 and t != BYTE_EOS:  # rollback and replay keep them equal
                g.rollback(1)
                g.accept(t)
        assert grammars[0].is_completed == grammars[1].is_completed
        steps += 1
    assert grammars[0].is_terminated and grammars[1].is_terminated
    # a draft the grammar rejects leaves the llguidance matcher where it was
    g = RequestGrammar(byte_pool("llguidance").submit(StructuredOutputSpec("json", schema)).result())
    assert g.valid_prefix(list(b'{"tags": ["a"], "n": 5x')) == len(b'{"tags": ["a"], "n": 5')
    assert g.num_seen == 0 and g.valid_prefix(list(b'{"ta')) == 4


_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
           "maxContains")


@pytest.mark.parametrize("mode", ["auto", "xgrammar", "llguidance"])
@pytest.mark.parametrize("key", _COUNTS)
@pytest.mark.parametrize("value", [-1, 1.5, True, "3", None])
def test_count_keywords_must_be_non_negative_integers(mode: str, key: str, value: object) -> None:
    """Before, maxLength: -1 / minItems: -1 were admitted and minLength: -1 failed
    with xgrammar's text; now each is refused naming the keyword, its path and the range."""
    schema = {"type": "object", "properties": {"p": {"anyOf": [{"type": "null"}, {key: value}]}}}
    with pytest.raises(InvalidRequestError) as info:
        plan_spec(StructuredOutputSpec("json", schema), mode)
    assert str(info.value) == (f"SamplingParams.structured_output: schema/properties/p/anyOf/1/{key}: '{key}' "
                               f"must be a non-negative integer (0, 1, 2, ...), got {value!r}")
    assert info.value.field == "structured_output"


def test_integer_valued_counts_are_integers_and_inverted_pairs_name_both() -> None:
    for mode in ("xgrammar", "llguidance"):  # 2.0 is an integer to JSON Schema; both backends refused it
        assert plan_spec(StructuredOutputSpec("json", {"type": "string", "minLength": 2.0, "maxLength": 5}), mode)
    assert plan_spec(StructuredOutputSpec("json", {"type": "string", "minLength": 2.0}), "xgrammar").source == {
        "type": "string", "minLength": 2}
    for lo, hi, kind in (("minLength", "maxLength", "string"), ("minItems", "maxItems", "array"),
                         ("minProperties", "maxProperties", "object")):
        with pytest.raises(InvalidRequestError, match=f"schema/{lo}: '{lo}' 3 > '{hi}' 1: no {kind} satisfies"):
            plan_spec(StructuredOutputSpec("json", {"type": kind, lo: 3, hi: 1}))


@pytest.mark.parametrize("grammar, stuck", [
    ('root ::= "a" root', []),  # the first step allows "a": the bitmask check admitted these
    ('root ::= a\na ::= "x" root', ["a"]),  # mutual recursion
    ('root ::= "a" b\nb ::= "y" b | c\nc ::= "(" b ")"', ["b", "c"]),
    ('root ::= x{2,3}\nx ::= "a" x', ["x"]),  # a repeat of at least one
    ('root ::= ("a" root)+', ["root_1"]),
    ("root ::= [^\\x00-\\U0010FFFF] | root", []),  # a class no character is in
])
def test_ebnf_whose_rules_never_end_is_refused(grammar: str, stuck: list[str]) -> None:
    with pytest.raises(InvalidRequestError, match="rule 'root' derives no finite string, so the language is "
                                                  "empty") as info:
        plan_spec(StructuredOutputSpec("ebnf", grammar))
    assert (str(stuck) in str(info.value)) if stuck else "the rule itself" in str(info.value)


@pytest.mark.parametrize("grammar", [
    'root ::= "a" root | "b"', 'root ::= "a" b\nb ::= "c" | b "d"', 'root ::= ("a" root)*',
    'root ::= x{0,3}\nx ::= "a" x', 'root ::= "a"{2,3} [^b]* ("x" root)? t\nt ::= "<" root ">" | ""',
    'root ::= [^\\x00-\\x10] | root', 'root ::= TagDispatch(("<a>", x))\nx ::= "b"',
    'root ::= term (("+" | "*") term)*\nterm ::= [0-9]+ | "(" root ")"'])
def test_ebnf_with_a_finite_string_is_admitted(grammar: str) -> None:
    assert plan_spec(StructuredOutputSpec("ebnf", grammar)).source == grammar
    check_structured(SamplingParams(structured_output={"ebnf": grammar}))
