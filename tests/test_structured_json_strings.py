"""Length-bounded JSON strings stay valid JSON: xgrammar's schema converter lets raw control
characters into strings with minLength / maxLength (invalid per RFC 8259, rejected by strict
parsers); the compiler narrows them to the characters its unbounded strings allow."""

from __future__ import annotations

import pytest

xgr = pytest.importorskip("xgrammar")
testing = pytest.importorskip("xgrammar.testing")

from deepinfer.structured.compiler import valid_json_strings  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 4},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}}},
          "required": ["name", "tags"]}


def _accepts(grammar, text: str) -> bool:
    return testing._is_grammar_accept_string(grammar, text)


def test_bounded_strings_reject_raw_control_characters_and_keep_their_bounds() -> None:
    raw = xgr.Grammar.from_json_schema(SCHEMA)
    fixed = xgr.Grammar.from_ebnf(valid_json_strings(str(raw)))
    bad = ['{"name": "a\x01b", "tags": []}', '{"name": "ab", "tags": ["\x1f"]}', '{"name": "\tx", "tags": []}']
    assert any(_accepts(raw, s) for s in bad)  # the gap being closed (fails if xgrammar fixes it: drop the fix)
    assert not any(_accepts(fixed, s) for s in bad)
    for text, ok in [('{"name": "abcd", "tags": ["x", "yz"]}', True), ('{"name": "a\x7f", "tags": []}', True),
                     ('{"name": "", "tags": []}', False), ('{"name": "abcde", "tags": []}', False),
                     ('{"name": "ab", "tags": ["long"]}', False)]:
        assert _accepts(fixed, text) == ok, text
