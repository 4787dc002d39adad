"""profiling/first_generate_profile.py on CPU (--tiny): per call wall time and step kinds, the
functions whose own time grew from the steady call to the first, and the JSON written."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "profiling"))

import first_generate_profile  # noqa: E402


def test_first_generate_profile_tiny(tmp_path):
    rec = first_generate_profile.main(["--tiny", "--calls", "2", "--top", "5", "--out", str(tmp_path)])
    saved = json.loads(next(tmp_path.glob("first_generate_profile_cpu_*.json")).read_text())
    assert saved["calls"] == rec["calls"] and len(rec["calls"]) == 2
    for call in rec["calls"]:
        assert call["wall_ms"] > 0
        assert call["steps"]["prefill"]["steps"] >= 1 and call["steps"]["decode"]["steps"] == 15  # 16 new tokens
    assert len(rec["grew_most"]) == 5 and all(g["calls_first"] > 0 for g in rec["grew_most"])
    assert rec["first_over_steady"] == round(rec["calls"][0]["wall_ms"] / rec["calls"][1]["wall_ms"], 3)


def test_first_generate_profile_without_the_ladder_names_its_variant(tmp_path):
    """--no-ladder (the A/B) records the ladder off, names its JSON so, and restores the
    warm-up's ladder for the rest of the process."""
    from deepinfer.engine import prefill_warmup

    ladder = prefill_warmup.token_ladder
    rec = first_generate_profile.main(["--tiny", "--calls", "1", "--top", "3", "--no-ladder", "--out", str(tmp_path)])
    assert rec["token_ladder"] is False and prefill_warmup.token_ladder is ladder
    assert len(list(tmp_path.glob("first_generate_profile_cpu_*_noladder*.json"))) == 1
