"""profiling/decode_host_step.py: the engine's host work per decode step (real scheduler, KV
manager and fast-path input layout, no model), per batch x context cell, in the JSON."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "profiling"))

import decode_host_step  # noqa: E402


def test_decode_host_step_small(tmp_path):
    rec = decode_host_step.main(["--cells", "4x300,2x1000", "--steps", "6", "--out", str(tmp_path)])
    saved = json.loads(next(tmp_path.glob("decode_host_step_cpu_*.json")).read_text())
    assert saved == rec and [(c["batch"], c["context"]) for c in rec["cells"]] == [(4, 300), (2, 1000)]
    assert all(c["host_ms_per_step"] > 0 for c in rec["cells"])
