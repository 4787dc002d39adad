"""Workload files, in-place batch limits, the sweep (Python and CLI) and its records."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest

from deepinfer.profiling.charts import decode_chart, latency_throughput_chart, prefill_chart
from deepinfer.profiling.sweep import SweepSpec, run_sweep, set_batch_limits
from deepinfer.profiling.workload import WorkloadRequest, load_workload, scale_workload, synth_prompts

REPO = Path(__file__).resolve().parents[1]
SMALL = SweepSpec(prefill_budgets=(64, 128), decode_batch_sizes=(1, 2), concurrency=(2,), num_workload_requests=4,
                  warmup_steps=1, measure_steps=2)


@pytest.fixture(scope="module")
def tiny_llm():
    from deepinfer.workbench import tiny_llm as make

    return make(max_num_seqs=4, max_num_batched_tokens=256)


def test_workload_files_load_and_reshape(tmp_path: Path) -> None:
    for name in ("tiny_chat", "mini_chat"):
        reqs = load_workload(f"datasets/workloads/{name}.jsonl")  # relative to the repo root from anywhere
        assert len(reqs) >= 64 and all(r.prompt_len >= 1 and r.output_len >= 1 for r in reqs)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('# comment\n{"prompt_len": 3}\n')
    with pytest.raises(ValueError, match="output_len"):
        load_workload(bad)
    reqs = [WorkloadRequest(100, 10), WorkloadRequest(30, 5)]
    out = scale_workload(reqs, 5, prompt_scale=0.5, output_len=7, max_len=40)
    assert [(r.prompt_len, r.output_len) for r in out] == [(32, 7), (15, 7)] * 2 + [(32, 7)]
    ids = synth_prompts(out, seed=3)
    assert [len(x) for x in ids] == [32, 15, 32, 15, 32] and ids == synth_prompts(out, seed=3)
    assert ids != synth_prompts(out, seed=4)


def test_set_batch_limits_in_place(tiny_llm) -> None:
    set_batch_limits(tiny_llm, 2, 64)
    assert tiny_llm.scheduler.config.max_num_seqs == 2 and tiny_llm.config.max_num_batched_tokens == 64
    with pytest.raises(ValueError, match="state slots"):
        set_batch_limits(tiny_llm, max_num_seqs=5)
    set_batch_limits(tiny_llm, 4, 256)


def test_run_sweep_writes_results_and_charts(tiny_llm, tmp_path: Path) -> None:
    res = run_sweep(tiny_llm, SMALL, out_dir=str(tmp_path), name="small", progress=False)
    df = res.df
    assert df["kind"].tolist() == ["prefill", "prefill", "decode", "decode", "workload"]
    pre, dec, wl = (df[df["kind"] == k] for k in ("prefill", "decode", "workload"))
    assert pre["max_num_batched_tokens"].tolist() == [64, 128] and (pre["steps_measured"] == 2).all()
    assert (pre["prefill_tok_s_per_device"] > 0).all() and (pre["prefill_tokens_per_step"] == [64, 128]).all()
    assert dec["batch_size"].tolist() == [1, 2] and (dec["steps_measured"] == 2).all()
    assert (dec["effective_tokens_per_step"] == 1.0).all()
    assert dec["tok_s_per_device"].tolist() == pytest.approx((dec["tok_s_per_user"] * dec["batch_size"]).tolist())
    assert wl["num_finished"].tolist() == [4] and wl["mean_ttft_ms"].iloc[0] > 0
    # limits restored, profiler off, every row carries the full config beside its numbers
    assert (tiny_llm.config.max_num_seqs, tiny_llm.config.max_num_batched_tokens) == (4, 256)
    configs = [json.loads(c) for c in df["engine_config"]]
    assert [c["max_num_batched_tokens"] for c in configs[:2]] == [64, 128]
    assert [c["max_num_seqs"] for c in configs[2:]] == [1, 2, 2]
    assert set(res.paths) == {"csv", "json", "prefill_html", "decode_html"}
    saved = json.loads(Path(res.paths["json"]).read_text())
    assert saved["meta"]["commit"] and saved["meta"]["dtype"] == "float32" and saved["meta"]["max_model_len"] == 1024
    assert saved["meta"]["engine_config"]["max_num_seqs"] == 4 and saved["meta"]["spec"]["decode_batch_sizes"] == [1, 2]
    assert isinstance(saved["rows"][0]["engine_config"], dict) and len(saved["rows"]) == 5
    csv = pd.read_csv(res.paths["csv"])
    assert {"commit", "hardware", "device", "dtype", "max_model_len", "context_len"} <= set(csv.columns)
    assert "plotly" in Path(res.paths["decode_html"]).read_text().lower()
    assert len(res.figures["prefill"].data[0].x) == 2 and len(res.figures["decode"].data[0].x) == 2


def test_charts_from_rows() -> None:
    df = pd.DataFrame([
        {"kind": "prefill", "max_num_batched_tokens": 128, "prefill_tok_s_per_device": 1000.0,
         "prefill_ms_per_step": 12.0},
        {"kind": "decode", "batch_size": 4, "tok_s_per_device": 40.0, "tok_s_per_user": 10.0,
         "effective_tokens_per_step": 1.0, "decode_step_ms": 100.0},
        {"kind": "workload", "max_num_seqs": 2, "max_num_batched_tokens": 64, "output_tok_s": 50.0,
         "mean_tpot_ms": 30.0},
    ])
    assert list(prefill_chart(df).data[0].y) == [12.0] and list(prefill_chart(df).data[0].text) == ["128 tok"]
    dec = decode_chart(df)
    assert list(dec.data[0].x) == [40.0] and "1.00" in dec.layout.title.text
    assert list(latency_throughput_chart(df).data[0].y) == [30.0]
    assert len(prefill_chart(df.iloc[0:0]).data[0].x) == 0


def test_sweep_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("profiling_sweep_cli", REPO / "benchmarks" / "sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["--prefill-budgets", "64", "--decode-batch-sizes", "2", "--concurrency", "", "--warmup-steps",
                   "1", "--measure-steps", "2", "--engine-arg", "enable_prefix_caching=false", "--name", "cli",
                   "--out-dir", str(tmp_path), "--no-progress"])
    assert rc == 0
    rows = json.loads((tmp_path / "cli.json").read_text())["rows"]
    assert [r["kind"] for r in rows] == ["prefill", "decode"]
    assert rows[0]["engine_config"]["enable_prefix_caching"] is False
    assert "cli_prefill.html" in capsys.readouterr().out
