"""Offline quality checks (AIME 2026, HLE, GPQA Diamond): generation apart from scoring.

    from deepinfer.eval import generate_eval, score_file
    res = generate_eval(llm, "aime", "aime2026.jsonl", "runs/aime.jsonl", SamplingParams(max_tokens=32768))
    report = score_file("runs/aime.jsonl")       # writes runs/aime.scores.json
    report.accuracy, report.summary, report.verdicts

Same from the shell: ``deepinfer eval generate ...`` / ``deepinfer eval score ...``.
"""

from __future__ import annotations

from deepinfer.eval.loaders import BENCHMARKS, EvalItem, load_aime, load_benchmark, load_gpqa, load_hle
from deepinfer.eval.records import read_records
from deepinfer.eval.report import ScoreReport, score_file, score_records
from deepinfer.eval.runner import DEFAULT_EVAL_PARAMS, GenerateResult, ResumeMismatchError, generate_eval
from deepinfer.eval.scorers import Judge, JudgeRequest, Verdict, score_record

__all__ = [
    "BENCHMARKS",
    "EvalItem",
    "load_aime",
    "load_gpqa",
    "load_hle",
    "load_benchmark",
    "read_records",
    "generate_eval",
    "GenerateResult",
    "ResumeMismatchError",
    "DEFAULT_EVAL_PARAMS",
    "score_record",
    "score_records",
    "score_file",
    "ScoreReport",
    "Verdict",
    "Judge",
    "JudgeRequest",
]
