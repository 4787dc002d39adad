"""Load AIME, GPQA Diamond and HLE items from local files in their public formats.

Nothing is downloaded: point the loaders at files you already have.

* AIME: JSONL (or a JSON list) with ``id`` / ``problem`` / ``answer`` as in the Hugging
  Face AIME sets (``ID``/``Problem``/``Answer`` and ``problem_idx`` spellings accepted).
* GPQA Diamond: the official CSV (``Question``, ``Correct Answer``, ``Incorrect Answer 1..3``,
  ``Record ID``); options are shuffled per item by the eval seed, so the correct letter
  is balanced and reproducible.
* HLE: JSONL or parquet with ``id``, ``question``, ``answer``, ``answer_type``
  (``exactMatch`` | ``multipleChoice``) and ``image``; items with an image are kept but
  marked skipped (the engine serves text only), so every item still gets one record.
"""

from __future__ import annotations

import csv
import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["EvalItem", "BENCHMARKS", "load_aime", "load_gpqa", "load_hle", "load_benchmark", "LETTERS"]

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_AIME_INSTRUCTION = ("Reason step by step, then give the final answer, an integer from 0 to 999, "
                     "inside \\boxed{}.")
_CHOICE_INSTRUCTION = ("End your response with a line of the form 'Answer: X', where X is the letter "
                       "of the single best option.")
_SHORT_INSTRUCTION = "End your response with a line of the form 'Answer: <your final answer>'."


@dataclass
class EvalItem:
    """One benchmark item, ready to prompt and to score.

    Attributes:
        benchmark: ``"aime"`` | ``"gpqa"`` | ``"hle"``.
        id: the item's id in the source file (unique within it).
        prompt: the user message sent to the model (instructions included).
        reference: the gold answer: an integer string (AIME), a letter (multiple choice)
            or the short answer (HLE exactMatch).
        answer_type: ``"integer"`` | ``"multipleChoice"`` | ``"exactMatch"``.
        choices: the options in letter order for multiple choice built here (GPQA).
        skip_reason: why the item is not generated (e.g. ``"image"``), else None.
        meta: other source fields worth keeping (domain, sample marker...).
    """

    benchmark: str
    id: str
    prompt: str
    reference: str
    answer_type: str
    choices: list[str] | None = None
    skip_reason: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def _first(row: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if key in row and row[key] is not None and row[key] != "":
            return row[key]
    return None


def _read_json_rows(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return list(json.loads(text))
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not valid JSON ({err})") from None
    return rows


def _meta(row: dict[str, Any], used: set[str]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in used and isinstance(v, (str, int, float, bool))}


def load_aime(path: str | Path) -> list[EvalItem]:
    """AIME problems; answers normalised to plain integers ("042" -> "42")."""
    items = []
    for n, row in enumerate(_read_json_rows(Path(path))):
        problem, answer = _first(row, "problem", "Problem", "question"), _first(row, "answer", "Answer")
        if problem is None or answer is None:
            raise ValueError(f"{path}: row {n} needs 'problem' and 'answer' fields, has {sorted(row)}")
        item_id = str(_first(row, "id", "ID", "problem_idx", "idx") or n)
        ref = str(answer).strip()
        ref = str(int(ref)) if ref.lstrip("-").isdigit() else ref
        items.append(EvalItem("aime", item_id, f"{str(problem).strip()}\n\n{_AIME_INSTRUCTION}", ref, "integer",
                              meta=_meta(row, {"problem", "Problem", "question", "answer", "Answer", "solution"})))
    return items


def shuffled_options(correct: str, incorrect: list[str], seed: int, item_id: str) -> tuple[list[str], str]:
    """The options in a seed- and item-determined order, and the correct option's letter."""
    options = [correct, *incorrect]
    digest = hashlib.sha256(f"gpqa:{seed}:{item_id}".encode()).digest()
    random.Random(int.from_bytes(digest[:8], "little")).shuffle(options)
    return options, LETTERS[options.index(correct)]


def load_gpqa(path: str | Path, seed: int = 0) -> list[EvalItem]:
    """GPQA (Diamond) from the official CSV, options shuffled by ``seed``."""
    items = []
    with open(path, newline="", encoding="utf-8") as f:
        for n, row in enumerate(csv.DictReader(f)):
            cols = ["Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"]
            missing = [c for c in cols if not (row.get(c) or "").strip()]
            if missing:
                raise ValueError(f"{path}: row {n} lacks {missing}; GPQA CSV columns are {cols + ['Record ID']}")
            item_id = (row.get("Record ID") or "").strip() or str(n)
            options, letter = shuffled_options(row["Correct Answer"].strip(),
                                               [row[c].strip() for c in cols[2:]], seed, item_id)
            listing = "\n".join(f"{LETTERS[i]}) {opt}" for i, opt in enumerate(options))
            prompt = f"{row['Question'].strip()}\n\n{listing}\n\n{_CHOICE_INSTRUCTION}"
            items.append(EvalItem("gpqa", item_id, prompt, letter, "multipleChoice", choices=options,
                                  meta=_meta(row, set(cols) | {"Record ID"})))
    return items


def _read_hle_rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        try:
            import pandas as pd
            return pd.read_parquet(path).to_dict(orient="records")
        except ImportError as err:  # pandas needs pyarrow or fastparquet for parquet
            raise ImportError(f"reading {path} needs pandas with pyarrow (pip install pyarrow), "
                              f"or convert it to JSONL: {err}") from None
    return _read_json_rows(path)


def _has_image(value: Any) -> bool:
    """HLE stores '' for text-only items; pandas may turn missing cells into NaN or None."""
    if isinstance(value, (str, bytes, dict, list)):
        return len(value) > 0 and (not isinstance(value, str) or bool(value.strip()))
    return False


def load_hle(path: str | Path) -> list[EvalItem]:
    """Humanity's Last Exam; items with an image are returned with ``skip_reason="image"``."""
    items = []
    for n, row in enumerate(_read_hle_rows(Path(path))):
        answer_type = row.get("answer_type")
        if answer_type not in ("exactMatch", "multipleChoice"):
            raise ValueError(f"{path}: row {n} answer_type must be 'exactMatch' or 'multipleChoice', "
                             f"got {answer_type!r}")
        question, answer = _first(row, "question"), _first(row, "answer")
        if question is None or answer is None:
            raise ValueError(f"{path}: row {n} needs 'question' and 'answer' fields, has {sorted(row)}")
        instruction = _CHOICE_INSTRUCTION if answer_type == "multipleChoice" else _SHORT_INSTRUCTION
        ref = str(answer).strip()
        items.append(EvalItem("hle", str(_first(row, "id") or n), f"{str(question).strip()}\n\n{instruction}",
                              ref.upper() if answer_type == "multipleChoice" else ref, answer_type,
                              skip_reason="image" if _has_image(row.get("image")) else None,
                              meta=_meta(row, {"id", "question", "answer", "answer_type", "image", "rationale"})))
    return items


BENCHMARKS: dict[str, Callable[..., list[EvalItem]]] = {"aime": load_aime, "gpqa": load_gpqa, "hle": load_hle}


def load_benchmark(name: str, path: str | Path, seed: int = 0) -> list[EvalItem]:
    """Load ``name`` ("aime" | "gpqa" | "hle") from ``path``; ids must be unique."""
    if name not in BENCHMARKS:
        raise ValueError(f"benchmark must be one of {sorted(BENCHMARKS)}, got {name!r}")
    if not Path(path).is_file():
        raise FileNotFoundError(f"no {name} data file at {path} (the data is read locally, never downloaded)")
    items = load_gpqa(path, seed) if name == "gpqa" else BENCHMARKS[name](path)
    seen: set[str] = set()
    dups = [it.id for it in items if it.id in seen or seen.add(it.id)]
    if dups:
        raise ValueError(f"{path}: duplicate item ids {dups[:5]}; resume needs unique ids")
    return items
