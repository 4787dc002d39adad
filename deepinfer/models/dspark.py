"""Parameter layout of the DSpark drafter stages (V4-Flash 0731 release).

Checkpoint layout (REFERENCE.md section 6, confirmed against public loaders): three
stages `mtp.{0,1,2}`, each a full sliding-only block (attn, ffn, mHC, norms) with no
e_proj/h_proj; stage 0 also owns `main_proj` ([hidden, n_targets * hidden], the
projection of the target model's features from `dspark_target_layer_ids`) and
`main_norm`; the last stage owns the output `norm`, `hc_head_*`, the low-rank Markov
head (`markov_w1`, `markov_w2`: [vocab, rank]) and the confidence head
(`proj`: [1, hidden + rank]).

The drafting forward (parallel block proposal, Markov bias, confidence) belongs to the
speculative decoder, which uses these modules as they are loaded here.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import DeepseekV4Config
from .deepseek_v4 import Block
from .linear import Linear
from .norm import RMSNorm


class MarkovHead(nn.Module):
    """Transition bias W2 . W1[previous token]: two [vocab, rank] tables."""

    def __init__(self, vocab: int, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.markov_w1 = Linear(rank, vocab, dtype)  # stored [vocab, rank]: row = embedding of a token
        self.markov_w2 = Linear(rank, vocab, dtype)  # stored [vocab, rank]: logits = W2 @ embedding

    def forward(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """[R] token ids -> [R, vocab] bias."""
        return self.markov_w2(self.markov_w1.weight[prev_tokens])


class ConfidenceHead(nn.Module):
    """sigmoid(w . [hidden ; Markov embedding of the previous token]) before temperature."""

    def __init__(self, hidden: int, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = Linear(hidden + rank, 1, dtype)


class DSparkStage(Block):
    """One `mtp.K` stage of a DSpark drafter."""

    def __init__(self, cfg: DeepseekV4Config, stage: int, n_stages: int, dtype: torch.dtype) -> None:
        super().__init__(cfg, cfg.num_hidden_layers + stage, 0, False, dtype)
        h, n = cfg.hidden_size, cfg.hc_mult
        if stage == 0:
            self.main_proj = Linear(len(cfg.dspark_target_layer_ids) * h, h, dtype)
            self.main_norm = RMSNorm(h, cfg.rms_norm_eps)
        if stage == n_stages - 1:
            self.norm = RMSNorm(h, cfg.rms_norm_eps)
            self.hc_head_fn = nn.Parameter(torch.zeros(n, n * h, dtype=torch.float32))
            self.hc_head_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
            self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank, dtype)
            self.confidence_head = ConfidenceHead(h, cfg.dspark_markov_rank, dtype)
