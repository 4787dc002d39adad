"""deepinfer's DeepSeek-V4 forward == transformers' DeepseekV4ForCausalLM (the oracle),
float32 on CPU, random tiny configs and weights from fresh seeds, weights going through
the real save (official layout) / load path on both sides."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from deepinfer.models.loader import load_model
from deepinfer.models.standalone import StandaloneRunner
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint

transformers = pytest.importorskip("transformers")
TOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def random_config(rng: random.Random):
    layouts = [[128, 4, 0, 4], [4, 128, 4], [0, 4, 128, 0, 4], [128, 128, 4, 4]]
    ratios = rng.choice(layouts)
    heads = rng.choice([2, 4])
    return tiny_config(
        vocab_size=rng.choice([300, 512]), hidden_size=rng.choice([32, 48, 64]), num_hidden_layers=len(ratios),
        compress_ratios=ratios, num_attention_heads=heads, o_groups=rng.choice([1, 2]), head_dim=32,
        qk_rope_head_dim=rng.choice([8, 16]), sliding_window=rng.choice([16, 64, 128]),
        index_n_heads=rng.choice([2, 4]), index_topk=rng.choice([4, 8, 16]), n_routed_experts=rng.choice([4, 8]),
        num_experts_per_tok=2, num_hash_layers=rng.choice([0, 1, 2]),
    )


@pytest.fixture
def pair(tmp_path, fresh_seed, stable_topk):
    """(deepinfer model, transformers model, config, rng) loaded from one checkpoint."""
    rng = random.Random(fresh_seed)
    cfg = random_config(rng)
    write_tiny_checkpoint(str(tmp_path), seed=fresh_seed, cfg=cfg)
    ours = load_model(str(tmp_path), dtype="float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.DeepseekV4ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    return ours, hf, cfg, rng


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


@torch.no_grad()
def test_prefill_matches_oracle(pair):
    ours, hf, cfg, rng = pair
    runner = StandaloneRunner(ours, max_seqs=4, max_len=400)
    for seq_id, n in enumerate([1, 7, cfg.sliding_window + 3, 2 * 128 + 45]):  # odd, > window, > 128
        toks = tokens(rng, n, cfg.vocab_size)
        got = runner.step([(seq_id, toks)])[0]
        want = hf(torch.tensor([toks])).logits[0]
        assert rel_err(got, want) < TOL, f"prefill of {n} tokens"


@torch.no_grad()
def test_decode_continues_prefill(pair):
    ours, hf, cfg, rng = pair
    toks = tokens(rng, 190, cfg.vocab_size)
    runner = StandaloneRunner(ours, max_seqs=1, max_len=400)
    cache = transformers.DynamicCache(config=hf.config)
    out = hf(torch.tensor([toks[:131]]), past_key_values=cache, use_cache=True)
    assert rel_err(runner.step([(0, toks[:131])])[0], out.logits[0]) < TOL
    for t in range(131, 190):  # crosses CSA windows and the 128-token window edge
        out = hf(torch.tensor([[toks[t]]]), past_key_values=out.past_key_values, use_cache=True)
        got = runner.step([(0, [toks[t]])])[0]
        assert rel_err(got[0], out.logits[0, -1]) < TOL, f"decode step at position {t}"


@torch.no_grad()
def test_flattened_batch_of_mixed_requests(pair):
    ours, hf, cfg, rng = pair
    lens = [rng.randrange(1, 40), 129, rng.randrange(130, 300) | 1, 64]
    seqs = [tokens(rng, n, cfg.vocab_size) for n in lens]
    runner = StandaloneRunner(ours, max_seqs=5, max_len=400)
    got = runner.step([(i, s) for i, s in enumerate(seqs)])
    for i, s in enumerate(seqs):
        assert rel_err(got[i], hf(torch.tensor([s])).logits[0]) < TOL, f"request {i} of length {lens[i]}"
    # A step mixing decodes of the earlier requests with a new prefill, as the engine batches.
    extra = tokens(rng, 4, cfg.vocab_size)
    new = tokens(rng, 77, cfg.vocab_size)
    got = runner.step([(0, [extra[0]]), (4, new), (2, [extra[1]])])
    assert rel_err(got[0][0], hf(torch.tensor([seqs[0] + extra[:1]])).logits[0, -1]) < TOL
    assert rel_err(got[1], hf(torch.tensor([new])).logits[0]) < TOL
    assert rel_err(got[2][0], hf(torch.tensor([seqs[2] + extra[1:2]])).logits[0, -1]) < TOL


@torch.no_grad()
def test_chunked_prefill_equals_full_prefill(pair):
    ours, hf, cfg, rng = pair
    toks = tokens(rng, 301, cfg.vocab_size)
    runner = StandaloneRunner(ours, max_seqs=1, max_len=400)
    chunk = rng.choice([5, 37, 64])
    got = torch.cat([runner.step([(0, toks[i:i + chunk])])[0] for i in range(0, len(toks), chunk)])
    assert rel_err(got, hf(torch.tensor([toks])).logits[0]) < TOL, f"chunks of {chunk}"
