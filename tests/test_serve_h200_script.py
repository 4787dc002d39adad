"""benchmarks/serve_h200.py on CPU (--tiny): offline, then a server per engine client (process,
thread), every number and the targets list in the JSON; greedy tokens through both servers
equal LLM.generate's (each prompt alone on both sides), and the engine's duty cycle and mean
step time read from /metrics are real fractions / times."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import serve_h200  # noqa: E402


def test_serve_h200_tiny(tmp_path, capsys):
    out = serve_h200.main(["--tiny", "--batch", "3", "--prompt-len", "8", "--new", "4", "--low-load-repeats", "1",
                           "--out", str(tmp_path)])
    saved = json.loads(next(tmp_path.glob("serve_cpu_*.json")).read_text())
    assert saved["targets"] == out["targets"] and len(saved["targets"]) == 4
    assert {t["name"].split(" (")[0] for t in saved["targets"]} >= {"greedy tokens through the server"}
    assert all(set(t) == {"name", "value", "target", "met"} for t in saved["targets"])
    assert set(saved["servers"]) == {"process", "thread"}
    for client, srv in saved["servers"].items():
        assert saved["compared"][client]["greedy_equal"] is True, client
        sat = srv["saturation"]
        # sustained load: 4 waves of the batch, 3 in flight; then one burst of 3
        assert sat["completed"] == 12 and sat["failed"] == 0 and sat["total_output_tokens"] == 48
        assert srv["burst"]["completed"] == 3 and srv["burst"]["total_output_tokens"] == 12
        assert saved["compared"][client]["burst_ratio"] > 0
        engine = sat["engine"]
        assert engine["steps"] >= 4 and engine["mean_step_ms"] > 0 and 0 < engine["duty_cycle"] <= 1.05
        cpu = engine["host_cpu"]  # each host process's CPU over the run: is one of them the bottleneck?
        assert set(cpu) == {"api_server", "engine_process", "bench_client"}
        assert cpu["api_server"]["cpu_us_per_token"] > 0 and cpu["bench_client"]["cpu_s_per_s"] > 0
        if client == "process":  # the thread client's engine runs in the server's process
            assert cpu["engine_process"]["cpu_us_per_token"] > 0
        inside = srv["low_load"]["server_side"]  # the server's own TTFT is part of what the client saw
        assert 0 < inside["ttft_ms_mean"] <= srv["low_load"]["ttft_ms"]["mean"] and inside["tpot_ms_mean"] > 0
    assert saved["offline"]["mean_step_ms"] > 0 and saved["commit"] and saved["hardware"] == "cpu"
    # the ratio compares the median of 3 saturation calls per side (each recorded)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    off_reps = saved["offline"]["saturation_tok_s_repeats"]
    assert len(off_reps) == 3 and saved["offline"]["saturation_tok_s"] == med(off_reps)
    srv_reps = saved["servers"]["process"]["saturation"]["output_throughput_repeats"]
    ratio = saved["compared"]["process"]["saturation_ratio"]
    assert len(srv_reps) == 3 and abs(ratio - med(srv_reps) / med(off_reps)) < 1e-9
    printed = capsys.readouterr().out
    assert "server/process" in printed and "server/thread" in printed
