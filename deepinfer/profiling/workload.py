"""Workload files for sweeps and the workbench: JSONL, one request per line.

    {"prompt_len": 96, "output_len": 24}

Lines may carry more keys (kept in ``WorkloadRequest.extra``); ``#`` lines and blank lines
are skipped. Prompts are synthesised as random token ids (seeded), so a workload
describes lengths only and never hits the prefix cache by accident.
``datasets/workloads/README.md`` says how the shipped files were generated.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["WorkloadRequest", "load_workload", "synth_prompts", "scale_workload", "DEFAULT_WORKLOAD",
           "workload_path"]

_REPO_ROOT = Path(__file__).resolve().parents[2]
#: The tiny CPU workload shipped with the repository.
DEFAULT_WORKLOAD = "datasets/workloads/tiny_chat.jsonl"
# Token ids used for synthetic prompts: ordinary vocabulary, clear of special tokens
# (the upper end is capped by the model's vocabulary).
_TOKEN_RANGE = (1000, 100_000)


@dataclass(frozen=True)
class WorkloadRequest:
    """One request's shape: prompt and output lengths in tokens."""

    prompt_len: int
    output_len: int
    extra: dict[str, Any] = field(default_factory=dict, compare=False)


def workload_path(path: str | os.PathLike[str]) -> Path:
    """Resolve a workload path: as given if it exists, else relative to the repo root."""
    p = Path(path)
    if p.exists() or p.is_absolute():
        return p
    return _REPO_ROOT / p


def load_workload(path: str | os.PathLike[str] = DEFAULT_WORKLOAD, limit: int | None = None) -> list[WorkloadRequest]:
    """Read a JSONL workload (``prompt_len`` and ``output_len`` >= 1 on every line)."""
    out: list[WorkloadRequest] = []
    with open(workload_path(path)) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            rec = json.loads(line)
            try:
                p, o = int(rec.pop("prompt_len")), int(rec.pop("output_len"))
            except KeyError as e:
                raise ValueError(f"{path}:{lineno}: missing {e.args[0]!r}") from None
            if p < 1 or o < 1:
                raise ValueError(f"{path}:{lineno}: prompt_len and output_len must be >= 1")
            out.append(WorkloadRequest(p, o, rec))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise ValueError(f"workload {path} has no requests")
    return out


def scale_workload(reqs: Sequence[WorkloadRequest], num_requests: int | None = None, prompt_scale: float = 1.0,
                   output_len: int | None = None, max_len: int | None = None) -> list[WorkloadRequest]:
    """Reshape a workload: take ``num_requests`` (cycling), scale prompt lengths, fix the
    output length, and clip prompt + output to ``max_len`` (the engine's context)."""
    n = len(reqs) if num_requests is None else num_requests
    out = []
    for i in range(n):
        r = reqs[i % len(reqs)]
        p = max(1, round(r.prompt_len * prompt_scale))
        o = r.output_len if output_len is None else output_len
        if max_len is not None:
            o = max(1, min(o, max_len // 2))
            p = max(1, min(p, max_len - o - 1))
        out.append(WorkloadRequest(p, o, r.extra))
    return out


def synth_prompts(reqs: Sequence[WorkloadRequest], seed: int = 0, vocab_size: int | None = None) -> list[list[int]]:
    """Random token-id prompts with the workload's lengths (deterministic per ``seed``),
    drawn from ordinary ids below ``vocab_size`` (the model's; None = the V4 vocabulary)."""
    rng = random.Random(seed)
    lo, hi = _TOKEN_RANGE
    if vocab_size is not None:
        if vocab_size <= lo:
            raise ValueError(f"vocab_size must be > {lo} for synthetic prompts, got {vocab_size}")
        hi = min(hi, vocab_size)
    return [[rng.randrange(lo, hi) for _ in range(r.prompt_len)] for r in reqs]
