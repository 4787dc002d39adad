"""profiling/prompt_host_cost.py: the host work of admitting long prompts and the full GC
after, with the ids the engine keeps as arrays (no element the collector walks)."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "profiling"))

import prompt_host_cost  # noqa: E402


def test_prompt_host_cost_small(tmp_path):
    rec = prompt_host_cost.main(["--batch", "8", "--context", "2048", "--block-size", "64", "--out", str(tmp_path)])
    saved = json.loads(next(tmp_path.glob("prompt_host_cost_cpu_*.json")).read_text())
    assert saved == rec and rec["prompt_ids_type"] == "array"
    parts = ("admit_ms", "request_ms", "detokenizer_ms", "block_hash_ms")
    assert all(rec[k] >= 0 for k in parts) and abs(rec["host_before_first_step_ms"] - sum(rec[k] for k in parts)) < 0.05
