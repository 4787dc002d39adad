"""The architecture and initialisation of the trained default model (`deepinfer-tiny`).

A small DeepSeek-V4: 6 layers (sliding-only, then CSA / HCA alternating), mHC with 4
streams, one hash-routed MoE layer then routed MoE (8 experts x 256, top-2, one shared
expert), one MTP stage; its DSpark drafter is three sliding-only stages with a rank-64
Markov head over the features of the last three layers. Sized so the FP8/FP4 checkpoint
(about 21 MB) plus the DSpark stages (about 6 MB) stay under the 32 MB the repository
allows (`tests/test_train_recipe.py` checks the budget).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from deepinfer.models.tiny import tiny_config
from deepinfer.models.v4.config import DeepseekV4Config

TRAINED_NAME = "deepinfer-tiny"


def trained_config(vocab_size: int, bos: int, eos: int, **overrides: object) -> DeepseekV4Config:
    """The trained default's architecture for a tokenizer of `vocab_size` ids."""
    base = dict(
        vocab_size=vocab_size, hidden_size=256, num_hidden_layers=6, num_attention_heads=8, head_dim=64,
        qk_rope_head_dim=32, q_lora_rank=192, o_groups=2, o_lora_rank=128, sliding_window=128,
        compress_ratios=[0, 4, 128, 4, 128, 4], mtp_compress_ratios=[0], index_n_heads=4, index_head_dim=64,
        index_topk=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=256,
        num_hash_layers=1, max_position_embeddings=65536, num_nextn_predict_layers=1, torch_dtype="bfloat16",
        bos_token_id=bos, eos_token_id=eos,
    )
    base.update(overrides)
    return tiny_config(**base)


def dspark_config(cfg: DeepseekV4Config, noise_token_id: int, block_size: int = 5, rank: int = 64
                  ) -> DeepseekV4Config:
    """The same model with a 3-stage DSpark drafter over its last three layers."""
    n = cfg.num_hidden_layers
    out = replace(cfg, num_nextn_predict_layers=3, mtp_compress_ratios=[0, 0, 0], dspark_block_size=block_size,
                  dspark_noise_token_id=noise_token_id, dspark_target_layer_ids=[n - 3, n - 2, n - 1],
                  dspark_markov_rank=rank)
    out.validate()
    return out


@torch.no_grad()
def init_for_training(model: torch.nn.Module, cfg: DeepseekV4Config, seed: int) -> None:
    """A trainable start: scaled-normal linears (output projections shrunk by depth),
    unit norms, zero sinks/APE/router bias, mHC mixes near identity (comb biased to its
    diagonal, small random projections so the streams can diverge), a random hash table."""
    gen = torch.Generator().manual_seed(seed)
    depth_scale = 1.0 / math.sqrt(2 * (cfg.num_hidden_layers + 1))
    n = cfg.hc_mult
    for name, p in sorted(model.named_parameters()):
        leaf = name.rsplit(".", 1)[-1]
        parent = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
        if name.endswith("norm.weight"):
            val = torch.ones(p.shape)
        elif leaf in ("attn_sink", "ape", "bias"):
            val = torch.zeros(p.shape)
        elif leaf.endswith("_scale"):
            val = torch.ones(p.shape)
        elif leaf.endswith("_base"):
            val = torch.zeros(p.shape)
            if p.numel() == (2 + n) * n:  # [pre n | post n | comb n*n]: comb starts near identity
                val[2 * n:] = torch.eye(n).flatten()
        elif leaf.endswith("_fn"):
            val = torch.randn(p.shape, generator=gen) * 0.01
        elif name == "embed.weight":
            val = torch.randn(p.shape, generator=gen)
        else:
            fan_in = p.shape[-1]
            val = torch.randn(p.shape, generator=gen) * fan_in ** -0.5
            if parent in ("wo_b", "w2") or name.endswith("confidence_head.proj.weight"):
                val = val * depth_scale
            if parent == "markov_w2":
                val = val * 0.1  # the Markov bias starts small next to the backbone's logits
        p.copy_(val.to(p.dtype))
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            noise = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=gen)
            buf.copy_(noise.argsort(dim=-1)[:, : cfg.num_experts_per_tok])
