"""The training recipe end to end on a tiny config: it learns, the export loads in the
engine with the logits the trainer had (up to FP8/FP4 rounding), the DSpark drafter
joins the model and drafts through the engine, and the confidence temperatures are fitted."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.default_model import join_dspark
from deepinfer.models.loader import load_model
from deepinfer.models.standalone import StandaloneRunner
from deepinfer.train.bpe import train_tokenizer, write_tokenizer_dir
from deepinfer.train.calibrate import expected_calibration_error, fit_temperatures
from deepinfer.train.dense_model import head_logits, model_forward
from deepinfer.train.export import checkpoint_bytes
from deepinfer.train.recipe import trained_config
from deepinfer.train.run import run
from deepinfer.train.trainer import TrainSettings

TINY = dict(hidden_size=32, num_hidden_layers=3, compress_ratios=[0, 4, 16], hca_ratio=16, q_lora_rank=32,
            o_lora_rank=16, num_attention_heads=4, head_dim=32, qk_rope_head_dim=16, index_head_dim=16,
            index_n_heads=2, index_topk=4, moe_intermediate_size=32, sliding_window=16)


def _text(seed: int, n: int) -> list[str]:
    """A learnable toy language: templated sentences over a small lexicon."""
    rng = random.Random(seed)
    nouns, verbs = ["cat", "dog", "king", "queen", "ship", "river"], ["sees", "loves", "follows", "finds"]
    return [" ".join(f"the {rng.choice(nouns)} {rng.choice(verbs)} the {rng.choice(nouns)}." for _ in range(8))
            for _ in range(n)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe")
    tok = train_tokenizer(iter(_text(0, 200)), vocab_size=400, min_frequency=2)
    tok_dir = root / "tokenizer"
    write_tokenizer_dir(tok, tok_dir)
    bos = tok.token_to_id("<｜begin▁of▁sentence｜>")
    stream = lambda seed, n: np.array([i for t in _text(seed, n) for i in [bos] + tok.encode(t).ids],  # noqa: E731
                                      dtype=np.uint16)
    settings = TrainSettings(seq_len=48, batch_size=4, steps_a=30, steps_b=12, eval_every=15, eval_batches=2,
                             warmup_steps=5, lr=5e-3, anchors_per_seq=12)
    torch.manual_seed(0)
    record = run(stream(1, 300), stream(2, 40), str(tok_dir), str(root / "model"), settings, torch.device("cpu"),
                 config_overrides=TINY)
    return root, record


def test_training_learns_the_toy_language(trained) -> None:
    _, record = trained
    first, last = record["history"][0], record["history"][-1]
    assert first["step"] == 0 and last["val_ce"] < 0.5 * first["val_ce"]  # from ~log V to well below
    assert record["best_val_loss"] == min(h["val_ce"] for h in record["history"])
    assert record["steps_a"] == 30 and record["steps_b"] == 12  # the schedule replays from the record


def test_export_loads_in_the_engine_with_the_trainers_logits(trained) -> None:
    root, record = trained
    model_dir = root / "model"
    cfg = json.load(open(model_dir / "config.json"))
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128] and cfg["expert_dtype"] == "fp4"
    engine = load_model(str(model_dir), dtype="float32")
    assert engine.layers[0].attn.wq_a.quantized.fmt == "fp8"
    tokens = torch.tensor([[0] + list(range(5, 45))])
    ref = StandaloneRunner(engine, max_seqs=1, max_len=64, block_size=16).step([(0, tokens[0].tolist())])[0]
    # the engine's dequantized weights, run through the training forward, give the same logits
    dense = head_logits(engine, model_forward(engine, tokens).streams)
    assert float((dense - ref).detach().norm() / ref.norm()) < 1e-5
    llm = LLM(model=str(model_dir), dtype="float32", num_speculative_tokens=1)
    lin = llm.model.layers[0].attn.wq_a  # small model on CPU: dequantized once, bytes kept for kernels
    assert lin._parameters["weight"] is not None and lin.quantized is not None
    assert torch.equal(lin._parameters["weight"], lin.quantized.dequantize(torch.float32))
    lean = LLM(model=str(model_dir), dtype="float32", cpu_dense_weights=False)  # bytes only, same tokens
    assert lean.model.layers[0].attn.wq_a._parameters["weight"] is None
    with pytest.raises(Exception, match="cpu_dense_weights"):
        LLM(model=str(model_dir), cpu_dense_weights="yes")
    out = llm.generate(["the cat sees"], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert len(out.token_ids) == 12
    assert llm.runner.spec.metrics.proposed[0] > 0


def test_dspark_overlay_joins_and_drafts(trained, tmp_path) -> None:
    root, record = trained
    overlay = root / "model" / "dspark"
    assert sorted(os.listdir(overlay)) == ["config.json", "dspark.safetensors"]
    joined = join_dspark(str(root / "model"), str(overlay), str(tmp_path / "joined"))
    cfg = json.load(open(os.path.join(joined, "config.json")))
    assert cfg["dspark_block_size"] == 5 and len(cfg["dspark_confidence_temperatures"]) == 5
    assert record["confidence_temperatures"] == cfg["dspark_confidence_temperatures"]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = LLM(model=str(root / "model"), dtype="float32").generate(["the dog loves"], greedy)[0].token_ids
    llm = LLM(model=joined, dtype="float32", num_speculative_tokens=5, enable_mtp_varlen=True)
    assert llm.generate(["the dog loves"], greedy)[0].token_ids == plain  # lossless
    assert llm.runner.spec.metrics.proposed[0] > 0
    assert checkpoint_bytes(str(overlay)) < checkpoint_bytes(str(root / "model"))


def test_temperature_fit_calibrates_overconfident_logits() -> None:
    gen = torch.Generator().manual_seed(0)
    true_logit = torch.randn(4000, 5, generator=gen) * 1.5
    accept = torch.sigmoid(true_logit)
    temps, before, after = fit_temperatures(true_logit * 3.0, accept)  # three times too confident
    assert all(2.0 < t < 4.5 for t in temps)
    assert all(a < b for a, b in zip(after, before)) and max(after) < 0.02
    assert expected_calibration_error(torch.tensor([0.9, 0.1]), torch.tensor([0.9, 0.1])) < 1e-9



def test_drafter_applies_the_checkpoints_confidence_temperatures() -> None:
    from deepinfer.models.v4.model import DeepseekV4Model
    from deepinfer.models.tiny import init_random, tiny_dspark_config
    from deepinfer.spec.dspark_drafter import DSparkDrafter

    temps = [0.5, 1.0, 2.0, 3.0, 4.0]
    cfg = tiny_dspark_config(vocab_size=300, dspark_confidence_temperatures=temps)
    model = DeepseekV4Model(cfg, torch.float32)
    init_random(model, 0)
    drafter = DSparkDrafter(model, cache=None, k=5)
    assert drafter.temperatures == temps
    gen = torch.Generator().manual_seed(1)
    logits, hidden = torch.randn(2, 5, 300, generator=gen), torch.randn(2, 5, cfg.hidden_size, generator=gen)
    greedy = [SamplingParams(temperature=0.0)] * 2
    calibrated = drafter.draft(logits, hidden, [3, 4], [10, 20], greedy, 5)
    drafter.temperatures = [1.0] * 5
    raw = drafter.draft(logits, hidden, [3, 4], [10, 20], greedy, 5)
    for c, r in zip(calibrated, raw):
        assert c.tokens == r.tokens
        z = torch.logit(torch.tensor(r.confidences, dtype=torch.float64))
        assert torch.allclose(torch.tensor(c.confidences, dtype=torch.float64), torch.sigmoid(z / torch.tensor(temps)),
                              atol=1e-6)
    with pytest.raises(Exception, match="dspark_confidence_temperatures"):
        tiny_dspark_config(vocab_size=300, dspark_confidence_temperatures=[1.0, -1.0, 1.0, 1.0, 1.0])
