"""profiling/gemm_first_use.py on CPU (--tiny): first vs second call per M, before and after
the prefill warm-up's token ladder, and the JSON written."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "profiling"))

import gemm_first_use  # noqa: E402


def test_gemm_first_use_tiny(tmp_path):
    rec = gemm_first_use.main(["--tiny", "--cold", "40,70", "--between", "56,80", "--ladder-max", "96",
                               "--out", str(tmp_path)])
    saved = json.loads(next(tmp_path.glob("gemm_first_use_cpu_*.json")).read_text())
    assert saved == rec
    assert [r["m"] for r in rec["cold"]] == [40, 70] and [r["m"] for r in rec["between"]] == [56, 80]
    assert rec["ladder"] == [48, 64, 96] and rec["weight_shapes"]
    for r in rec["cold"] + rec["between"]:
        assert r["first_ms"] > 0 and r["second_ms"] > 0
        assert abs(r["excess_ms"] - (r["first_ms"] - r["second_ms"])) <= 0.002
