"""Regenerate the workload files in this folder (deterministic: fixed seeds).

    python datasets/workloads/make_workloads.py

Lengths are drawn from log-normal distributions (chat-like: many short prompts, a long
tail), clipped to each file's range. Only lengths are stored; sweeps synthesise random
token-id prompts of these lengths (deepinfer.profiling.workload.synth_prompts).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: name -> (seed, requests, prompt median, prompt range, output median, output range, note)
SPECS: dict[str, tuple[int, int, int, tuple[int, int], int, tuple[int, int], str]] = {
    "tiny_chat": (0, 64, 48, (8, 192), 12, (4, 32), "CPU tests, notebooks and the tiny-model sweep"),
    "mini_chat": (1, 128, 512, (64, 2048), 64, (16, 256), "the `mini` config sweep on one GPU"),
}


def draw(rng: random.Random, median: int, lo: int, hi: int, sigma: float = 0.8) -> int:
    """A log-normal length around ``median`` clipped to [lo, hi]."""
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def main() -> None:
    """Write every workload in SPECS as <name>.jsonl next to this script."""
    for name, (seed, n, p_med, p_rng, o_med, o_rng, note) in SPECS.items():
        rng = random.Random(seed)
        lines = [f"# {name}: {n} requests, seed {seed}, {note}; made by make_workloads.py"]
        for _ in range(n):
            rec = {"prompt_len": draw(rng, p_med, *p_rng), "output_len": draw(rng, o_med, *o_rng)}
            lines.append(json.dumps(rec))
        (HERE / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
