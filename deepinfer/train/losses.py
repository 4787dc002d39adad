"""Training losses: next-token CE for the model and its MTP stage, the indexer's KL, and
DSpark's drafter objective (REFERENCE.md section 8): 0.1 CE + 0.9 L1(p_draft, p_target)
+ 1.0 BCE(confidence, 1 - TV), positions weighted exp(-(k-1)/tau).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .dense_dspark import DraftBlocks


def next_token_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits [..., V] against targets [...] (float32 math)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


@dataclass
class DraftLoss:
    """DSpark losses of one batch, each already weighted and averaged over valid rows."""

    total: torch.Tensor
    ce: torch.Tensor
    l1: torch.Tensor
    bce: torch.Tensor
    accept: torch.Tensor  # [G] mean 1 - TV per draft position (expected acceptance at temperature 1)
    conf_logit: torch.Tensor  # [B * A, G] confidence logits (before temperature), detached
    row_accept: torch.Tensor  # [B * A, G] 1 - TV per row, detached


def dspark_loss(logits: torch.Tensor, hidden: torch.Tensor, blocks: DraftBlocks, target_logits: torch.Tensor,
                last_stage: torch.nn.Module, tau: float = 3.0) -> DraftLoss:
    """logits [B, A, G, V] (drafter, without Markov bias), hidden [B, A, G, D], target_logits
    [B, A, G, V] (the target's logits predicting the same tokens, detached)."""
    prev = blocks.prev.reshape(-1)
    markov = last_stage.markov_head
    z = (logits.reshape(-1, logits.shape[-1]) + markov(prev)).float()
    p_draft = torch.softmax(z, dim=-1)
    p_target = torch.softmax(target_logits.reshape(-1, target_logits.shape[-1]).float(), dim=-1).detach()
    tv = 0.5 * (p_draft - p_target).abs().sum(dim=-1)  # [R]
    conf_logit = last_stage.confidence_head.proj(
        torch.cat([hidden.reshape(-1, hidden.shape[-1]), markov.embedding(prev).to(hidden.dtype)], dim=-1)
    ).float().squeeze(-1)
    g = blocks.ids.shape[-1]
    pos_w = torch.exp(-torch.arange(g, device=z.device, dtype=torch.float32) / tau)
    w = (pos_w.expand(blocks.ids.shape) * blocks.valid).reshape(-1)
    norm = w.sum().clamp_min(1.0)
    ce = (F.cross_entropy(z, blocks.targets.reshape(-1), reduction="none") * w).sum() / norm
    l1 = (2.0 * tv * w).sum() / norm
    bce = (F.binary_cross_entropy_with_logits(conf_logit, (1.0 - tv).detach(), reduction="none") * w).sum() / norm
    valid = blocks.valid.reshape(-1, g).float()
    accept = ((1.0 - tv.detach()).view(-1, g) * valid).sum(0) / valid.sum(0).clamp_min(1.0)
    return DraftLoss(0.1 * ce + 0.9 * l1 + 1.0 * bce, ce, l1, bce, accept, conf_logit.detach().view(-1, g),
                     (1.0 - tv.detach()).view(-1, g))
