"""Manifold-constrained hyper-connections (mHC).

The residual is `hc_mult` parallel streams. Before each sublayer a small projection of
the (normalised, flattened) streams yields three mixes: `pre` collapses the streams into
the sublayer input, `post` spreads the sublayer output back over the streams and
`comb` (made doubly stochastic by Sinkhorn-Knopp) mixes the old streams into the new.
"""

from __future__ import annotations

import torch
from torch import nn

from . import invariant_ops
from .norm import unweighted_rms_norm


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams: [T, N, D] -> (post [T, N], comb [T, N, N], collapsed [T, D]); float32 mixes."""
    n = streams.shape[1]
    flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), norm_eps)
    mixes = invariant_ops.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = invariant_ops.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * invariant_ops.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + hc_eps
    # Sinkhorn-Knopp: columns first, then alternate rows / columns.
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = invariant_ops.collapse_streams(pre, streams).to(streams.dtype)
    return post, comb, collapsed


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams = post (x) sublayer output + comb^T @ old streams. out: [T, D]."""
    dtype = streams.dtype
    mixed = invariant_ops.stream_mix(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Final collapse of the streams before the output norm: [T, N, D] -> [T, D]."""
    flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), norm_eps)
    pre = invariant_ops.sigmoid(invariant_ops.linear(flat, fn.float()) * scale.float() + base.float()) + hc_eps
    return invariant_ops.collapse_streams(pre, streams).to(streams.dtype)


def hc_params(module: nn.Module, prefix: str, n: int, hidden: int) -> None:
    """Register ``{prefix}_fn / _base / _scale``: one mHC site's mix weights (float32, as checkpointed)."""
    mix = (2 + n) * n
    setattr(module, f"{prefix}_fn", nn.Parameter(torch.zeros(mix, n * hidden, dtype=torch.float32)))
    setattr(module, f"{prefix}_base", nn.Parameter(torch.zeros(mix, dtype=torch.float32)))
    setattr(module, f"{prefix}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))
