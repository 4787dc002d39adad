"""Whether an EBNF grammar's root derives any finite string: the productive-rule fixed point.

A grammar such as ``root ::= "a" root`` (or ``root ::= a`` / ``a ::= "x" root``) parses,
and its first step allows a token, so the first-step bitmask check in
``engine/admission.py`` admitted it; but no output ever completes it, so every request
ran to ``max_tokens`` and ended outside the grammar. Here the grammar xgrammar parsed
(``Grammar.serialize_json()``: its rules, each a tree of expressions) is checked with the
standard fixed point: a rule is *productive* when one of its alternatives consists only of
terminals and productive rules; repeat until nothing changes. A root that is not
productive is refused at admission, naming the rules it cannot do without.

Expression types of xgrammar's serialized grammar (0.2.x, format "v18"; probed): 0 byte
string, 1 character class, 2 character class star, 3 empty string, 4 rule reference,
5 sequence, 6 choices, 7 tag dispatch, 8 repeat (rule, min, max). Anything else (and tag
dispatch, which is free text between tags) counts as productive: unknown constructs are
never refused here (the bitmask check still runs after compiling).
"""

from __future__ import annotations

import json
from typing import Any

from deepinfer.errors import InvalidRequestError

__all__ = ["unproductive_root", "check_productive"]

_BYTES, _CLASS, _CLASS_STAR, _EMPTY, _REF, _SEQ, _CHOICES, _TAG_DISPATCH, _REPEAT = range(9)
_MAX_CODEPOINT = 0x10FFFF


def _class_nonempty(payload: list[int]) -> bool:
    """A character class ``[negated, lo, hi, lo, hi, ...]`` matches some codepoint."""
    negated, ranges = bool(payload[0]), sorted(zip(payload[1::2], payload[2::2]))
    if not negated:
        return any(lo <= hi for lo, hi in ranges)
    nxt = 0  # the first codepoint not yet excluded
    for lo, hi in ranges:
        if lo > nxt:
            return True
        nxt = max(nxt, hi + 1)
    return nxt <= _MAX_CODEPOINT


def unproductive_root(serialized: str) -> list[str] | None:
    """None if the root of the grammar ``serialized`` (``Grammar.serialize_json()``) derives
    some finite string (or the format is not understood); else the names of the unproductive
    rules reachable from the root, root first."""
    try:
        data = json.loads(serialized)
        rules, flat, ptr = data["rules"], data["grammar_expr_data"], data["grammar_expr_indptr"]
        ends = [*ptr[1:], len(flat)]  # the index holds each expression's start
        exprs = [flat[start:end] for start, end in zip(ptr, ends)]
        if any(len(e) < 2 or e[1] != len(e) - 2 for e in exprs):
            return None
        names, bodies, root = [r[0] for r in rules], [int(r[1]) for r in rules], int(data["root_rule_id"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    productive: set[int] = set()

    def ok(expr_id: int) -> bool:
        kind, payload = exprs[expr_id][0], exprs[expr_id][2:]
        if kind == _CLASS:
            return _class_nonempty(payload)
        if kind == _REF:
            return payload[0] in productive
        if kind == _SEQ:
            return all(ok(e) for e in payload)
        if kind == _CHOICES:
            return any(ok(e) for e in payload)
        if kind == _REPEAT:
            return payload[1] == 0 or payload[0] in productive
        return True  # byte string, class star, empty string, tag dispatch, unknown

    changed = True
    while changed:  # the fixed point: at most one pass per rule
        changed = False
        for rule_id, body in enumerate(bodies):
            if rule_id not in productive and ok(body):
                productive.add(rule_id)
                changed = True
    if root in productive:
        return None
    return [names[r] for r in _reachable(root, bodies, exprs) if r not in productive]


def _reachable(root: int, bodies: list[int], exprs: list[list[int]]) -> list[int]:
    """Rule ids referenced from ``root``, transitively, in discovery order (root first)."""
    order, seen = [root], {root}
    for rule_id in order:
        stack = [bodies[rule_id]]
        while stack:
            kind, payload = exprs[stack[-1]][0], exprs[stack.pop()][2:]
            if kind in (_REF, _REPEAT) and payload[0] not in seen:
                seen.add(payload[0])
                order.append(payload[0])
            elif kind in (_SEQ, _CHOICES):
                stack.extend(payload)
    return order


def check_productive(serialized: str) -> None:
    """Raise InvalidRequestError (field ``structured_output``) if the grammar's root derives
    no finite string (its language is empty)."""
    stuck = unproductive_root(serialized)
    if stuck is None:
        return
    others = stuck[1:6]
    via = f"; every alternative needs one of the rules {others}, which never end either" if others else \
        "; every alternative needs the rule itself or a character class no character is in"
    raise InvalidRequestError(f"SamplingParams.structured_output: grammar: rule {stuck[0]!r} derives no finite "
                              f"string, so the language is empty{via}", field="structured_output")
