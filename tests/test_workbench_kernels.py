"""Kernel breakdown on a trace shaped like a real CUDA decode trace: more kernel names than
the table keeps, sub-microsecond and fractional durations, copies and memsets, kernels
queued back to back. The expected numbers are computed from the trace's own events here,
independently of the module and of HTA."""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path

import pytest

from deepinfer.workbench.kernel_breakdown import kernel_breakdown, top_kernels

NAMES = [f"k{i:02d}_kernel" for i in range(40)] + ["Memcpy HtoD (Pinned -> Device)", "Memset (Device)"]


def _decode_trace(path: Path, steps: int = 4, seed: int = 7) -> list[dict]:
    """``steps`` profiler steps; each launches every name 1-3 times in one burst (queued on
    stream 7, 0.25 us apart) with durations of 0.3-40 us at nanosecond resolution. Returns
    the device events written."""
    rng = random.Random(seed)
    ev: list[dict] = []
    device: list[dict] = []
    corr = 0
    for s in range(steps):
        base = 5000.0 * s
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1,
                   "ts": base, "dur": 5000.0, "args": {}})
        host, gpu = base + 10.0, base + 40.0
        for name in NAMES:
            for _ in range(rng.randint(1, 3)):
                corr += 1
                dur = round(rng.uniform(0.3, 1.0) if name.startswith("k3") else rng.uniform(1.0, 40.0), 3)
                cat = "gpu_memcpy" if name.startswith("Memcpy") else "gpu_memset" if name.startswith("Memset") else "kernel"
                ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                           "ts": round(host, 3), "dur": 0.5, "args": {"correlation": corr, "External id": corr}})
                k = {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": round(gpu, 3), "dur": dur,
                     "args": {"correlation": corr, "stream": 7, "device": 0, "External id": corr}}
                ev.append(k)
                device.append(k)
                host += 1.0
                gpu = gpu + dur + 0.25
    path.write_text(json.dumps({"traceEvents": ev, "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}]}))
    return device


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> tuple[Path, list[dict]]:
    path = tmp_path_factory.mktemp("kb") / "decode.json"
    return path, _decode_trace(path)


def test_top_kernels_of_many_kernels_add_up_with_an_other_row(trace) -> None:
    path, device = trace
    kb = kernel_breakdown(path, top=15)
    k = kb.top_kernels
    assert len(k) == 16 and k["name"].iloc[-1] == f"other ({len(NAMES) - 15} kernels)"
    assert abs(k["share"].sum() - 1) < 1e-9 and (k["total_us"] > 0).all()
    per_name: dict[str, list[float]] = defaultdict(list)
    for e in device:
        per_name[e["name"]].append(e["dur"])
    everything = sum(sum(v) for v in per_name.values())
    assert k["total_us"].sum() == pytest.approx(everything, rel=1e-12)  # every copy and memset counted
    ranked = sorted(per_name, key=lambda n: -sum(per_name[n]))
    assert list(k["name"].iloc[:15]) == ranked[:15]
    for _, row in k.iloc[:15].iterrows():  # per-launch figures, not per-name totals
        d = per_name[row["name"]]
        assert row["launches"] == len(d) and row["total_us"] == pytest.approx(sum(d))
        assert row["mean_us"] == pytest.approx(sum(d) / len(d)) and row["max_us"] == max(d) and row["min_us"] == min(d)
    rest = [x for n in ranked[15:] for x in per_name[n]]
    other = k.iloc[-1]
    assert other["launches"] == len(rest) and other["total_us"] == pytest.approx(sum(rest))
    assert other["max_us"] == max(rest) and other["min_us"] == min(rest)
    kinds = dict(zip(k["name"], k["kind"]))
    memcpy = "Memcpy HtoD (Pinned -> Device)"
    assert memcpy not in kinds or kinds[memcpy] == "MEMORY"
    assert set(k["kind"].iloc[:15]) <= {"COMPUTATION", "MEMORY"}


def test_sub_microsecond_kernels_keep_their_time(trace) -> None:
    """HTA rounds kernel starts up and ends down to whole microseconds by default: a 0.6 us
    kernel becomes 0 (or -1) us. The table and the idle time use the trace's own times."""
    path, device = trace
    short = [e for e in device if e["name"].startswith("k3")]
    kb = kernel_breakdown(path, top=len(NAMES))
    k = kb.top_kernels.set_index("name")
    assert len(kb.top_kernels) == len(NAMES)  # nothing left over, so no other row
    for name in {e["name"] for e in short}:
        assert k.loc[name, "total_us"] == pytest.approx(sum(e["dur"] for e in short if e["name"] == name))
    ordered = sorted(device, key=lambda e: e["ts"])
    gaps = sum(b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(ordered, ordered[1:]))
    assert kb.idle["idle_us"].sum() == pytest.approx(gaps, rel=1e-6)
    assert kb.steps["device_busy_ms"].sum() * 1e3 == pytest.approx(sum(e["dur"] for e in device), rel=1e-9)


def test_hta_logs_nothing_and_its_switch_is_restored(trace, caplog, monkeypatch) -> None:
    import logging
    import os

    monkeypatch.delenv("HTA_DISABLE_NS_ROUNDING", raising=False)
    with caplog.at_level(logging.DEBUG):
        kernel_breakdown(trace[0])
    # HTA logs each parse at WARNING; in a notebook those lines land on stderr, in the error style
    assert [r.getMessage() for r in caplog.records if r.name.startswith("hta")] == []
    assert "HTA_DISABLE_NS_ROUNDING" not in os.environ and logging.getLogger("hta").level != logging.ERROR


def test_top_must_be_positive() -> None:
    import pandas as pd

    with pytest.raises(ValueError, match="top must be >= 1"):
        top_kernels(pd.DataFrame({"name": ["a"], "dur_us": [1.0]}), 0)
