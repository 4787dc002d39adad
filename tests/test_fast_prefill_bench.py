"""benchmarks/prefill_bench.py runs end to end on CPU with a tiny config (the fast path's
torch references, a chunked check batch, bf16-layout and FP8 checkpoints) and records
its numbers; its check fails when the fast path computes something else."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import prefill_bench  # noqa: E402

ARGS = ["--config", "tiny", "--lengths", "48", "--repeats", "1", "--check-max-len", "150", "--budget", "96"]


@pytest.mark.skipif(prefill_bench.ON_GPU, reason="the CPU smoke configuration")
def test_prefill_bench_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv("DEEPINFER_FAST_PREFILL", raising=False)
    results = prefill_bench.main(ARGS + ["--out", str(tmp_path)])
    saved = json.loads((tmp_path / "prefill_bench_tiny.json").read_text())
    assert saved["variants"].keys() == {"bf16", "fp8"} and "DEEPINFER_FAST_PREFILL" not in os.environ
    for name, v in saved["variants"].items():
        assert v["check"]["passed"], (name, v["check"])
        assert v["check"]["prompt_lens"] == [1, 100] and v["fast_prefill_stats"]["prefill_steps"] >= 3
        assert max(v["check"]["reference_vs_fp32_rel_err"]) > 0, "bf16 against a float32 truth"
        assert {(r["path"], r["length"]) for r in v["prefill"]} == {("fast", 48), ("reference", 48)}
        assert all(r["tok_s"] > 0 and r["tflop_s"] > 0 for r in v["prefill"])
    fp8 = saved["variants"]["fp8"]["weight_bytes"]
    assert fp8["quantized"] > 0 and fp8["total"] < saved["variants"]["bf16"]["weight_bytes"]["total"]
    assert results["commit"]


@pytest.mark.skipif(prefill_bench.ON_GPU, reason="the CPU smoke configuration")
def test_prefill_bench_check_catches_a_wrong_fast_path(tmp_path, monkeypatch):
    """A fast path with wrong attention sinks (a negative control) must fail the check."""
    from deepinfer_kernels import prefill_attention as pa

    ref = pa.prefill_attention_ref

    def shifted_sinks(*args, **kwargs):
        args = list(args)
        args[6] = args[6] - 30.0  # sink logits: the softmax denominator changes
        return ref(*args, **kwargs)

    monkeypatch.setattr(pa, "prefill_attention_ref", shifted_sinks)
    results = prefill_bench.main(ARGS + ["--variants", "bf16", "--out", str(tmp_path)])
    assert not results["variants"]["bf16"]["check"]["passed"]
