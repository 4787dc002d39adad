"""benchmarks/spec_draft_h200.py --tiny on the host (fast path forced with the kernels' torch
references, graphs emulated): it runs end to end, the graphed and eager drafts agree on
every step, and the JSON carries commit, hardware, config and a well-formed targets list."""

from __future__ import annotations

import importlib.util
import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any deepinfer_kernels module is imported

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_spec_draft_bench_tiny(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("spec_draft_h200", os.path.join(ROOT, "benchmarks",
                                                                                  "spec_draft_h200.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
    res = mod.main(["--tiny", "--out", str(tmp_path), "--tokens", "4"])
    files = list(tmp_path.glob("spec_draft_h200_*_tiny.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert data["commit"] and data["hardware"] == "cpu" and data["config"]["k"] == 5
    assert {s["batch"] for s in data["steps"]} == {1, 2} and all(s["steps"] > 0 for s in data["steps"])
    assert all(s["tokens_equal_share"] == s["tokens_equal_share_all_steps"] == 1.0 for s in data["steps"])
    assert data["graph_stats"]["graph_steps"] > 0 and data["feature_graph_stats"]["graph_steps"] > 0
    assert data["v41"]["graphed"] and data["v41"]["graph_steps"] > 0
    assert all(s["tokens_equal_share_all_steps"] == 1.0 for s in data["v41"]["steps"])  # float32 on the host
    names = [t["name"] for t in data["targets"]]
    assert len(names) == len(set(names)) >= 4
    assert all(set(t) == {"name", "value", "target", "met"} and isinstance(t["met"], bool) for t in data["targets"])
    assert res["targets"] == data["targets"]
