"""benchmarks/spec_h200.py (issue 24's GPU measurement) in its CPU stand-in mode: it runs
end to end through LLM.generate on the trained default and its DSpark drafter, checks the
batch-invariant claim and writes the JSON the lead's H200 run records (commit, hardware,
config, per-configuration runs with effective tokens per step and acceptance per
position, the step profile, the targets list)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import spec_h200  # noqa: E402


def test_spec_h200_tiny_writes_targets(tmp_path, capsys):
    res = spec_h200.main(["--tiny", "--out", str(tmp_path), "--configs", "off,dspark-k5-fixed", "--batches", "1,2",
                          "--tokens", "4", "--prompts", "2", "--prompt-chars", "80", "--profile-steps", "2"])
    files = list(tmp_path.glob("spec_h200_*_tiny.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert saved["commit"] and saved["hardware"] == "cpu" and saved["config"]["prompts"]
    assert [r["batch"] for r in saved["dspark-k5-fixed"]["runs"]] == [1, 2]
    for r in saved["dspark-k5-fixed"]["runs"]:
        assert r["effective_tokens_per_step"] >= 1.0 and len(r["acceptance_per_position"]) >= 1
        assert r["tok_s_per_user"] > 0 and r["tok_s_total"] > 0
    assert saved["profile"]["config"] == "dspark-k5-fixed" and saved["profile"]["wall_ms_per_step"] > 0
    names = [t["name"] for t in saved["targets"]]
    assert any("DSpark k=5 per-user tok/s b1" in n for n in names) and any("bitwise" in n for n in names)
    assert all(set(t) == {"name", "value", "target", "met"} for t in saved["targets"])
    assert saved["invariant"]["bitwise"] is True  # the CPU run checks the claim too
    assert res["targets"] == saved["targets"]
    printed = capsys.readouterr().out  # the short table and the targets, last
    assert "tok/s/user" in printed and ("MET " in printed or "MISS" in printed)


def test_spec_host_phases_tiny_times_verify_and_draft(tmp_path, capsys):
    import spec_host_phases

    res = spec_host_phases.main(["--tiny", "--out", str(tmp_path), "--configs", "off,mtp-k1", "--batches", "1",
                                 "--tokens", "4", "--top", "5"])
    saved = json.loads(next(tmp_path.glob("spec_host_phases_*_tiny.json")).read_text())
    assert saved == json.loads(json.dumps(res))
    off, mtp = saved["runs"]["off b1"], saved["runs"]["mtp-k1 b1"]
    assert off["us_per_step"].get("  verify forward", 0) == 0  # no verify step without speculation
    # every speculative step verifies and drafts once, and those phases are part of its time
    assert mtp["calls_per_step"]["  verify forward"] > 0.5 and mtp["calls_per_step"]["  draft (MTP)"] > 0.5
    assert 0 < mtp["us_per_step"]["  verify forward"] + mtp["us_per_step"]["  draft (MTP)"] <= mtp["step_us"]
    assert mtp["tokens_per_step"] >= 1.0 and len(mtp["cprofile_top"]) == 5
    assert len(list(tmp_path.glob("spec_host_phases_mtp-k1_b1.pstats"))) == 1
    assert mtp["timeline"]["slowest"] and len(mtp["timeline"]["step_ms"]) == mtp["steps"]
    assert "verify forward" in capsys.readouterr().out
