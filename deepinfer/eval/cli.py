"""`deepinfer eval`: offline benchmark generation and scoring, as two separate steps.

    deepinfer eval generate --benchmark aime --data aime2026.jsonl --out runs/aime.jsonl \\
        [--model DIR] [--max-tokens 32768] [--temperature 1.0] [--top-p 1.0] [--seed 0] \\
        [--no-thinking] [--batch-size 16] [--limit N] [--engine max_num_seqs=64 ...]
    deepinfer eval score runs/aime.jsonl [--out runs/aime.scores.json]

`generate` resumes when --out exists (rerun the same command after an interruption).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from typing import Any

__all__ = ["main", "build_parser", "parse_engine_args"]


def parse_engine_args(pairs: list[str]) -> dict[str, Any]:
    """``["max_num_seqs=8", "chunked_prefill=False"]`` -> kwargs for ``LLM(...)``.

    Values are Python literals when they parse as one (ints, floats, True/False/None),
    else strings (paths, dtype names).
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def _generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from deepinfer import LLM, SamplingParams
    from deepinfer.eval.runner import generate_eval

    if Path(args.out).is_dir():  # before the engine loads (generate_eval checks it too)
        raise ValueError(f"--out {args.out} is a directory; give the generation file to write, e.g. "
                         f"{Path(args.out) / (args.benchmark + '.jsonl')}")
    llm = LLM(args.model, **parse_engine_args(args.engine))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    res = generate_eval(llm, args.benchmark, args.data, args.out, params, seed=args.seed,
                        thinking=args.thinking, batch_size=args.batch_size, limit=args.limit,
                        use_tqdm=not args.quiet)
    print(json.dumps({"out": res.out_path, "items": res.n_items, "already_done": res.n_existing,
                      "generated": res.n_generated, "skipped": res.n_skipped,
                      "output_tokens": res.output_tokens, "wall_s": round(res.wall_s, 3),
                      "output_tokens_per_s": round(res.output_tokens_per_s, 2)}))
    return 0


def _score(args: argparse.Namespace) -> int:
    from deepinfer.eval.report import score_file

    report = score_file(args.generations, args.out)
    s = report.summary
    keys = ("benchmark", "n_items", "n_scored", "correct", "wrong", "unparseable", "skipped", "accuracy",
            "scores_path")
    print(json.dumps({k: s[k] for k in keys}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``deepinfer eval`` argument parser."""
    parser = argparse.ArgumentParser(prog="deepinfer eval", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="write one JSONL record of raw output per benchmark item")
    gen.add_argument("--benchmark", required=True, choices=["aime", "gpqa", "hle"])
    gen.add_argument("--data", required=True, help="local data file in the benchmark's public format")
    gen.add_argument("--out", required=True, help="generation JSONL (resumed when it exists)")
    gen.add_argument("--model", default=None, help="checkpoint dir (default: DEEPINFER_HF_MODEL_DIR or tiny)")
    gen.add_argument("--max-tokens", type=int, default=32768)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0, help="eval seed: per-item sampling seeds, GPQA order")
    gen.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=True)
    gen.add_argument("--batch-size", type=int, default=16)
    gen.add_argument("--limit", type=int, default=None, help="only the first N items")
    gen.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                     help="LLM(...) engine argument, repeatable (e.g. max_num_seqs=64)")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.set_defaults(func=_generate)
    score = sub.add_parser("score", help="score a generation JSONL; writes per-item verdicts")
    score.add_argument("generations", help="the JSONL written by `generate`")
    score.add_argument("--out", default=None, help="scores JSON (default: <generations>.scores.json)")
    score.set_defaults(func=_score)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for bad input, with the reason on stderr)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ImportError) as exc:  # DeepInferError is a ValueError
        print(f"deepinfer eval: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
