"""The DeepSeek-V4 model (reference path), parameter names = official checkpoint names.

Tokens of several requests arrive flattened ([T]) with per-request metadata
(`ForwardBatch`); the residual is `hc_mult` streams per token ([T, N, D]) mixed by mHC
around every attention and MoE sublayer. `forward` returns the final streams;
`compute_logits` collapses, normalises and projects only the rows that need logits.
"""

from __future__ import annotations

import torch
from torch import nn

from ..linear import Linear
from ..mhc import hc_head
from ..norm import RMSNorm
from ..paged_batch import ForwardBatch
from ..rope import Rotary
from .attention import ForwardContext
from .block import Block
from .config import DeepseekV4Config
from .dspark import DSparkStage
from .kv_cache import KVCache


class MTPStage(Block):
    """A next-n prediction stage (`mtp.K.*`): a sliding-only block fed with
    e_proj(enorm(embed(next token))) + h_proj(hnorm(previous streams)), per stream."""

    def __init__(self, cfg: DeepseekV4Config, stage: int, dtype: torch.dtype) -> None:
        super().__init__(cfg, cfg.num_hidden_layers + stage, 0, False, dtype)
        h, n = cfg.hidden_size, cfg.hc_mult
        self.e_proj = Linear(h, h, dtype)
        self.h_proj = Linear(h, h, dtype)
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * h, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))


class DeepseekV4Model(nn.Module):
    """Embedding, layers, hyper-connection head, final norm, LM head and MTP stages."""

    def __init__(self, cfg: DeepseekV4Config, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        h, n = cfg.hidden_size, cfg.hc_mult
        self.embed = nn.Embedding(cfg.vocab_size, h, dtype=dtype)
        self.layers = nn.ModuleList(
            Block(cfg, i, cfg.compress_ratios[i], cfg.is_hash_layer(i), dtype) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.head = Linear(h, cfg.vocab_size, dtype)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * h, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        n_stages = len(cfg.mtp_compress_ratios)
        if cfg.has_dspark:
            # stages of the DSpark drafter instead of plain MTP
            self.mtp = nn.ModuleList(DSparkStage(cfg, k, n_stages, dtype) for k in range(n_stages))
        else:
            self.mtp = nn.ModuleList(MTPStage(cfg, k, dtype) for k in range(n_stages))
        self.rotary_main = Rotary(cfg.qk_rope_head_dim, cfg.rope_theta)
        self.rotary_compress = Rotary(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)

    def context(self, batch: ForwardBatch, cache: KVCache) -> ForwardContext:
        return ForwardContext(batch, cache, self.rotary_main, self.rotary_compress)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, cache: KVCache, capture: dict | None = None) -> torch.Tensor:
        """Run every layer over the flattened batch; returns the final streams [T, N, D].
        ``capture`` (optional, DSpark target features): for every layer id among its keys,
        ``capture[i]`` is set to that layer's INPUT streams [T, N, D] (its attention input)."""
        ctx = self.context(batch, cache)
        streams = self.embed(batch.input_ids).unsqueeze(1).repeat(1, self.cfg.hc_mult, 1)
        for i, layer in enumerate(self.layers):
            if capture is not None and i in capture:
                capture[i] = streams
            streams = layer(streams, ctx)
        return streams

    @torch.no_grad()
    def compute_logits(self, streams: torch.Tensor) -> torch.Tensor:
        """Final streams of the rows that need logits [R, N, D] -> float32 logits [R, V]."""
        cfg = self.cfg
        x = hc_head(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, cfg.hc_eps, cfg.rms_norm_eps)
        return self.head(self.norm(x)).float()

    @torch.no_grad()
    def mtp_forward(self, stage: int, prev_streams: torch.Tensor, batch: ForwardBatch, cache: KVCache
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP stage. `batch.input_ids` are the tokens one position ahead of the rows
        of `prev_streams` (the previous stage's or the main model's final streams).
        Returns (this stage's streams [T, N, D], float32 logits [T, V])."""
        cfg, mtp = self.cfg, self.mtp[stage]
        ctx = self.context(batch, cache)
        e = mtp.e_proj(mtp.enorm(self.embed(batch.input_ids)))
        streams = mtp.h_proj(mtp.hnorm(prev_streams)) + e.unsqueeze(1)
        streams = mtp(streams, ctx)
        x = hc_head(streams, mtp.hc_head_fn, mtp.hc_head_base, mtp.hc_head_scale, cfg.hc_eps, cfg.rms_norm_eps)
        return streams, self.head(mtp.norm(x)).float()
