"""What transformers' `save_pretrained` writes for DeepseekV4ForCausalLM loads in LLM(...)
and greedy-decodes token for token like transformers' generate(): its own names
(`model.embed_tokens`, `model.hc_head.hc_*`, the attention's `kv_norm` as `attn.norm`),
its config.json spelling (layer_types / mlp_layer_types / rope_parameters) and no MTP
stage (speculation then fails with a ConfigError before anything is queued)."""

from __future__ import annotations

import json
import random
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError
from deepinfer.models.loader import CheckpointError, load_model
from deepinfer.tokenizer import bundled_tokenizer_dir

transformers = pytest.importorskip("transformers")
NEW_TOKENS = 12
VOCAB = 512
LAYER_TYPES = ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
               "compressed_sparse_attention", "heavily_compressed_attention"]
MLP_TYPES = ["hash_moe", "hash_moe", "moe", "moe", "moe"]
#: save_pretrained writes no tokenizer and the vocab is 512: the bundled one, chosen explicitly
TOKENIZER = str(bundled_tokenizer_dir())


def _stable_topk(self, k, dim=-1, largest=True, sorted=True):  # see conftest.stable_topk
    values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


def _hf_model(seed: int):
    """A tiny random DeepseekV4ForCausalLM built the way a transformers user would (its own
    config spelling), covering HCA, CSA and sliding layers and hash / routed MoE."""
    cfg = transformers.DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16, partial_rotary_factor=0.5,
        layer_types=LAYER_TYPES, mlp_layer_types=MLP_TYPES, sliding_window=32, index_n_heads=4, index_head_dim=16,
        index_topk=4, n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
    )
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.DeepseekV4ForCausalLM(cfg).float().eval()
    # transformers' init (std 0.02, zero biases / mHC, unit norms) leaves logits nearly flat:
    # widen every float tensor so greedy decoding has clear margins, as a trained model would.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype.is_floating_point:
                fan_in = p.shape[-1] if p.dim() >= 2 else 1
                noise = torch.randn(p.shape, generator=gen) / fan_in ** 0.5
                p.copy_((1 + 0.1 * noise) if name.endswith("norm.weight") else noise)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint dir written by save_pretrained, prompts, transformers' greedy tokens)."""
    path = tmp_path_factory.mktemp("hf_saved")
    hf = _hf_model(seed=7)
    hf.save_pretrained(str(path))
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 6, 33, 129, 261)]
    hf.generation_config.eos_token_id = None  # like ignore_eos
    orig, torch.Tensor.topk = torch.Tensor.topk, _stable_topk
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            refs = []
            for p in prompts:
                ids = torch.tensor([p])
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                  do_sample=False, pad_token_id=0)
                refs.append(out[0, len(p):].tolist())
    finally:
        torch.Tensor.topk = orig
    return str(path), prompts, refs


def _copy(src: str, dst) -> str:
    dst.mkdir()
    for f in ("config.json", "model.safetensors"):
        (dst / f).write_bytes((open(f"{src}/{f}", "rb")).read())
    return str(dst)


def test_save_pretrained_layout_is_what_the_loader_maps(saved):
    """Pins transformers' names: if a release renames, this says which."""
    path, _, _ = saved
    names = set(load_file(f"{path}/model.safetensors"))
    for name in ("model.embed_tokens.weight", "head.weight", "model.norm.weight", "model.hc_head.hc_fn",
                 "model.layers.0.attn.norm.weight", "model.layers.0.attn.compressor.norm.weight",
                 "model.layers.1.attn.indexer.compressor.wkv.weight", "model.layers.0.ffn.gate.tid2eid",
                 "model.layers.2.ffn.gate.bias", "model.layers.3.hc_ffn_fn"):
        assert name in names, name
    assert not any(n.startswith(("mtp.", "model.mtp.")) for n in names)
    raw = json.loads(open(f"{path}/config.json").read())
    assert raw["layer_types"] == LAYER_TYPES and raw["mlp_layer_types"] == MLP_TYPES
    assert "compress_ratios" not in raw and "num_hash_layers" not in raw and raw["num_nextn_predict_layers"] == 1
    model = load_model(path, dtype="float32")
    assert model.cfg.compress_ratios == [128, 4, 0, 4, 128] and model.cfg.num_hash_layers == 2
    assert model.cfg.qk_rope_head_dim == 16 and len(model.mtp) == 0
    # every stored tensor went somewhere: each maps to one parameter / buffer, none left
    assert len(names) == len(dict(model.named_parameters())) + len(dict(model.named_buffers()))


def test_greedy_matches_transformers(saved):
    path, prompts, refs = saved
    llm = LLM(path, tokenizer=TOKENIZER, dtype="float32", max_model_len=512, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for prompt, out, ref in zip(prompts, outs, refs):
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens"


def test_speculation_needs_an_mtp_stage(saved, monkeypatch):
    path, _, _ = saved
    with pytest.raises(ConfigError, match=r"num_speculative_tokens=2 \(DEEPINFER_USE_NEXTN_DECODE\) needs an MTP"):
        LLM(path, tokenizer=TOKENIZER, dtype="float32", max_model_len=512, num_speculative_tokens=2)
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    with pytest.raises(ConfigError, match="has none .no mtp.* tensors.*DEEPINFER_USE_NEXTN_DECODE=0") as err:
        LLM(path, tokenizer=TOKENIZER, dtype="float32", max_model_len=512)
    assert err.value.field == "num_speculative_tokens"


def test_unknown_tensor_is_named(saved, tmp_path):
    path = _copy(saved[0], tmp_path / "extra")
    tensors = load_file(f"{path}/model.safetensors")
    save_file({**tensors, "model.layers.1.attn.bogus.weight": torch.zeros(3)}, f"{path}/model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'layers\.1\.attn\.bogus\.weight' "
                                              r"\(stored as 'model\.layers\.1\.attn\.bogus\.weight'\)"):
        LLM(path, tokenizer=TOKENIZER, dtype="float32", max_model_len=512)


def test_missing_tensor_is_named(saved, tmp_path):
    path = _copy(saved[0], tmp_path / "missing")
    tensors = load_file(f"{path}/model.safetensors")
    del tensors["model.layers.2.attn.norm.weight"]
    save_file(tensors, f"{path}/model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*layers\.2\.attn\.kv_norm\.weight"):
        load_model(path, dtype="float32")


def test_one_tensor_under_two_names_is_an_error(saved, tmp_path):
    path = _copy(saved[0], tmp_path / "twice")
    tensors = load_file(f"{path}/model.safetensors")
    save_file({**tensors, "embed.weight": tensors["model.embed_tokens.weight"].clone()}, f"{path}/model.safetensors")
    with pytest.raises(CheckpointError, match="stores 'embed.weight' twice"):
        load_model(path, dtype="float32")
