"""profiling/offline_waves.py on CPU: every case serves all its requests, and the closed-loop
cases (a server client's replacement pattern) stagger admissions into mixed steps."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _study():
    spec = importlib.util.spec_from_file_location("offline_waves", os.path.join(ROOT, "profiling", "offline_waves.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_offline_waves_tiny(tmp_path):
    batch, new, waves = 4, 8, 3
    out = _study().main(["--tiny", "--batch", str(batch), "--prompt-len", "16", "--new", str(new),
                         "--waves", str(waves), "--rtt-steps", "0,4", "--out", str(tmp_path)])
    cases = out["results"]["async"]
    assert set(cases) == {"warmup", "waves_1", f"waves_{waves}", "closed_loop_rtt0", "closed_loop_rtt4"}
    for name, case in cases.items():
        n = batch if name in ("warmup", "waves_1") else waves * batch
        assert case["requests"] == n and case["tokens"] == n * new, name
        assert sum(k["steps"] for k in case["kinds"].values()) == case["steps"], name
    # replacements that arrive late land in steps that also decode: mixed steps appear
    assert "mixed" not in cases["closed_loop_rtt0"]["kinds"]
    assert cases["closed_loop_rtt4"]["kinds"]["mixed"]["steps"] > 0
    assert len(list(tmp_path.glob("offline_waves_cpu_*.json"))) == 1
