"""One DeepSeek-V4 transformer layer: attention and MoE sublayers, each wrapped in mHC.

Its own module so that the model (`model.DeepseekV4Model`) and the DSpark drafter
stages (`dspark.DSparkStage`, a subclass) both build on it without importing each other.
"""

from __future__ import annotations

import torch
from torch import nn

from ..mhc import hc_params, hc_post, hc_pre
from ..moe import MoE
from ..norm import RMSNorm
from .attention import Attention, ForwardContext
from .config import DeepseekV4Config


class Block(nn.Module):
    """One transformer layer (`layers.N.*`, or the body of an MTP stage)."""

    def __init__(self, cfg: DeepseekV4Config, cache_id: int, ratio: int, is_hash: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hc_params(self, "hc_attn", cfg.hc_mult, cfg.hidden_size)
        hc_params(self, "hc_ffn", cfg.hc_mult, cfg.hidden_size)
        self.attn = Attention(cfg, cache_id, ratio, dtype)
        self.ffn = MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
                       cfg.n_shared_experts, is_hash, cfg.vocab_size, cfg.scoring_func, cfg.routed_scaling_factor,
                       cfg.norm_topk_prob, cfg.swiglu_limit, dtype)

    def forward(self, streams: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cfg = self.cfg
        post, comb, x = hc_pre(streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale,
                               cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        streams = hc_post(self.attn(self.attn_norm(x), ctx), streams, post, comb)
        post, comb, x = hc_pre(streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale,
                               cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        return hc_post(self.ffn(self.ffn_norm(x), ctx.batch.input_ids), streams, post, comb)
