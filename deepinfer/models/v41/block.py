"""One DeepSeek-V4.1 layer (`layers.N.*`), also the body of a DSpark stage: Engram,
attention and MoE sublayers joined by the shifted hyper-connections.

Its own module so that the model (`deepseek_v41.DeepseekV41Model`) and the DSpark
drafter stages (`dspark.DSparkStage41`, a subclass) both build on it without
importing each other.
"""

from __future__ import annotations

import torch
from torch import nn

from ..mhc import hc_params
from ..norm import RMSNorm
from .attention import Attention41
from .config import DeepseekV41Config
from .engram import Engram
from .layers import V41Context, MoE41, hc_collapse, hc_expand, hc_mixes


class Block41(nn.Module):
    """One V4.1 layer (`layers.N.*`) or the body of a DSpark stage (`mtp.K.*`)."""

    def __init__(self, cfg: DeepseekV41Config, layer: int, ratio: int, dtype: torch.dtype,
                 n_experts: int | None = None, top_k: int | None = None) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hc_params(self, "hc_attn", cfg.hc_mult, cfg.hidden_size)
        hc_params(self, "hc_ffn", cfg.hc_mult, cfg.hidden_size)
        self.attn = Attention41(cfg, layer, ratio, dtype)
        self.ffn = MoE41(cfg, n_experts or cfg.n_routed_experts, top_k or cfg.num_experts_per_tok, dtype)
        self.engram_index = cfg.engram_layer_ids.index(layer) if layer in cfg.engram_layer_ids else None
        if self.engram_index is not None:
            self.engram = Engram(cfg, cfg.engram_num_embeddings[self.engram_index], dtype)

    def _mixes(self, streams: torch.Tensor, which: str):
        cfg = self.cfg
        return hc_mixes(streams, getattr(self, f"{which}_fn"), getattr(self, f"{which}_base"),
                        getattr(self, f"{which}_scale"), cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)

    def forward(self, streams: torch.Tensor, pre: torch.Tensor, ctx: V41Context, hash_rows: torch.Tensor | None,
                publish_ctx: V41Context | None = None, rows: torch.Tensor | None = None, publish_only: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(streams, pre of the previous site) -> (streams, this layer's ffn-site pre).
        With `publish_ctx` (the replay-start layer) the KV source publishes for every row
        of publish_ctx first, then the pass continues on `rows` (None = all) under ctx."""
        if self.engram_index is not None:
            streams = self.engram(streams, hash_rows[:, self.engram_index])
        a_pre, a_post, a_comb = self._mixes(streams, "hc_attn")
        x = self.attn_norm(hc_collapse(streams, pre))
        if publish_ctx is not None:
            if self.attn.is_kv_source:
                self.attn.publish(x, publish_ctx)
            if publish_only:
                return None
            if rows is not None:
                streams, x, a_pre, a_post, a_comb = (t[rows] for t in (streams, x, a_pre, a_post, a_comb))
            out = self.attn.attend(x, ctx)
        else:
            out = self.attn(x, ctx)
        streams = hc_expand(out, streams, a_post, a_comb)
        f_pre, f_post, f_comb = self._mixes(streams, "hc_ffn")
        x = self.ffn_norm(hc_collapse(streams, a_pre))
        streams = hc_expand(self.ffn(x, ctx.batch.input_ids), streams, f_post, f_comb)
        return streams, f_pre
