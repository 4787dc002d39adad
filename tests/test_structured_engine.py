"""Structured output end to end on the tiny random model (its unconstrained output is noise).

Property: every constrained output that finishes "stop" parses and validates (jsonschema
with format checks, re.fullmatch, or an independent parser of the EBNF language) and
ends with EOS; everything else is reported "length" with max_tokens used up. Requests
run as one mixed batch of JSON/regex/EBNF/unconstrained requests, greedy and seeded,
with chunked prefill (a small token budget and long prompts) on. The same grammars are
also walked with uniformly random allowed bytes (no model), which reaches far more of
each grammar than the random model does.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time

import jsonschema
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.errors import InvalidRequestError
from deepinfer.structured.compiler import GrammarCompilerPool

pytest.importorskip("xgrammar")
MAX_TOKENS = 64
EOS = 1

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
             "age": {"type": "integer", "minimum": 0, "maximum": 120}, "ok": {"type": "boolean"}},
             "required": ["name", "age", "ok"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                                  "role": {"enum": ["admin", "dev", "ops"]}},
                 "required": ["id", "role"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    "array_bounds": {"type": "object", "properties": {"xs": {"type": "array", "minItems": 2, "maxItems": 4,
                     "items": {"type": "integer", "minimum": 0, "maximum": 9}}}, "required": ["xs"]},
    "enum_top": {"enum": ["red", "green", "blue", 7, None]},
    "number_range": {"type": "object", "properties": {"t": {"type": "number", "minimum": -1.5, "maximum": 2.5}},
                     "required": ["t"]},
    "optional": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                 "b": {"type": "boolean"}, "c": {"enum": ["x", "y"]}}, "required": ["a"]},
    "any_of": {"type": "object", "properties": {"v": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 50}, {"type": "boolean"}, {"enum": ["n/a"]}]}},
        "required": ["v"]},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"k": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 3}}, "required": ["k", "n"]}},
    "one_of_tagged": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1,
                                                                             "maximum": 9}},
         "required": ["kind", "lives"]},
        {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
         "required": ["kind", "good"]}]},
    "format_pattern": {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                       "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}, "required": ["d", "code"]},
    "refs": {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                               "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                              "required": ["x", "y"]}},
             "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
             "required": ["a", "b"]},
    "string_length": {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 5}},
                      "required": ["s"]},
}
REGEXES = {"email": r"[a-z]{3,8}@[a-z]{3,6}\.(com|org|net)", "date": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]",
           "phone": r"\(\d{3}\) \d{3}-\d{4}", "choice": r"(yes|no|maybe)"}
EBNFS = {"arith": 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9] | "(" expr ")"',
         "nested_list": 'root ::= "[" (item ("," item)*)? "]"\nitem ::= [0-9] | root',
         "pairs": 'root ::= pair (";" pair){0,2}\npair ::= [a-z] "=" [0-9]'}


# ----------------------------------------------------- independent validators
def _arith(s: str) -> bool:
    """expr := term (('+'|'-') term)*; term := digit | '(' expr ')'."""
    def expr(i: int) -> int:
        i = term(i)
        while i < len(s) and s[i] in "+-":
            i = term(i + 1)
        return i

    def term(i: int) -> int:
        if i < len(s) and s[i].isdigit() and s[i].isascii():
            return i + 1
        if i < len(s) and s[i] == "(":
            i = expr(i + 1)
            if i < len(s) and s[i] == ")":
                return i + 1
        raise ValueError
    try:
        return expr(0) == len(s)
    except (ValueError, RecursionError):
        return False


def _nested_list(s: str) -> bool:
    def ok(v: object) -> bool:
        return isinstance(v, list) and all(ok(x) or (type(x) is int and 0 <= x <= 9) for x in v)
    try:
        return " " not in s and ok(json.loads(s))
    except json.JSONDecodeError:
        return False


EBNF_CHECKS = {"arith": _arith, "nested_list": _nested_list,
               "pairs": lambda s: re.fullmatch(r"[a-z]=[0-9](;[a-z]=[0-9]){0,2}", s) is not None}


def valid(kind: str, name: str, text: str) -> bool:
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[name], format_checker=jsonschema.FormatChecker())
            return True
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
    if kind == "regex":
        return re.fullmatch(REGEXES[name], text) is not None
    return EBNF_CHECKS[name](text)


# ------------------------------------------------------ grammar random walks
def test_random_walks_through_every_grammar_validate(fresh_seed: int) -> None:
    """Explore far more of each grammar than the model does: walk it with uniformly
    random allowed bytes (byte-level vocabulary + EOS) and validate every completed walk."""
    import xgrammar as xgr

    from deepinfer.structured.checks import check_json_schema, check_regex

    eos, shifts = 256, torch.arange(32, dtype=torch.int32)
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)] + [b""], xgr.VocabType.RAW, vocab_size=257,
                             stop_token_ids=[eos])
    compiler, rng = xgr.GrammarCompiler(info), random.Random(fresh_seed)
    grammars = [("json", n, compiler.compile_json_schema(check_json_schema(x), any_whitespace=False))
                for n, x in SCHEMAS.items()]
    grammars += [("regex", n, compiler.compile_regex(check_regex(x))) for n, x in REGEXES.items()]
    grammars += [("ebnf", n, compiler.compile_grammar(x)) for n, x in EBNFS.items()]
    bitmask = xgr.allocate_token_bitmask(1, 257)
    for kind, name, compiled in grammars:
        completed = 0
        for _ in range(25):
            m, out = xgr.GrammarMatcher(compiled), bytearray()
            while len(out) < 80 and not m.is_terminated():
                m.fill_next_token_bitmask(bitmask)
                allowed = ((bitmask[0].unsqueeze(-1) >> shifts) & 1).flatten()[:257].nonzero().flatten().tolist()
                printable = [t for t in allowed if 32 <= t < 127] or [t for t in allowed if t != eos]
                t = eos if eos in allowed and (rng.random() < 0.3 or not printable) else rng.choice(printable)
                assert m.accept_token(t)
                out += bytes([t]) if t != eos else b""
            if m.is_terminated():
                completed += 1
                assert valid(kind, name, out.decode()), f"{kind}/{name} seed={fresh_seed}: {bytes(out)!r}"
        assert completed >= 5, f"{kind}/{name}: only {completed} walks completed"


# -------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def llm() -> LLM:
    # a 48-token budget with 100+-token prompts: prompts are prefilled in chunks
    return LLM(dtype="float32", max_model_len=384, max_num_batched_tokens=48, max_num_seqs=64)


def sp(seed: int | None, **kw: object) -> SamplingParams:
    """Greedy when seed is None, else temperature 1 with that seed."""
    return SamplingParams(max_tokens=kw.pop("max_tokens", MAX_TOKENS), temperature=0.0 if seed is None else 1.0,
                          seq_seed=seed or 0, **kw)  # type: ignore[arg-type]


def test_every_stop_output_validates_in_a_mixed_batch(llm: LLM, fresh_seed: int) -> None:
    cases: list[tuple[str, str]] = []
    params: list[SamplingParams] = []
    for kind, table, key in (("json", SCHEMAS, "json"), ("regex", REGEXES, "regex"), ("ebnf", EBNFS, "ebnf")):
        for name, spec in table.items():
            for seed in (None, fresh_seed):  # greedy and one seeded sample each
                cases.append((kind, name))
                params.append(sp(seed, structured_output={key: spec}))
    cases += [("none", "greedy"), ("none", "sampled")]
    # unconstrained rows run to their length (ignore_eos: the trained default may sample EOS early)
    params += [sp(None, max_tokens=12, ignore_eos=True), sp(fresh_seed, max_tokens=12, ignore_eos=True)]
    prompts = [f"Request {i}: answer in the required format. " + ("Context words. " * 40 if i % 7 == 0 else "")
               for i in range(len(params))]
    outs = llm.generate(prompts, params, use_tqdm=False)

    stops = 0
    for (kind, name), out in zip(cases, outs):
        label = f"{kind}/{name} seed={out.seq_seed}: {out.text!r}"
        if kind == "none":
            assert out.finish_reason == "length"
            continue
        assert out.finish_reason in ("stop", "length"), label
        assert out.text == llm.tokenizer.decode(out.token_ids), label  # what the matcher saw is the text
        if out.finish_reason == "stop":
            stops += 1
            assert out.token_ids[-1] == EOS and valid(kind, name, out.text), label
        else:
            assert len(out.token_ids) == MAX_TOKENS and EOS not in out.token_ids, label
    assert stops >= 0.8 * (len(cases) - 2), f"only {stops} of {len(cases) - 2} constrained outputs completed"
    # the masks never touch unconstrained rows: greedy output equals the request run alone
    alone = llm.generate([prompts[-2]], sp(None, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert alone.token_ids == outs[-2].token_ids
    assert llm.structured.stats.steps > 0 and not llm.structured.grammars and not llm.structured.pending


def test_so_args_and_structured_output_agree(llm: LLM) -> None:
    schema = SCHEMAS["nested"]
    a, b = llm.generate(["Same prompt", "Same prompt"],
                        [sp(7, so_args={"schema_type": "json", "schema": json.dumps(schema)}),
                         sp(7, structured_output={"json": schema})], use_tqdm=False)
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason


def test_unsatisfiable_within_max_tokens_is_length_not_stop(llm: LLM) -> None:
    outs = llm.generate(["x", "y"], [sp(None, max_tokens=5, structured_output={"json": SCHEMAS["refs"]}),
                                     sp(3, max_tokens=5, structured_output={"regex": REGEXES["phone"]})],
                        use_tqdm=False)
    for out, (kind, name) in zip(outs, [("json", "refs"), ("regex", "phone")]):
        assert out.finish_reason == "length" and len(out.token_ids) == 5
        assert not valid(kind, name, out.text)


def test_trigger_turns_the_grammar_on_mid_generation(llm: LLM) -> None:
    free = llm.generate(["Think first."], sp(None, max_tokens=6), use_tqdm=False)[0].token_ids
    k = next(i for i in range(2, 6) if free[i] not in free[:i])  # a token that first appears at index k
    spec = {"regex": REGEXES["choice"], "trigger": [free[k]]}
    out = llm.generate(["Think first."], sp(None, structured_output=spec), use_tqdm=False)[0]
    assert out.token_ids[:k + 1] == free[:k + 1]  # unconstrained (identical) up to and including the trigger
    assert out.finish_reason == "stop"
    assert re.fullmatch(REGEXES["choice"], llm.tokenizer.decode(out.token_ids[k + 1:]))


def test_invalid_spec_is_rejected_before_anything_is_queued(llm: LLM) -> None:
    good = sp(None, structured_output={"json": SCHEMAS["flat"]})
    bad = sp(None, structured_output={"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}})
    with pytest.raises(InvalidRequestError, match=r"sampling_params\[1\].*uniqueItems"):
        llm.generate(["a", "b"], [good, bad], use_tqdm=False)
    assert not llm.scheduler.has_unfinished() and not llm.structured.has_pending()
    assert llm.generate(["a"], good, use_tqdm=False)[0].finish_reason in ("stop", "length")  # still serving


def test_a_grammar_slower_than_the_limit_is_refused_never_run_unchecked(llm: LLM,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    original = GrammarCompilerPool._compile

    def slow_compile(self: GrammarCompilerPool, spec: object) -> object:
        release.wait(timeout=60)  # held until the test lets it finish
        return original(self, spec)  # type: ignore[arg-type]

    monkeypatch.setattr(GrammarCompilerPool, "_compile", slow_compile)
    monkeypatch.setenv("DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S", "0.3")
    slow_spec = {"regex": "(slow|grammar)[0-9]"}  # not compiled before in this module (no cache hit)
    t0 = time.monotonic()
    with pytest.raises(InvalidRequestError, match=r"sampling_params\[0\].*DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S=0.3 s") \
            as info:
        llm.generate(["c", "u"], [sp(None, structured_output=slow_spec), sp(None, max_tokens=4)], use_tqdm=False)
    assert info.value.field == "structured_output" and time.monotonic() - t0 < 10
    assert not llm.scheduler.has_unfinished() and not llm.structured.has_pending()  # nothing was queued
    release.set()  # the compile finishes in its worker and is cached: the retry runs it, checked
    monkeypatch.setenv("DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S", "30")
    constrained, free = llm.generate(["c", "u"], [sp(None, structured_output=slow_spec), sp(None, max_tokens=4)],
                                     use_tqdm=False)
    assert constrained.finish_reason == "stop" and re.fullmatch("(slow|grammar)[0-9]", constrained.text)
    assert len(free.token_ids) == 4


def test_a_grammar_layer_failure_at_compile_is_an_admission_error(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend failing in its compile worker (xgrammar's C++ "Check failed" stood in for:
    no real schema that passes the parser fails there now) is refused before anything is
    queued, naming the field; the engine serves the next call."""
    def failing_compile(self: GrammarCompilerPool, spec: object) -> object:
        raise RuntimeError("[12:00:00] grammar_compiler.cc:1: Check failed: (false) is false: boom")

    monkeypatch.setattr(GrammarCompilerPool, "_compile", failing_compile)
    spec = {"regex": "(layer|failure)[0-9]"}  # not compiled before in this module (no cache hit)
    with pytest.raises(InvalidRequestError, match=r"sampling_params\[1\].*grammar compilation failed.*Check "
                                                  r"failed") as info:
        llm.generate(["a", "b"], [sp(None, max_tokens=3), sp(None, structured_output=spec)], use_tqdm=False)
    assert info.value.field == "structured_output"
    assert not llm.scheduler.has_unfinished() and not llm.structured.has_pending()
    monkeypatch.undo()
    assert llm.generate(["a"], sp(None, structured_output=spec), use_tqdm=False)[0].finish_reason == "stop"
