"""Skewed-routing checkpoints for EPLB experiments (benchmark and workbench).

Real MoE traffic has hot experts; random weights route almost uniformly. `force_hot_experts`
raises the router's selection bias of chosen experts (routed layers; the bias steers only
which experts are picked, not their weights) and puts them first in the token -> expert
table of hash layers, so a few experts receive most tokens. With the default contiguous
placement the hot experts sit on one rank: the straggler EPLB is there to remove.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.models.tiny import flash4_config, init_random, mini_config, save_checkpoint, tiny_config
from deepinfer.models.v4.config import DeepseekV4Config
from deepinfer.models.v4.model import DeepseekV4Model

__all__ = ["EP_SIZES", "mini_like_config", "force_hot_experts", "write_skewed_checkpoint"]


EP_SIZES = ("mini-cpu", "mini", "flash4w")


def mini_like_config(size: str = "mini-cpu", vocab_size: int | None = None) -> DeepseekV4Config:
    """``mini`` (REFERENCE.md section 5: hidden 1024, 8 layers, 16 heads x 512, 64 experts
    x 512, top-6); ``flash4w``: two V4-Flash-width layers (a hash layer and a CSA layer of
    ``flash4``: 256 experts x 2048 top-6, hidden 4096; 13B params, 26 GB in bf16); or
    ``mini-cpu``: mini's MoE shape (64 experts, top-6, hash + routed layers) at widths that
    gloo ranks on a small CPU box get through in seconds."""
    vocab = {"vocab_size": vocab_size} if vocab_size is not None else {}
    if size == "mini":
        return mini_config(**vocab)
    if size == "flash4w":
        return flash4_config(num_hidden_layers=2, compress_ratios=[128, 4], num_hash_layers=1, **vocab)
    if size != "mini-cpu":
        raise ValueError(f"size must be one of {', '.join(EP_SIZES)}, got {size!r}")
    return tiny_config(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16,
                       q_lora_rank=128, o_groups=2, o_lora_rank=64, n_routed_experts=64, moe_intermediate_size=128,
                       num_experts_per_tok=6, index_n_heads=4, index_head_dim=32, index_topk=64, sliding_window=128,
                       compress_ratios=[128, 4, 128, 4], num_hash_layers=1, vocab_size=vocab_size or 8192)


@torch.no_grad()
def force_hot_experts(model: DeepseekV4Model, hot: Sequence[int], bias: float = 2.0, hash_hot: int = 2) -> None:
    """Make ``hot`` experts the favourites of every MoE layer (see module docstring).
    Hash layers put ``hash_hot`` of them (rotating) at the front of every token's row."""
    hot = list(hot)
    for layer in model.layers:
        gate = layer.ffn.gate
        if gate.is_hash:
            table = gate.tid2eid  # [vocab, k]: rank every expert per token, keep the first k
            vocab, k = table.shape
            n_hot, n_exp = min(hash_hot, k, len(hot)), model.cfg.n_routed_experts
            order = torch.full((vocab, n_exp), 10_000.0)
            order += torch.arange(n_exp, dtype=torch.float32)  # unused experts last, by id
            order.scatter_(1, table.long(), (100 + torch.arange(k, dtype=torch.float32)).expand(vocab, k).contiguous())
            hot_t = torch.tensor(hot)
            for j in range(n_hot):  # the token's hot experts first
                front = hot_t[(torch.arange(vocab) + j) % len(hot)]
                order.scatter_(1, front[:, None], torch.full((vocab, 1), float(j)))
            table.copy_(order.argsort(dim=1)[:, :k].to(table.dtype))
        else:
            gate.bias[hot] += bias


def write_skewed_checkpoint(path: str, cfg: DeepseekV4Config, hot: Sequence[int], seed: int = 0,
                            dtype: torch.dtype = torch.float32, bias: float = 2.0) -> str:
    """A random checkpoint (as `write_tiny_checkpoint`) whose routing favours ``hot`` (none:
    the random weights' near-uniform routing)."""
    model = DeepseekV4Model(cfg, dtype)
    init_random(model, seed)
    if hot:
        force_hot_experts(model, hot, bias)
    return save_checkpoint(model, path)
