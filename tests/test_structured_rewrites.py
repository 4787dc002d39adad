"""Exact rewrites that admit more real-world schemas (issue 27's rejection target), each
checked by compiling the schema and validating random walks through its grammar
(jsonschema, formats checked): ``oneOf`` proved disjoint through ``$ref`` and the
enclosing type, ``dependencies`` as ``anyOf``, unsatisfiable optional members as
``false``, annotations that merely look like schemas, integer bounds past 64 bits beside
``null``; and the llguidance defects guarded (run in a subprocess, so a crash fails the
test instead of killing pytest)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from deepinfer.errors import InvalidRequestError
from deepinfer.structured.backends import plan_spec
from deepinfer.structured.disjoint import provably_disjoint
from deepinfer.structured.spec import StructuredOutputSpec

from structured_common import byte_pool, random_walks

pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")
V = jsonschema.Draft202012Validator

_DEFS = {"definitions": {"obj": {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]},
                         "alias": {"$ref": "#/definitions/obj"}}}
#: schema -> the backend auto must choose (each was rejected before its rewrite existed)
ADMITTED = {
    # proved disjoint before either backend sees them, so oneOf reaches xgrammar as anyOf
    "oneOf_ref_or_null": ({**_DEFS, "type": "object", "properties": {"x": {"oneOf": [
        {"$ref": "#/definitions/alias"}, {"type": "null"}]}}}, "xgrammar"),
    "oneOf_array_or_ref": ({**_DEFS, "oneOf": [{"type": "array", "items": {"$ref": "#/definitions/obj"},
                                                "maxItems": 2}, {"$ref": "#/definitions/obj"}]}, "xgrammar"),
    "dependencies_names": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                            "dependencies": {"a": ["b"]}}, "llguidance"),
    "dependencies_schema": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                             "dependentSchemas": {"a": {"required": ["b"], "properties": {
                                 "b": {"enum": ["on", "off"]}}}}}, "llguidance"),
    "unsatisfiable_optional_property": ({"type": "object", "properties": {
        "builtin": {"type": "object", "enum": ["MODIFIABLE", "DELETABLE"]}, "n": {"type": "integer"}},
        "required": ["n"]}, "xgrammar"),
    "unsatisfiable_branch_dropped": ({"anyOf": [{"type": "string", "minLength": 3, "maxLength": 1},
                                                {"type": "integer", "minimum": 0, "maximum": 9}]}, "xgrammar"),
    "annotation_that_looks_like_a_schema": ({"type": "string", "format": "ipv4",
                                             "self": {"format": "jsonschema", "vendor": "x"}}, "llguidance"),
    "utc_millisec_number": ({"type": "integer", "format": "utc-millisec", "minimum": 0}, "xgrammar"),
    "int64_bounds_beside_null": ({"type": ["integer", "null"], "minimum": -(2**70), "maximum": 2**70},
                                 "xgrammar"),
}


def _walk(pool, schema: dict, seed: int) -> tuple[str, list[str]]:  # type: ignore[no-untyped-def]
    spec = StructuredOutputSpec("json", schema)
    pool.check(spec)
    texts = [t for t in random_walks(pool.submit(spec).result(), 40, seed) if t is not None]
    validator = V(schema, format_checker=V.FORMAT_CHECKER)
    for text in texts:
        assert validator.is_valid(json.loads(text)), f"{pool.plan(spec).backend} seed={seed}: {text!r} fails"
    return pool.plan(spec).backend, texts


@pytest.fixture(scope="module")
def pool():  # type: ignore[no-untyped-def]
    return byte_pool("auto")


@pytest.mark.parametrize("name", sorted(ADMITTED))
def test_rewritten_schemas_are_admitted_and_exact(name: str, pool, fresh_seed: int) -> None:  # type: ignore
    schema, backend = ADMITTED[name]
    chosen, texts = _walk(pool, schema, fresh_seed)
    assert chosen == backend and len(texts) >= 5, (chosen, len(texts))


def test_unsatisfiable_members_never_appear_and_required_ones_still_refuse(pool, fresh_seed: int) -> None:  # type: ignore
    schema = ADMITTED["unsatisfiable_optional_property"][0]
    _, texts = _walk(pool, schema, fresh_seed)
    assert all("builtin" not in json.loads(t) for t in texts)
    required = {**schema, "required": ["n", "builtin"]}
    with pytest.raises(InvalidRequestError, match=r"schema/properties/builtin/enum: no value of 'enum'"):
        plan_spec(StructuredOutputSpec("json", required))
    with pytest.raises(InvalidRequestError, match=r"schema/anyOf/0/minLength"):  # every branch unsatisfiable
        plan_spec(StructuredOutputSpec("json", {"anyOf": [{"type": "string", "minLength": 3, "maxLength": 1}]}))


def test_dependencies_are_enforced_both_ways(pool) -> None:  # type: ignore[no-untyped-def]
    schema = ADMITTED["dependencies_names"][0]
    spec = StructuredOutputSpec("json", schema)
    from deepinfer.structured.matcher import GrammarViolation, RequestGrammar

    compiled = pool.submit(spec).result()
    for text, ok in (('{"a": 1, "b": 2}', True), ('{"b": 2}', True), ("{}", True), ('{"a": 1}', False)):
        g = RequestGrammar(compiled)
        try:
            for b in [*text.encode(), 256]:
                g.accept(b)
            accepted = g.is_terminated
        except GrammarViolation:
            accepted = False
        assert accepted == ok, text


def test_disjointness_needs_a_proof() -> None:
    disc_a = {"properties": {"k": {"const": "a"}}, "required": ["k"]}
    disc_b = {"properties": {"k": {"const": "b"}}, "required": ["k"]}
    # a discriminator separates objects only: a string validates both branches
    assert not provably_disjoint(disc_a, disc_b)
    assert provably_disjoint(disc_a, disc_b, within={"object"})
    assert provably_disjoint({"type": "number"}, {"const": "x"}) and not provably_disjoint({"type": "number"},
                                                                                          {"const": 1})
    assert not provably_disjoint({"type": "integer"}, {"type": "number"})
    root = {"$defs": {"s": {"type": "string"}}}
    assert provably_disjoint({"$ref": "#/$defs/s"}, {"type": "null"}, root)
    assert not provably_disjoint({"$ref": "#/$defs/missing"}, {"type": "null"}, root)
    # without a type, a string validates both branches, so oneOf refuses it: objects only, exactly
    plan = plan_spec(StructuredOutputSpec("json", {"oneOf": [disc_a, disc_b]}))
    assert all(b.get("type") == "object" for b in plan.source["anyOf"])
    with pytest.raises(InvalidRequestError, match="may overlap"):  # overlapping oneOf stays refused
        plan_spec(StructuredOutputSpec("json", {"oneOf": [disc_a, {"type": "string"}]}))


_GUARD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import jsonschema
from structured_common import byte_pool, random_walks
from deepinfer.errors import InvalidRequestError
from deepinfer.structured.spec import StructuredOutputSpec
out = []
for mode in ("llguidance", "auto"):
    pool = byte_pool(mode)
    for schema in json.loads(sys.argv[2]):
        spec = StructuredOutputSpec("json", schema)
        try:
            pool.check(spec)
            texts = [t for t in random_walks(pool.submit(spec).result(), 10, 0) if t is not None]
        except InvalidRequestError as e:
            out.append(["refused", e.field, str(e)[:200]]); continue
        v = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        out.append(["walked", len(texts), all(v.is_valid(json.loads(t)) for t in texts)])
print(json.dumps(out))
"""


def test_llguidance_defects_are_guarded() -> None:
    """Bounds at and below -2**63 (llguidance crashed or failed there; it clamps past 64 bits),
    integer bounds a double cannot hold (both backends read f64: rounded inward here), and second 60 in date-time / time (its own formats allow it; the checker does not): each
    is refused naming the field or compiles to a grammar whose walks all validate."""
    schemas = [{"type": "integer", "minimum": -(2**63) - 1},
               {"type": "integer", "minimum": -(2**63), "maximum": 0},
               {"type": ["integer", "null"], "exclusiveMinimum": -(10**30)},
               {"type": "integer", "maximum": -(2**63) + 100},
               {"type": "number", "minimum": -(10**30)},
               {"type": "integer", "multipleOf": 3, "minimum": -(10**25), "maximum": 10**25},
               # bounds above 2**53 that no double holds: llguidance rounded the minimum down
               {"type": "integer", "minimum": 9223372036854770000, "exclusiveMaximum": 2**64},
               {"type": "integer", "minimum": -9223372036854774000, "maximum": -9223372036854770000},
               {"type": "string", "format": "date-time"},
               {"type": "object", "dependencies": {"t": {"properties": {"t": {"format": "time"}}}},
                "properties": {"t": {"type": "string"}}}]
    tests_dir = str(Path(__file__).parent)
    run = subprocess.run([sys.executable, "-c", _GUARD, tests_dir, json.dumps(schemas)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, f"rc={run.returncode} (a crash is negative): {run.stderr[-2000:]}"
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(results) == 2 * len(schemas)
    for (kind, a, b), schema in zip(results, schemas * 2):
        if kind == "refused":
            assert a == "structured_output", (schema, b)
        else:
            assert b is True, f"an output of {schema} fails it"


def test_required_names_outside_properties_are_not_xgrammars(pool, fresh_seed: int) -> None:  # type: ignore
    """xgrammar's strict mode drops a 'required' name that 'properties' does not list (it
    emitted {} for this schema, which fails it): such schemas go to llguidance, whose walks
    all carry the name."""
    schema = {"type": "object", "properties": {"level": {"type": "integer"}}, "required": ["type"]}
    with pytest.raises(InvalidRequestError, match=r"'required' names \['type'\] not listed in 'properties'"):
        plan_spec(StructuredOutputSpec("json", schema), "xgrammar")
    backend, texts = _walk(pool, schema, fresh_seed)
    assert backend == "llguidance" and texts and all("type" in json.loads(t) for t in texts)


def test_bench_validator_takes_multiple_of_in_decimal() -> None:
    from deepinfer.structured.corpus_bench import validator_for

    cents = validator_for({"type": "number", "multipleOf": 0.01})
    assert cents.is_valid(8518026.28) and not cents.is_valid(8518026.285)  # jsonschema's float division: neither
    assert not V({"type": "number", "multipleOf": 0.01}).is_valid(8518026.28)  # why the bench has its own
    sevens = validator_for({"type": "integer", "multipleOf": 7, "minimum": 10})
    assert sevens.is_valid(14) and not sevens.is_valid(8185) and not sevens.is_valid(7)


def test_ref_targets_outside_the_schema_keywords_are_checked(pool, fresh_seed: int) -> None:  # type: ignore
    """A $ref into an annotation key (Azure's "#/resourceDefinitions/...") reaches a subschema
    the admission passes did not walk: its unlisted 'required' name (which xgrammar drops) and
    its regex (Python's '.' never matches a newline) are checked like any other."""
    schema = {"resourceDefinitions": {"cm": {"type": "object", "properties": {"t": {"type": "string",
                                                                                    "pattern": "^a.b$"}},
                                             "required": ["t", "location"]}},
              "type": "object", "properties": {"cm": {"$ref": "#/resourceDefinitions/cm"}}, "required": ["cm"]}
    with pytest.raises(InvalidRequestError, match=r"'required' names \['location'\] not listed"):
        plan_spec(StructuredOutputSpec("json", schema), "xgrammar")
    backend, texts = _walk(pool, schema, fresh_seed)
    assert backend == "llguidance" and texts and all("location" in json.loads(t)["cm"] for t in texts)
    plain = {**schema, "resourceDefinitions": {"cm": {"type": "string", "pattern": "^a.b$"}}}
    source = json.dumps(plan_spec(StructuredOutputSpec("json", plain), "xgrammar").source)
    assert "a[^\\\\n]b" in source, source  # the hoisted target's '.' was rewritten


def test_optional_group_with_a_repeat_is_not_xgrammars(pool, fresh_seed: int) -> None:  # type: ignore
    """xgrammar's JSON pattern conversion let ``(x[a-z]+)?`` skip its 'x' (SchemaStore's
    sponge-mixins version pattern emitted "89KZ..."): such patterns go to llguidance, exact."""
    schema = {"type": "string", "pattern": "^(\\d{1,5})(?:\\.(\\d{1,5}))?(-[a-zA-Z0-9_\\-]+)?$"}
    with pytest.raises(InvalidRequestError, match="optional group that repeats inside"):
        plan_spec(StructuredOutputSpec("json", schema), "xgrammar")
    backend, texts = _walk(pool, schema, fresh_seed)
    assert backend == "llguidance" and len(texts) >= 5
