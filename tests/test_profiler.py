"""Phase markers, chrome-trace parsing (exact numbers on hand-made traces), capture on the
tiny model, the timeline figure and the trace CLI."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.profiling import markers
from deepinfer.profiling.charts import timeline_figure
from deepinfer.profiling.markers import MODEL, PREPARE_INPUTS, SAMPLE, SCHEDULE, UPDATE, phase
from deepinfer.profiling.timeline import idle_gaps, parse_trace, step_table
from deepinfer.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny_llm():
    from deepinfer.workbench import tiny_llm as make

    return make(max_num_seqs=4)


class _FakeNvtx:
    def __init__(self) -> None:
        self.stack: list[str] = []
        self.calls: list[str] = []

    def push_range(self, name: str, color: str | None = None, domain: str | None = None) -> None:
        assert domain == markers.NVTX_DOMAIN
        self.stack.append(name)
        self.calls.append(name)

    def pop_range(self, domain: str | None = None) -> None:
        self.stack.pop()


def test_phase_opens_nvtx_always_and_torch_ranges_only_while_profiling(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeNvtx()
    monkeypatch.setattr(markers, "_nvtx", fake)
    with phase(MODEL) as p:
        assert fake.stack == [MODEL] and p._range is None  # no profiler: no torch range
    with pytest.raises(RuntimeError), phase(SAMPLE):
        raise RuntimeError("boom")
    assert fake.stack == [] and fake.calls == [MODEL, SAMPLE]  # popped even on error
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with phase(SCHEDULE):
            torch.ones(2) + 1
    names = {e.name for e in prof.events()}
    assert SCHEDULE in names


def _x(name: str, ts: float, dur: float, cat: str = "user_annotation", tid: int = 1) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def _cpu_trace() -> dict:
    ev = []
    for k, t in enumerate((1000.0, 2000.0)):  # two steps of 800 us, 200 us apart
        ev += [_x(f"ProfilerStep#{k + 3}", t, 800), _x(SCHEDULE, t + 10, 40), _x(PREPARE_INPUTS, t + 60, 40),
               _x(MODEL, t + 100, 500), _x(SAMPLE, t + 600, 150), _x(UPDATE, t + 760, 30),
               _x("aten::linear", t + 110, 200, "cpu_op"), _x("aten::addmm", t + 120, 150, "cpu_op"),
               _x("aten::add", t + 400, 100, "cpu_op"), _x("aten::argmax", t + 610, 50, "cpu_op")]
    ev.append({"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}})
    return {"traceEvents": ev}


def test_parse_cpu_trace_lanes_steps_and_gaps() -> None:
    ev = parse_trace(_cpu_trace())
    assert set(ev["lane"]) == {"step", "host scheduling", "input prep", "model", "sampling", "device"}
    dev = ev[ev["lane"] == "device"]
    assert list(dev["name"]) == ["aten::linear", "aten::add"] * 2  # top level, inside the model phase only
    assert ev["start_us"].min() == 0.0 and set(ev["step"]) == {3, 4}
    st = step_table(ev).set_index("step")
    assert st.loc[3, "step_ms"] == pytest.approx(0.8) and st.loc[3, "model_ms"] == pytest.approx(0.5)
    assert st.loc[3, "host_ms"] == pytest.approx(0.8 - 0.5 - 0.15)
    assert st.loc[3, "device_busy_ms"] == pytest.approx(0.3) and st.loc[3, "device_idle_ms"] == pytest.approx(0.5)
    gaps = idle_gaps(ev)
    assert gaps.to_dict("records") == [{"prev_step": 3, "step": 4, "gap_start_ms": pytest.approx(0.5),
                                        "gap_ms": pytest.approx(0.61)}]


def test_parse_gpu_trace_uses_kernels_per_stream() -> None:
    trace = _cpu_trace()
    trace["traceEvents"] += [_x("gemm", 1150, 300, "kernel", tid=7), _x("copy", 1500, 20, "gpu_memcpy", tid=9),
                             _x("gemm", 2150, 300, "kernel", tid=7),
                             _x("ProfilerStep#3", 1140, 400, "gpu_user_annotation", tid=7)]  # ignored
    ev = parse_trace(trace)
    assert {"device s7", "device s9"} <= set(ev["lane"]) and "device" not in set(ev["lane"])
    assert len(ev[ev["lane"] == "step"]) == 2 and len(step_table(ev)) == 2
    assert idle_gaps(ev)["gap_ms"].tolist() == pytest.approx([(2150 - 1520) / 1e3])
    assert step_table(ev).set_index("step").loc[3, "device_busy_ms"] == pytest.approx(0.32)


def test_timeline_figure_is_horizontal_bars_in_ms_and_merges_device_ops() -> None:
    ev = parse_trace(_cpu_trace())
    fig = timeline_figure(ev, merge_us=0.0)
    by = {t.name: t for t in fig.data}
    assert all(t.type == "bar" and t.orientation == "h" for t in fig.data)
    assert list(by["model"].base) == pytest.approx([0.1, 1.1]) and list(by["model"].x) == pytest.approx([0.5, 0.5])
    assert len(by["device"].x) == 4
    merged = {t.name: t for t in timeline_figure(ev, merge_us=200.0).data}
    assert len(merged["device"].x) == 2 and "2 device op(s), busy 0.300 of 0.390 ms" in merged["device"].hovertext[0]
    assert merged["device"].marker.opacity[0] == pytest.approx(0.3 / 0.39)


def test_capture_trace_on_the_tiny_model(tiny_llm, tmp_path) -> None:
    from deepinfer.profiling.trace import capture_trace

    ids = [[1000 + i for i in range(n)] for n in (20, 50)]
    cap = capture_trace(tiny_llm, prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=6, ignore_eos=True),
                        num_steps=2, out_dir=str(tmp_path), name="t")
    assert tiny_llm.metrics.step_hooks == []
    with open(cap.path) as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {MODEL, SAMPLE, SCHEDULE, PREPARE_INPUTS, UPDATE} <= names
    steps, gaps = cap.steps, cap.gaps
    assert len(steps) == 2 and (steps["model_ms"] > 0).all() and (steps["device_busy_ms"] > 0).all()
    assert len(gaps) == 1 and gaps["gap_ms"].iloc[0] > 0
    assert all(o.finished and len(o.token_ids) == 6 for o in cap.outputs)
    assert {t.name for t in cap.figure().data} >= {"model", "device"}


def test_trace_cli(tmp_path, capsys) -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "profiling" / "trace.py"
    spec = importlib.util.spec_from_file_location("profiling_trace_cli", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--requests", "2", "--steps", "2", "--out-dir", str(tmp_path), "--name", "cli"]) == 0
    out = capsys.readouterr().out
    assert "device_busy_ms" in out and "gap_ms" in out
    assert (tmp_path / "cli.json").exists() and (tmp_path / "cli_timeline.html").exists()
