"""`score`: read a generation JSONL, write the scores with one verdict per item.

The output JSON has ``summary`` (counts, accuracy, and the provenance of the records:
model, commits, sampling, engine configs) and ``items`` (one verdict per record, in file
order). Scoring never touches the engine, so it can be rerun with another judge.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.eval.records import read_records
from deepinfer.eval.scorers import Judge, Verdict, score_record

__all__ = ["ScoreReport", "score_records", "score_file", "default_scores_path"]


@dataclass
class ScoreReport:
    """Scores of one generation file.

    Attributes:
        summary: counts per verdict, ``accuracy`` (correct / scored items, unparseable
            counted wrong; None when nothing was scored) and provenance.
        verdicts: one per record, in file order.
    """

    summary: dict[str, Any]
    verdicts: list[Verdict] = field(default_factory=list)

    @property
    def accuracy(self) -> float | None:
        return self.summary["accuracy"]

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary, "items": [v.to_dict() for v in self.verdicts]}


def _distinct(records: list[dict[str, Any]], key: str) -> list[Any]:
    out: list[Any] = []
    for rec in records:
        if key in rec and rec[key] not in out:
            out.append(rec[key])
    return out


def score_records(records: list[dict[str, Any]], judge: Judge | None = None,
                  source: str | None = None) -> ScoreReport:
    """Score generation records (see ``deepinfer.eval.runner``); ``judge`` grades HLE free-form."""
    verdicts = [score_record(rec, judge) for rec in records]
    counts = Counter(v.verdict for v in verdicts)
    scored = len(verdicts) - counts["skipped"]
    generated = [r for r in records if not r.get("skipped")]
    out_tokens = sum(r.get("num_output_tokens") or 0 for r in generated)
    benchmarks = _distinct(records, "benchmark")
    summary = {
        "source": source,
        "benchmark": benchmarks[0] if len(benchmarks) == 1 else (benchmarks or None),
        "n_items": len(verdicts), "n_scored": scored,
        "correct": counts["correct"], "wrong": counts["wrong"], "unparseable": counts["unparseable"],
        "skipped": counts["skipped"],
        "accuracy": counts["correct"] / scored if scored else None,
        "parse_rate": (scored - counts["unparseable"]) / scored if scored else None,
        "judge": getattr(judge, "__name__", type(judge).__name__) if judge is not None else None,
        "output_tokens": out_tokens,
        "mean_output_tokens": out_tokens / len(generated) if generated else None,
        "finish_reasons": dict(Counter(r.get("finish_reason") for r in generated)),
        # provenance: several values mean the file mixes runs (e.g. a resume after a code change)
        "models": _distinct(records, "model"), "commits": _distinct(records, "commit"),
        "eval_seeds": _distinct(records, "eval_seed"), "thinking": _distinct(records, "thinking"),
        "sampling_params": _distinct(records, "sampling_params"),
        "engine_configs": _distinct(records, "engine_config"),
    }
    return ScoreReport(summary, verdicts)


def default_scores_path(generations: str | Path) -> Path:
    """``run.jsonl`` -> ``run.scores.json`` beside it."""
    p = Path(generations)
    return p.with_name(p.name.removesuffix(".jsonl") + ".scores.json")


def score_file(generations: str | Path, out_path: str | Path | None = None,
               judge: Judge | None = None) -> ScoreReport:
    """Score a generation JSONL and write ``{"summary", "items"}`` JSON to ``out_path``.

    Args:
        generations: the file `generate` wrote (read-only here: a torn tail is ignored,
            not repaired, so scoring a run in progress is safe).
        out_path: default ``<generations>.scores.json``.
        judge: optional free-form grader for HLE exactMatch items; off by default.
    """
    if not Path(generations).is_file():
        raise FileNotFoundError(f"no generation file at {generations}")
    report = score_records(read_records(generations, repair=False), judge, source=str(generations))
    out = Path(out_path) if out_path is not None else default_scores_path(generations)
    out.parent.mkdir(parents=True, exist_ok=True)
    report.summary["scores_path"] = str(out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report.to_dict(), indent=1, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, out)  # readers never see half a scores file
    return report
