"""benchmarks/fastpath_bench.py on CPU (--tiny: tiny shapes, the fast paths with their torch
references, graphs emulated, HF transformers on the same config): every phase runs and
records what the GPU run will record."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import fastpath_bench  # noqa: E402


def test_bench_tiny_end_to_end(tmp_path, monkeypatch, capsys):
    for var in ("DEEPINFER_FASTPATH", "DEEPINFER_FAST_PREFILL", "DEEPINFER_CUDA_GRAPHS"):
        monkeypatch.delenv(var, raising=False)
    out = fastpath_bench.main(["--tiny", "--sizes", "mini", "--out", str(tmp_path)])
    for var in ("DEEPINFER_FASTPATH", "DEEPINFER_FAST_PREFILL", "DEEPINFER_CUDA_GRAPHS"):
        os.environ.pop(var, None)  # main() set them for its own run
    saved = json.loads((tmp_path / "fastpath_bench_mini_tiny.json").read_text())
    mini = saved["mini"]
    assert saved["commit"] and mini["fast_path"] == {"decode": True, "prefill": True, "ops": "ref"}
    check = mini["check_engine"]
    for pair in ("reference_vs_eager", "reference_vs_graphs", "eager_vs_graphs"):
        agree, total = map(int, check[pair]["greedy_token_agreement"].split("/"))
        assert agree == total > 0 and check[pair]["rows_compared"] > 0
    assert mini["check_layers"]["verdict"]["pass"]
    assert mini["check_prefill"]["len129"]["last_logits_rel_err"] == 0.0  # torch references: exact
    assert [r["batch"] for r in mini["decode"]] == [1, 4] and all(r["tok_s"] > 0 for r in mini["decode"])
    assert [r["path"] for r in mini["prefill"]] == ["fast_prefill", "fast_prefill"]
    assert len(mini["hf"]["decode"]) == 2 and all(r["tok_s"] > 0 for r in mini["hf"]["prefill"])
    printed = capsys.readouterr().out
    assert out["table"] in printed and "x HF" in printed


def test_bench_tiny_quantized_in_memory(tmp_path, monkeypatch):
    """--quantize serves the official storage made in memory (FP8 dense, FP4 experts) on the
    fast paths; --skip drops the checks, kernel profiles and HF."""
    for var in ("DEEPINFER_FASTPATH", "DEEPINFER_FAST_PREFILL", "DEEPINFER_CUDA_GRAPHS"):
        monkeypatch.delenv(var, raising=False)
    fastpath_bench.main(["--tiny", "--sizes", "mini", "--quantize", "fp4", "--skip", "check,hf,profile",
                         "--out", str(tmp_path)])
    for var in ("DEEPINFER_FASTPATH", "DEEPINFER_FAST_PREFILL", "DEEPINFER_CUDA_GRAPHS"):
        os.environ.pop(var, None)
    mini = json.loads((tmp_path / "fastpath_bench_mini_fp4_tiny.json").read_text())["mini"]
    assert mini["quantized"]["experts"] == "fp4" and mini["quantized"]["linears"] > 0
    assert "check_engine" not in mini and "hf" not in mini
    assert [r["path"] for r in mini["prefill"]] == ["fast_prefill", "fast_prefill"]
    assert all(r["tok_s"] > 0 for r in mini["decode"])
    # the roofline counts the quantized experts' stored bytes (bf16 would be 2 bytes a weight)
    assert 0 < mini["expert_bytes"] < mini["config"]["hidden_size"] * mini["config"]["moe_intermediate_size"] * 3 * 2


def test_roofline_costs_of_a_quantized_model():
    """Quantizing keeps the FLOPs (logical parameters) and cuts the weight bytes."""
    from fastpath_roofline import ModelCosts

    from deepinfer.models.quant_online import quantize_linears

    model = fastpath_bench.build(fastpath_bench.tiny_sizes()["mini"](), "cpu")
    dense = ModelCosts.of(model)
    quantize_linears(model, "fp4", (32, 32))
    quant = ModelCosts.of(model)
    assert (quant.dense_params, quant.expert_params) == (dense.dense_params, dense.expert_params)
    assert quant.prefill_flops(64) == dense.prefill_flops(64)
    assert dense.expert_bytes / quant.expert_bytes > 3  # bf16 -> FP4 + one E8M0 scale per 32
    assert quant.dense_bytes < dense.dense_bytes
