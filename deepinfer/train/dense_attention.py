"""Dense, differentiable DeepSeek-V4 attention over whole sequences, for training.

Same parameters and the same math as the engine's paged reference path
(`deepinfer.models.v4.attention.Attention`, `compressor.Compressor`, `Indexer.select`), but
over a padded batch of sequences [B, L] that all start at position 0, with no cache:

* the sliding window is computed in bands: queries in blocks of `window` rows attend to
  their own block and the previous one (2 x window keys, masked to the exact window), so
  the cost is O(L x window), not O(L^2);
* compressed entries are pooled for every closed window at once (CSA overlapping
  windows: Ca of window w-1 + Cb of window w; HCA disjoint windows);
* CSA queries see the indexer's top-k entries, chosen from detached index scores (top-k
  has no gradient); the indexer is trained by `indexer_loss`: KL from the main
  attention's distribution over all visible entries (detached, mean over heads) to the
  indexer's softmax, with the indexer's inputs detached, as DeepSeek's sparse attention
  is trained.

`tests/test_train_dense.py` checks these logits against the engine on random configs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.models.norm import unweighted_rms_norm
from deepinfer.models.rope import Rotary, apply_rope


@dataclass
class AttentionAux:
    """What a layer's attention reports besides its output (training losses)."""

    indexer_kl: torch.Tensor | None = None  # mean KL(attention || indexer) over (query, batch)


def rope_rows(x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, inverse: bool = False) -> torch.Tensor:
    """`apply_rope` for a [B, L, ..., D] tensor whose rows sit at `positions` [L]."""
    b, length = x.shape[:2]
    cos, sin = rotary.cos_sin(positions, x.dtype)
    cos, sin = cos.repeat(b, 1), sin.repeat(b, 1)
    flat = x.reshape(b * length, *x.shape[2:])
    return apply_rope(flat, cos, -sin if inverse else sin).view(x.shape)


def pool_entries(comp: torch.nn.Module, x: torch.Tensor, rotary: Rotary) -> torch.Tensor | None:
    """Every closed window's entry: x [B, L, hidden] -> [B, L // ratio, dim] (None if none)."""
    r, d = comp.ratio, comp.dim
    b, length, _ = x.shape
    n_win = length // r
    if n_win == 0:
        return None
    xs = x[:, : n_win * r]
    pos = torch.arange(n_win * r, device=x.device)
    kv = comp.wkv(xs).view(b, n_win, r, -1)
    sc = (comp.wgate(xs) + comp.ape[pos % r]).float().view(b, n_win, r, -1)
    if comp.overlap:  # window w mixes Ca (first d channels) of window w-1 with its own Cb
        prev_kv = torch.cat([kv.new_zeros(b, 1, r, d), kv[:, :-1, :, :d]], dim=1)
        prev_sc = torch.cat([sc.new_full((b, 1, r, d), float("-inf")), sc[:, :-1, :, :d]], dim=1)
        kv = torch.cat([prev_kv, kv[..., d:]], dim=2)
        sc = torch.cat([prev_sc, sc[..., d:]], dim=2)
    weights = sc.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
    pooled = comp.norm((kv * weights).sum(dim=2))
    return rope_rows(pooled, torch.arange(n_win, device=x.device) * r, rotary)


def index_scores(ix: torch.nn.Module, x: torch.Tensor, q_res: torch.Tensor, keys: torch.Tensor,
                 positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """Indexer scores sum_h w_h relu(q_h . k) [B, L, n] float32, future entries at -inf."""
    b, length, _ = x.shape
    q = rope_rows(ix.wq_b(q_res).view(b, length, ix.n_heads, ix.dim), positions, rotary)
    weights = ix.weights_proj(x).float() * ix.n_heads ** -0.5
    scores = torch.relu(torch.einsum("blhd,bnd->blhn", q.float(), keys.float())) * ix.dim ** -0.5
    scores = (scores * weights.unsqueeze(-1)).sum(dim=2)
    return scores.masked_fill(~entry_visibility(positions, keys.shape[1], ix.ratio)[None], float("-inf"))


def entry_visibility(positions: torch.Tensor, n_entries: int, ratio: int) -> torch.Tensor:
    """[L, n] bool: entry w is visible to the query at p once its window closed (w < (p+1)//r)."""
    return torch.arange(n_entries, device=positions.device)[None, :] < ((positions + 1) // ratio)[:, None]


def topk_entries(scores: torch.Tensor, topk: int, visible: torch.Tensor) -> torch.Tensor:
    """[B, L, n] bool mask of each query's top-k visible entries: highest score first, lowest
    entry id among exact ties (the engine's order; ties are common, relu makes zeros)."""
    k = min(topk, scores.shape[-1])
    top = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices[..., :k]
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True)
    return chosen & visible[None]


def banded_window_logits(q: torch.Tensor, kv: torch.Tensor, window: int, scale: float
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, L, H, D], kv [B, L, D] -> (logits [B, H, L, 2W] float32 with -inf outside the
    window, key blocks [B, nb, 2W, D], nb). Query block c sees key positions (c-1)W..cW+W-1."""
    b, length, h, d = q.shape
    nb = -(-length // window)
    pad = nb * window - length
    qb = F.pad(q, (0, 0, 0, 0, 0, pad)).view(b, nb, window, h, d)
    kp = F.pad(kv, (0, 0, window, pad))  # W zero rows in front: index j holds position j - W
    keys = kp.unfold(1, 2 * window, window).transpose(-1, -2)  # [B, nb, 2W, D]
    logits = torch.einsum("bcqhd,bckd->bhcqk", qb, keys).float() * scale
    qpos = torch.arange(nb * window, device=q.device).view(nb, window, 1)
    kpos = (torch.arange(nb, device=q.device).view(nb, 1, 1) - 1) * window + torch.arange(2 * window, device=q.device)
    visible = (kpos <= qpos) & (kpos > qpos - window) & (kpos >= 0)
    logits = logits.masked_fill(~visible, float("-inf")).reshape(b, h, nb * window, 2 * window)
    return logits[:, :, :length], keys, nb


def dense_attention(attn: torch.nn.Module, x: torch.Tensor, rotary_main: Rotary, rotary_compress: Rotary,
                    with_indexer_loss: bool = False) -> tuple[torch.Tensor, AttentionAux]:
    """One layer's `attn.*` over x [B, L, hidden] (normed sublayer input) -> [B, L, hidden]."""
    cfg, window = attn.cfg, attn.window
    b, length, _ = x.shape
    positions = torch.arange(length, device=x.device)
    rotary = rotary_compress if attn.ratio else rotary_main
    q_res = attn.q_norm(attn.wq_a(x))
    q = unweighted_rms_norm(attn.wq_b(q_res).view(b, length, attn.n_heads, attn.head_dim), cfg.rms_norm_eps)
    q = rope_rows(q, positions, rotary)
    kv = rope_rows(attn.kv_norm(attn.wkv(x)), positions, rotary)
    scale = attn.head_dim ** -0.5
    logits_w, key_blocks, nb = banded_window_logits(q, kv, window, scale)
    parts, aux = [logits_w], AttentionAux()
    entries = None
    if attn.compressor is not None:
        entries = pool_entries(attn.compressor, x, rotary_compress)
    if entries is not None:
        visible = entry_visibility(positions, entries.shape[1], attn.ratio)
        logits_e = torch.einsum("blhd,bnd->bhln", q, entries).float() * scale
        if attn.indexer is not None:
            # The selection has no gradient, so the indexer sees detached inputs: only
            # its KL loss trains it, and it never shapes the main model.
            ix, xd, qd = attn.indexer, x.detach(), q_res.detach()
            keys = pool_entries(ix.compressor, xd, rotary_compress)
            scores = index_scores(ix, xd, qd, keys, positions, rotary_compress)
            mask = topk_entries(scores, ix.topk, visible)
            if with_indexer_loss:
                aux.indexer_kl = indexer_loss(logits_e.detach(), scores, visible)
        else:
            mask = visible[None].expand(b, -1, -1)
        parts.append(logits_e.masked_fill(~mask[:, None], float("-inf")))
    sink = attn.attn_sink.float()[None, :, None, None].expand(b, -1, length, 1)
    combined = torch.cat(parts + [sink], dim=-1)
    probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1).to(kv.dtype)
    pw = F.pad(probs[..., : 2 * window], (0, 0, 0, nb * window - length))
    pw = pw.view(b, attn.n_heads, nb, window, 2 * window)
    out = torch.einsum("bhcqk,bckd->bcqhd", pw, key_blocks).reshape(b, nb * window, attn.n_heads, -1)[:, :length]
    if entries is not None:
        pe = probs[..., 2 * window: 2 * window + entries.shape[1]]
        out = out + torch.einsum("bhln,bnd->blhd", pe, entries)
    out = rope_rows(out, positions, rotary, inverse=True)
    grouped = attn.wo_a(out.reshape(b * length, cfg.o_groups, -1))
    return attn.wo_b(grouped).view(b, length, -1), aux


def indexer_loss(entry_logits: torch.Tensor, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """KL(attention over visible entries, mean over heads || softmax(indexer scores)),
    averaged over queries that see at least one entry. entry_logits [B, H, L, n]."""
    has = visible.any(dim=-1)  # [L]
    if not bool(has.any()):
        return scores.new_zeros(())
    target = torch.softmax(entry_logits.masked_fill(~visible[None, None], float("-inf")), dim=-1).mean(dim=1)
    logp = torch.log_softmax(scores, dim=-1)
    kl = (target * (torch.log(target.clamp_min(1e-20)) - logp.masked_fill(~visible[None], 0.0))).sum(-1)
    return kl[:, has].mean()
