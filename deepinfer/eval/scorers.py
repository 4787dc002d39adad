"""Answer extraction and per-item verdicts for AIME, GPQA Diamond and HLE.

Verdicts are ``correct`` | ``wrong`` | ``unparseable`` | ``skipped``. Extraction is strict
on purpose: a final answer counts only when it is boxed (``\\boxed{...}``) or stated on an
``Answer: ...`` line. Guessing "the last number in the text" would credit noise, which is
exactly what a random-weight model produces, and would hide regressions after tuning.
Accuracy counts unparseable answers as wrong; skipped items (HLE images) are excluded.

The graded text is the recipe-parsed answer (``content``), not the thinking: a model that
never closes ``</think>`` has given no answer.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any, Callable

__all__ = ["Verdict", "JudgeRequest", "Judge", "last_boxed", "extract_integer", "extract_letter",
           "extract_short_answer", "answers_match", "score_record"]

_ANSWER = r"(?i:\bfinal\s+answer|\banswer)\**\s*(?:is|:|=)?\s*\**\s*[:=]?\s*"


@dataclass
class Verdict:
    """The scoring of one record."""

    id: str
    verdict: str  # correct | wrong | unparseable | skipped
    extracted: str | None
    reference: str
    method: str  # how the answer was found: boxed | answer-line | judge | none | skipped

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class JudgeRequest:
    """What a free-form judge sees for one HLE exactMatch item."""

    id: str
    question: str
    response: str
    extracted: str | None
    reference: str


#: A pluggable grader for free-form answers (e.g. an LLM judge); True means correct.
Judge = Callable[[JudgeRequest], bool]


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces allowed), else None."""
    found = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*(\{)?", text):
        if m.group(1) is None:  # "\boxed 42": the token after the command
            tok = re.match(r"\s*([^\s$]+)", text[m.end():])
            found = tok.group(1) if tok else found
            continue
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = text[m.end():i - 1]
    return found


def _clean(s: str) -> str:
    """Drop LaTeX/markdown wrapping: $, \\text{..}, \\mathrm{..}, spacing commands, ** and a final period."""
    s = re.sub(r"\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\[,;!: ]|~", "", s).replace("$", "").replace("**", "")
    return s.strip().rstrip(".").strip()


def extract_integer(text: str) -> tuple[int | None, str]:
    """AIME: the boxed integer, else the one after ``answer is``/``Answer:``; (None, method) if none."""
    boxed = last_boxed(text)
    if boxed is not None:
        value = _clean(boxed).replace(",", "")
        return (int(value), "boxed") if re.fullmatch(r"-?\d+", value) else (None, "boxed")
    matches = re.findall(_ANSWER + r"\$?\s*(-?\d[\d,]*)(?![\d.]*\d)", text)
    if matches:
        return int(matches[-1].replace(",", "")), "answer-line"
    return None, "none"


def extract_letter(text: str, letters: str = "ABCDEFGHIJKLMNOPQRSTUVWXYZ") -> tuple[str | None, str]:
    """Multiple choice: a boxed letter, else the letter after ``Answer:`` (uppercase only, so the
    article in "the answer is a ..." is not read as option A)."""
    boxed = last_boxed(text)
    if boxed is not None:
        value = _clean(boxed).strip("()")
        return (value, "boxed") if len(value) == 1 and value in letters else (None, "boxed")
    matches = re.findall(_ANSWER + r"\(?\s*([A-Z])\s*\)?(?![A-Za-z0-9])", text)
    matches = [m for m in matches if m in letters]
    return (matches[-1], "answer-line") if matches else (None, "none")


def extract_short_answer(text: str) -> tuple[str | None, str]:
    """HLE exactMatch: the last ``Answer: ...`` line, else the last boxed expression."""
    lines = re.findall(r"(?im)^[\s>*#]*(?:final\s+)?answer\**\s*:\**\s*(.+?)\s*$", text)
    if lines:
        return _clean(lines[-1]), "answer-line"
    boxed = last_boxed(text)
    return (_clean(boxed), "boxed") if boxed is not None else (None, "none")


def _normal(s: str) -> str:
    s = _clean(s).lower().strip("'\"`")
    return re.sub(r"\s+", " ", s).strip()


def answers_match(answer: str, reference: str) -> bool:
    """Exact match after normalisation; numbers compare by value ("0.5" == "1/2" == "1,000"/1000)."""
    a, b = _normal(answer), _normal(reference)
    if a == b:
        return True
    try:
        return Fraction(a.replace(",", "")) == Fraction(b.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return False


def _graded_text(record: dict[str, Any]) -> str:
    content = record.get("content")
    return content if isinstance(content, str) else (record.get("output_text") or "")


def score_record(record: dict[str, Any], judge: Judge | None = None) -> Verdict:
    """Verdict for one generation record (see ``deepinfer.eval.runner`` for its fields)."""
    rid, ref = str(record.get("id")), str(record.get("reference", ""))
    if record.get("skipped"):
        return Verdict(rid, "skipped", None, ref, "skipped")
    text, answer_type = _graded_text(record), record.get("answer_type")
    if answer_type == "integer":
        value, method = extract_integer(text)
        if value is None:
            return Verdict(rid, "unparseable", None, ref, method)
        return Verdict(rid, "correct" if str(value) == ref.strip() else "wrong", str(value), ref, method)
    if answer_type == "multipleChoice":
        choices = record.get("choices")
        letter, method = extract_letter(text, "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:len(choices)] if choices else
                                        "ABCDEFGHIJKLMNOPQRSTUVWXYZ")
        if letter is None:
            return Verdict(rid, "unparseable", None, ref, method)
        return Verdict(rid, "correct" if letter == ref.strip().upper() else "wrong", letter, ref, method)
    if answer_type == "exactMatch":
        answer, method = extract_short_answer(text)
        if judge is not None:  # free-form grading; the judge may read the response itself
            ok = judge(JudgeRequest(rid, str(record.get("prompt", "")), text, answer, ref))
            return Verdict(rid, "correct" if ok else "wrong", answer, ref, "judge")
        if answer is None:
            return Verdict(rid, "unparseable", None, ref, method)
        return Verdict(rid, "correct" if answers_match(answer, ref) else "wrong", answer, ref, method)
    raise ValueError(f"record {rid}: answer_type must be 'integer', 'multipleChoice' or 'exactMatch', "
                     f"got {answer_type!r}")
