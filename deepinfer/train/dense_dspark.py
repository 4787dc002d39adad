"""Dense, differentiable DSpark drafting pass for training: many draft blocks at once.

The training twin of `DSparkDrafter.draft_logits` (deepinfer/spec/dspark_drafter.py) on
the same stage modules. For an anchor p (the last position whose KV is valid) a block
holds [x_{p+1}, noise x (gamma - 1)] at positions p+1..p+gamma; row j attends to the
target-feature keys at positions in (p+1+j-window, p] and to every row of its block, and
predicts x_{p+2+j}. Every stage's context keys come from the same target features
main_x = main_norm(main_proj(concat of mean-over-streams layer inputs)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.models.mhc import hc_head, hc_post
from deepinfer.models.norm import unweighted_rms_norm
from deepinfer.models.rope import apply_rope

from .dense_attention import rope_rows
from .dense_model import mix_pre


@dataclass
class DraftBlocks:
    """One training batch of draft blocks: anchors [B, A]; per row [B, A, G]."""

    ids: torch.Tensor  # block input ids (x_{p+1}, then noise)
    positions: torch.Tensor  # p + 1 + j
    prev: torch.Tensor  # x_{p+1+j}: the token before row j's prediction (Markov / confidence input)
    targets: torch.Tensor  # x_{p+2+j}
    valid: torch.Tensor  # bool: the target exists (p + 2 + j < L)


def make_blocks(tokens: torch.Tensor, anchors: torch.Tensor, gamma: int, noise_id: int) -> DraftBlocks:
    """Blocks for anchors [B, A] (each in [0, L-3]) over tokens [B, L]."""
    b, length = tokens.shape
    j = torch.arange(gamma, device=tokens.device)
    pos = anchors[..., None] + 1 + j  # [B, A, G]
    gather = lambda idx: tokens.gather(1, idx.clamp(max=length - 1).reshape(b, -1)).view(idx.shape)  # noqa: E731
    ids = torch.full_like(pos, noise_id)
    ids[..., 0] = gather(anchors + 1)
    return DraftBlocks(ids, pos, gather(pos), gather(pos + 1), pos + 1 < length)


def target_features(stage0: torch.nn.Module, layer_inputs: dict[int, torch.Tensor], layers: list[int],
                    shape: tuple[int, int]) -> torch.Tensor:
    """main_norm(main_proj(concat over `layers` of mean-over-streams inputs)) -> [B, L, D]."""
    feats = torch.cat([layer_inputs[i].mean(dim=1) for i in layers], dim=-1)
    return stage0.main_norm(stage0.main_proj(feats)).view(*shape, -1)


def _context_keys(stage: torch.nn.Module, main_x: torch.Tensor, anchors: torch.Tensor, rotary
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each anchor's window of context keys: ([B, A, W-1, hd], key positions [B, A, W-1])."""
    b, length, _ = main_x.shape
    window = stage.attn.window
    kv = rope_rows(stage.attn.kv_norm(stage.attn.wkv(main_x)), torch.arange(length, device=main_x.device), rotary)
    kpos = anchors[..., None] - window + 2 + torch.arange(window - 1, device=main_x.device)  # (p+1-W, p]
    keys = kv.gather(1, kpos.clamp(min=0).reshape(b, -1, 1).expand(-1, -1, kv.shape[-1]))
    return keys.view(*kpos.shape, -1), kpos


def _block_attention(stage: torch.nn.Module, x: torch.Tensor, blocks: DraftBlocks, ctx_keys: torch.Tensor,
                     ctx_pos: torch.Tensor, rotary) -> torch.Tensor:
    """`DSparkStage._block_attention` for all blocks. x [B*A*G, D] normed -> [B*A*G, D]."""
    attn, cfg = stage.attn, stage.cfg
    b, a, g = blocks.ids.shape
    h, hd = attn.n_heads, attn.head_dim
    pos = blocks.positions.reshape(b * a, g)
    q_res = attn.q_norm(attn.wq_a(x))
    q = unweighted_rms_norm(attn.wq_b(q_res).view(b * a, g, h, hd), cfg.rms_norm_eps)
    q = _rope_per_row(q, pos, rotary)
    kv = _rope_per_row(attn.kv_norm(attn.wkv(x)).view(b * a, g, hd), pos, rotary)
    ck = ctx_keys.reshape(b * a, -1, hd).to(kv.dtype)
    scale = hd ** -0.5
    logits_c = torch.einsum("rghd,rkd->rhgk", q, ck).float() * scale
    visible = (ctx_pos.reshape(b * a, 1, -1) > pos[..., None] - attn.window) & (ctx_pos.reshape(b * a, 1, -1) >= 0)
    logits_c = logits_c.masked_fill(~visible[:, None], float("-inf"))
    logits_b = torch.einsum("rghd,rkd->rhgk", q, kv).float() * scale
    sink = attn.attn_sink.float()[None, :, None, None].expand(b * a, -1, g, 1)
    combined = torch.cat([logits_c, logits_b, sink], dim=-1)
    probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1).to(kv.dtype)
    n_ctx = ck.shape[1]
    out = torch.einsum("rhgk,rkd->rghd", probs[..., :n_ctx], ck) + torch.einsum(
        "rhgk,rkd->rghd", probs[..., n_ctx: n_ctx + g], kv)
    out = _rope_per_row(out, pos, rotary, inverse=True)
    return attn.wo_b(attn.wo_a(out.reshape(b * a * g, cfg.o_groups, -1)))


def _rope_per_row(x: torch.Tensor, pos: torch.Tensor, rotary, inverse: bool = False) -> torch.Tensor:
    """RoPE for x [R, G, ...] whose rows sit at their own positions pos [R, G]."""
    cos, sin = rotary.cos_sin(pos.reshape(-1), x.dtype)
    flat = x.reshape(-1, *x.shape[2:])
    return apply_rope(flat, cos, -sin if inverse else sin).view(x.shape)


def draft_forward(model: torch.nn.Module, stages: torch.nn.ModuleList, main_x: torch.Tensor,
                  blocks: DraftBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """All stages over the blocks -> (logits [B, A, G, V] float32 without the Markov bias,
    normed last-stage hidden h [B, A, G, D])."""
    cfg = model.cfg
    b, a, g = blocks.ids.shape
    ids = blocks.ids.reshape(-1)
    streams = model.embed(ids).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
    anchors = blocks.positions[..., 0] - 1
    for stage in stages:
        ctx_keys, ctx_pos = _context_keys(stage, main_x, anchors, model.rotary_main)
        post, comb, x = mix_pre(streams, stage.hc_attn_fn, stage.hc_attn_base, stage.hc_attn_scale, cfg)
        out = _block_attention(stage, stage.attn_norm(x), blocks, ctx_keys, ctx_pos, model.rotary_main)
        streams = hc_post(out, streams, post, comb)
        post, comb, x = mix_pre(streams, stage.hc_ffn_fn, stage.hc_ffn_base, stage.hc_ffn_scale, cfg)
        streams = hc_post(stage.ffn(stage.ffn_norm(x), ids), streams, post, comb)
    last = stages[-1]
    with torch.autocast(streams.device.type, enabled=False):
        x = hc_head(streams, last.hc_head_fn, last.hc_head_base, last.hc_head_scale, cfg.hc_eps, cfg.rms_norm_eps)
    hidden = last.norm(x)
    logits = model.head(hidden).float()
    return logits.view(b, a, g, -1), hidden.view(b, a, g, -1)


__all__ = ["DraftBlocks", "make_blocks", "target_features", "draft_forward"]
