"""Quantized checkpoints keep one representation per weight: FP8 / FP4 Linears hold only the
checkpoint bytes (+ scales) and dequantize per call on CPU, so a quantized tiny model
takes a fraction of the dense model's weight memory and computes exactly what the
dense dequantized model computes."""

from __future__ import annotations

import torch

from deepinfer.models.linear import Linear
from deepinfer.models.loader import keeps_bytes_only, load_model, load_weights, weight_bytes
from deepinfer.models.standalone import StandaloneRunner
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint

# wider than deepinfer-tiny so the projections, not the embedding, dominate
CFG = dict(vocab_size=256, hidden_size=256, q_lora_rank=128, head_dim=64, qk_rope_head_dim=16, o_lora_rank=64,
           moe_intermediate_size=128, index_head_dim=32)


def _quantized_linears(model: torch.nn.Module) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear) and m.quantized is not None}


def test_quantized_checkpoint_keeps_only_bytes(tmp_path, fresh_seed):
    cfg = tiny_config(**CFG)
    write_tiny_checkpoint(str(tmp_path / "q"), seed=fresh_seed % 1000, quantize=True, cfg=cfg)
    model = load_model(str(tmp_path / "q"), dtype="bfloat16")
    linears = _quantized_linears(model)
    assert {m.quantized.fmt for m in linears.values()} == {"fp8", "fp4"}
    for name, lin in linears.items():
        assert lin._parameters["weight"] is None, f"{name} keeps a dense copy"
        assert lin.weight.shape == (lin.out_features, lin.in_features)  # still readable, dequantized
    # Memory: dense bf16 weights of those Linears (2 bytes each) vs e4m3 (1 byte) / e2m1
    # (half a byte) + E8M0 scales; everything else unchanged.
    got = weight_bytes(model)
    dense_equiv = sum(lin.out_features * lin.in_features * 2 for lin in linears.values())
    assert got["quantized"] == sum(lin.quantized.nbytes() for lin in linears.values())
    assert got["quantized"] < 0.4 * dense_equiv
    dense_model = load_model(str(tmp_path / "q"), dtype="bfloat16")
    for lin in _quantized_linears(dense_model).values():  # the old layout: dense weights materialised
        lin.weight = torch.nn.Parameter(lin.dense_weight())
        lin.quantized = None
    full = weight_bytes(dense_model)
    assert full["total"] == got["dense"] + dense_equiv
    assert got["total"] < 0.5 * full["total"], (got, full)
    # Same numbers: per-call dequantization == the dense dequantized weights, bitwise.
    toks = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(fresh_seed)).tolist()
    a = StandaloneRunner(model, 1, 128).step([(0, toks)])[0]
    b = StandaloneRunner(dense_model, 1, 128).step([(0, toks)])[0]
    assert torch.equal(a, b)


def test_loading_into_a_materialised_model_frees_dense_copies(tmp_path):
    """load_weights on a model built with every dense weight drops them after reading."""
    write_tiny_checkpoint(str(tmp_path), seed=2, quantize=True, cfg=tiny_config(vocab_size=256))
    ref = load_model(str(tmp_path), dtype="float32")
    from deepinfer.models.v4.model import DeepseekV4Model

    model = DeepseekV4Model(ref.cfg, torch.float32)
    before = weight_bytes(model)["total"]
    load_weights(model, str(tmp_path))
    assert all(m._parameters["weight"] is None for m in _quantized_linears(model).values())
    assert weight_bytes(model)["total"] < before
    for name, lin in _quantized_linears(ref).items():
        assert torch.equal(model.get_submodule(name).dense_weight(), lin.dense_weight()), name


def test_where_bytes_are_kept():
    """FP8 and FP4: only the bytes, everywhere (the FP8 GEMM and the fast path's FP8 / FP4
    MoE kernels read them on CUDA; elsewhere they are dequantized per call)."""
    for fmt in ("fp8", "fp4"):
        assert keeps_bytes_only(fmt, "cuda") and keeps_bytes_only(fmt, "cpu")
