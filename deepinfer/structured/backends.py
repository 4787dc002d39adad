"""Which grammar backend enforces a spec, decided per spec at admission.

``DEEPINFER_STRUCTURED_BACKEND`` (deepinfer/envs.py) picks the policy:

* ``auto`` (default): a JSON schema goes to xgrammar when xgrammar enforces it exactly
  (``checks.check_xgrammar`` and xgrammar's parser accept it), else to llguidance when
  llguidance does (``llg_backend.llg_grammar``: its compiler refuses what it does not
  implement, and ``LLG_EXACT_FORMATS`` lists the formats fuzzed exact); else the request
  is rejected with both backends' reasons;
* ``xgrammar`` / ``llguidance``: only that backend (rejected if it cannot).

Every JSON schema first goes through ``schema_rules.normalize_schema`` (contradictions
rejected, exact rewrites), whatever the backend. Regex and EBNF specs always use
xgrammar (EBNF is its grammar dialect; its regex rules are in ``checks.check_regex``); an
EBNF is parsed here and its root must derive a finite string (``ebnf_productive``).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from deepinfer.errors import InvalidRequestError
from deepinfer.structured.checks import check_regex, check_xgrammar, rewrite_regexes
from deepinfer.structured.ebnf_productive import check_productive
from deepinfer.structured.llg_rewrites import LLG_EXACT_FORMATS, check_llg_formats, llg_rewrite
from deepinfer.structured.schema_rules import normalize_schema, schema_error
from deepinfer.structured.spec import StructuredOutputSpec

__all__ = ["BACKENDS", "LLG_EXACT_FORMATS", "GrammarPlan", "plan_spec", "backend_mode", "clean_xgrammar_error",
           "xgrammar_json_options"]

BACKENDS = ("xgrammar", "llguidance")


_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def clean_xgrammar_error(error: BaseException) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix."""
    return _LOG_PREFIX.sub("", str(error).strip())


def xgrammar_json_options(spec: StructuredOutputSpec) -> dict[str, Any]:
    """``Grammar.from_json_schema`` options of a spec."""
    # strict_mode: no properties/items beyond the schema's (output stays valid;
    # it only narrows what "additional" allows by default). json_object keeps any keys.
    return {"any_whitespace": spec.any_whitespace, "strict_mode": spec.kind == "json"}


@dataclass(frozen=True)
class GrammarPlan:
    """What to compile: ``backend`` ("xgrammar" | "llguidance"), ``kind`` (spec kind) and
    ``source`` (xgrammar: the checked schema / regex / EBNF; llguidance: its grammar text)."""

    backend: str
    kind: str
    source: Any


def backend_mode(mode: str | None = None) -> str:
    """``mode`` or DEEPINFER_STRUCTURED_BACKEND: "auto" | "xgrammar" | "llguidance"."""
    if mode is None:
        from deepinfer import envs

        mode = envs.DEEPINFER_STRUCTURED_BACKEND
    if mode not in ("auto", *BACKENDS):
        raise ValueError(f"structured-output backend must be auto, xgrammar or llguidance, got {mode!r}")
    return mode


def _xgrammar_json(schema: dict, spec: StructuredOutputSpec) -> dict:
    import xgrammar as xgr

    checked = check_xgrammar(schema)
    try:
        with _native_stderr() as logged:
            xgr.Grammar.from_json_schema(checked, **xgrammar_json_options(spec))
    except RuntimeError as e:  # e.g. "Check failed": the grammar layer, named as admission
        raise schema_error("schema", f"the xgrammar backend cannot compile it: {clean_xgrammar_error(e)}") from None
    # xgrammar logs (and does not raise) when it weakens a construct our rules did not catch,
    # e.g. through a $ref: such a schema is not xgrammar's
    warnings = [_LOG_PREFIX.sub("", line) for line in logged if "Warning:" in line]
    if warnings:
        raise schema_error("schema", f"the xgrammar backend would weaken it: {warnings[0].split('Warning: ')[-1]}")
    return checked


def _xgrammar_ebnf(source: str) -> str:
    """``source`` once xgrammar parses it and its root derives some finite string."""
    import xgrammar as xgr

    try:
        grammar = xgr.Grammar.from_ebnf(source)
    except RuntimeError as e:
        raise InvalidRequestError(f"SamplingParams.structured_output: invalid ebnf: {clean_xgrammar_error(e)}",
                                  field="structured_output") from None
    check_productive(grammar.serialize_json())
    return source


_STDERR_LOCK = threading.Lock()


@contextmanager
def _native_stderr() -> Iterator[list[str]]:
    """The lines native code writes to file descriptor 2 inside the block (xgrammar's C++ log)."""
    lines: list[str] = []
    with _STDERR_LOCK, tempfile.TemporaryFile() as f:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            lines.extend(f.read().decode("utf-8", errors="replace").splitlines())


def _llguidance_json(schema: dict, spec: StructuredOutputSpec) -> str:
    from deepinfer.structured.llg_backend import llg_grammar

    rewritten = llg_rewrite(rewrite_regexes(schema))
    check_llg_formats(rewritten)
    return llg_grammar(rewritten, any_whitespace=spec.any_whitespace)


def plan_spec(spec: StructuredOutputSpec, mode: str | None = None) -> GrammarPlan:
    """Check ``spec`` and choose its backend; raise InvalidRequestError (keyword and JSON path)
    when no allowed backend enforces it exactly."""
    mode = backend_mode(mode)
    if spec.kind == "regex":
        return GrammarPlan("xgrammar", "regex", check_regex(str(spec.schema)))
    if spec.kind == "ebnf":
        return GrammarPlan("xgrammar", "ebnf", _xgrammar_ebnf(spec.schema))
    schema = normalize_schema(spec.schema_dict)
    if mode == "llguidance":
        return GrammarPlan("llguidance", spec.kind, _llguidance_json(schema, spec))
    try:
        return GrammarPlan("xgrammar", spec.kind, _xgrammar_json(schema, spec))
    except InvalidRequestError as xgrammar_error:
        if mode == "xgrammar":
            raise
        try:
            return GrammarPlan("llguidance", spec.kind, _llguidance_json(schema, spec))
        except InvalidRequestError as llg_error:
            reason = str(llg_error).removeprefix("SamplingParams.structured_output: ")
            raise InvalidRequestError(f"{xgrammar_error}; the llguidance backend cannot either: {reason}",
                                      field="structured_output") from None
