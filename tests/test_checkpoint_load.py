"""Checkpoint loading: quantized official layout, `model.` prefixes, clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.models.loader import CheckpointError, load_model
from deepinfer.models.quant import dequantize_fp4, dequantize_fp8_block
from deepinfer.models.standalone import StandaloneRunner
from deepinfer.models.tiny import init_random, save_checkpoint, tiny_config, write_tiny_checkpoint
from deepinfer.models.v4.config import DeepseekV4Config, ModelConfigError
from deepinfer.models.v4.model import DeepseekV4Model

SMALL = dict(vocab_size=256)


def shards(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))


def test_quantized_checkpoint_matches_its_dequantized_weights(tmp_path, fresh_seed):
    cfg = tiny_config(**SMALL)
    model = DeepseekV4Model(cfg, torch.float32)
    init_random(model, fresh_seed)
    save_checkpoint(model, str(tmp_path), quantize=True)
    raw = {}
    for f in shards(str(tmp_path)):
        raw.update(load_file(f))
    assert raw["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert raw["layers.0.attn.wq_a.scale"].dtype == torch.uint8
    assert raw["layers.0.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert raw["layers.0.attn.compressor.wkv.weight"].dtype == torch.float32  # compressors stay dense
    loaded = load_model(str(tmp_path), dtype="float32")
    params = dict(loaded.named_parameters())
    # quantized Linears keep only the checkpoint bytes on CPU; dense_weight() dequantizes them
    params.update({n: loaded.get_submodule(n[:-len(".weight")]).dense_weight() for n, t in raw.items()
                   if t.dtype in (torch.float8_e4m3fn, torch.int8)})
    for name, tensor in raw.items():
        if tensor.dtype == torch.float8_e4m3fn:
            want = dequantize_fp8_block(tensor, raw[name[:-6] + "scale"], (128, 128))
        elif tensor.dtype == torch.int8:
            want = dequantize_fp4(tensor, raw[name[:-6] + "scale"], 32)
        else:
            continue
        assert torch.equal(params[name], want), name
        original = dict(model.named_parameters())[name]
        # FP8 keeps 3 mantissa bits (<= 1/16 relative per element); FP4 is coarse: one
        # e2m1 step is at most half the group's scale, scale <= 2 * amax / 6.
        bound = original.abs().max() / 2 if tensor.dtype == torch.int8 else original.abs() / 16 + 1e-3
        assert ((params[name] - original).abs() <= bound).all(), name
    assert loaded.layers[0].attn.wq_a.quantized.fmt == "fp8"
    assert loaded.layers[0].ffn.experts[0].w1.quantized.fmt == "fp4"
    # The dequantized model runs and matches a dense model built from the same values.
    dense = DeepseekV4Model(loaded.cfg, torch.float32)
    dense.load_state_dict({**loaded.state_dict(), **{n: p for n, p in params.items() if n in raw}})
    toks = torch.randint(0, 256, (140,), generator=torch.Generator().manual_seed(fresh_seed)).tolist()
    a = StandaloneRunner(loaded, 1, 200).step([(0, toks)])[0]
    b = StandaloneRunner(dense, 1, 200).step([(0, toks)])[0]
    assert torch.equal(a, b)


def test_model_prefixed_names_load(tmp_path):
    write_tiny_checkpoint(str(tmp_path / "a"), seed=3, cfg=tiny_config(**SMALL))
    ref = load_model(str(tmp_path / "a"), dtype="float32")
    for f in shards(str(tmp_path / "a")):
        tensors = load_file(f)
        save_file({"model." + k: v for k, v in tensors.items()}, f)
    index = tmp_path / "a" / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"] = {"model." + k: v for k, v in data["weight_map"].items()}
    index.write_text(json.dumps(data))
    other = load_model(str(tmp_path / "a"), dtype="float32")
    for (n, p), (_, q) in zip(ref.named_parameters(), other.named_parameters()):
        assert torch.equal(p, q), n


def _edit_tensor(path: str, name: str, fn) -> None:
    for f in shards(path):
        tensors = load_file(f)
        if name in tensors:
            out = fn(tensors)
            save_file(out, f)
            return
    raise AssertionError(name)


def test_missing_tensor_is_named(tmp_path):
    write_tiny_checkpoint(str(tmp_path), seed=0, cfg=tiny_config(**SMALL))
    name = "layers.1.attn.indexer.wq_b.weight"
    _edit_tensor(str(tmp_path), name, lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*layers\.1\.attn\.indexer\.wq_b\.weight"):
        load_model(str(tmp_path), dtype="float32")


def test_wrong_shape_is_named(tmp_path):
    write_tiny_checkpoint(str(tmp_path), seed=0, cfg=tiny_config(**SMALL))
    name = "layers.2.attn.wkv.weight"
    _edit_tensor(str(tmp_path), name, lambda t: {**t, name: t[name][:-1].contiguous()})
    with pytest.raises(CheckpointError, match=r"layers\.2\.attn\.wkv\.weight.*shape \(31, 64\).*\(32, 64\)"):
        load_model(str(tmp_path), dtype="float32")


def test_unexpected_tensor_is_named(tmp_path):
    write_tiny_checkpoint(str(tmp_path), seed=0, cfg=tiny_config(**SMALL))
    _edit_tensor(str(tmp_path), "norm.weight", lambda t: {**t, "layers.0.attn.bogus": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="unexpected tensor 'layers.0.attn.bogus'"):
        load_model(str(tmp_path), dtype="float32")


@pytest.mark.parametrize("field,value,message", [
    ("model_type", "llama", "model_type='llama' is not supported"),
    ("num_attention_heads", 3, r"num_attention_heads \(3\) must be divisible by o_groups"),
    ("compress_ratios", [128, 7, 0, 4, 0], r"compress_ratios\[1\]=7 is not one of"),
    ("compress_ratios", [128, 4], "compress_ratios has 2 entries but num_hidden_layers=4"),
    ("hidden_size", -4, "hidden_size must be a positive integer"),
    ("rms_norm_eps", "tiny", "rms_norm_eps must be a positive finite number"),
    ("num_hash_layers", 9, r"num_hash_layers must be in \[0, 4\]"),
])
def test_bad_config_values_are_named(tmp_path, field, value, message):
    write_tiny_checkpoint(str(tmp_path), seed=0, cfg=tiny_config(**SMALL))
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    raw[field] = value
    path.write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match=message):
        load_model(str(tmp_path), dtype="float32")


def test_transformers_spelling_of_config_is_accepted():
    hf_style = {"model_type": "deepseek_v4", "num_hidden_layers": 3, "hidden_size": 64,
                "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
                "mlp_layer_types": ["hash_moe", "moe", "moe"], "partial_rotary_factor": 0.125, "head_dim": 512,
                "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0},
                                    "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16,
                                                 "original_max_position_embeddings": 65536}}}
    cfg = DeepseekV4Config.from_dict(hf_style)
    assert cfg.compress_ratios == [128, 4, 0] and cfg.num_hash_layers == 1 and cfg.qk_rope_head_dim == 64
    assert cfg.rope_scaling["factor"] == 16 and cfg.compress_rope_theta == 160000.0


def test_engine_never_imports_transformers():
    code = ("import sys, deepinfer.models.loader, deepinfer.models.tiny, deepinfer.models.standalone; "
            "assert 'transformers' not in sys.modules, 'engine imported transformers'")
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_mtp_stage_loads_and_predicts(tmp_path, fresh_seed):
    write_tiny_checkpoint(str(tmp_path), seed=fresh_seed, cfg=tiny_config(**SMALL))
    model = load_model(str(tmp_path), dtype="float32")
    assert len(model.mtp) == 1 and model.mtp[0].e_proj.weight.abs().sum() > 0
    runner = StandaloneRunner(model, 1, 300)
    toks = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(fresh_seed))
    from deepinfer.models.paged_batch import ForwardBatch, SeqMeta
    batch = ForwardBatch(toks, torch.arange(40), [SeqMeta(0, 40, 0, runner._table(0), 0, True)])
    streams = model(batch, runner.cache)
    # MTP stage 0 reads the main streams at positions 0..38 and the tokens at 1..39.
    mtp_batch = ForwardBatch(toks[1:], torch.arange(1, 40), [SeqMeta(0, 39, 0, runner._table(0), 0, True)])
    mtp_streams, logits = model.mtp_forward(0, streams[:-1], mtp_batch, runner.cache)
    assert logits.shape == (39, 256) and torch.isfinite(logits).all()
    again = model.mtp_forward(0, streams[:-1], mtp_batch, runner.cache)[1]
    assert torch.equal(logits, again)


@pytest.mark.parametrize("quantize", [False, True])
def test_dspark_checkpoint_round_trip(tmp_path, quantize):
    from deepinfer.models.tiny import tiny_dspark_config

    cfg = tiny_dspark_config(**SMALL)
    model = DeepseekV4Model(cfg, torch.float32)
    init_random(model, 4)
    save_checkpoint(model, str(tmp_path), quantize=quantize)
    names = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"])
    for expected in ("mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.2.norm.weight", "mtp.2.hc_head_fn",
                     "mtp.2.markov_head.markov_w1.weight", "mtp.2.confidence_head.proj.weight",
                     "mtp.1.attn.wkv.weight", "mtp.1.ffn.gate.bias"):
        assert expected in names
    assert "mtp.1.e_proj.weight" not in names
    loaded = load_model(str(tmp_path), dtype="float32")
    assert loaded.cfg.dspark_block_size == 5 and loaded.cfg.dspark_target_layer_ids == [1, 2, 3]
    original = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        if quantize:
            assert (p - original[name]).abs().max() <= original[name].abs().max() / 2 + 1e-6, name
        else:
            assert torch.equal(p, original[name]), name
    assert loaded.mtp[2].markov_head.markov_w1.weight.shape == (256, 16)
