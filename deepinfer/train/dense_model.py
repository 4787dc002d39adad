"""Dense, differentiable forward of a whole DeepSeek-V4 model (and its MTP stage) over a
batch of sequences [B, L] starting at position 0: the training twin of
`DeepseekV4Model.forward` / `compute_logits` / `mtp_forward`, on the same modules.

Streams stay flattened as the engine keeps them ([B * L, hc_mult, hidden]) so the mHC
functions, norms and MoE modules are the engine's own; only attention is replaced by
`dense_attention` (the paged one writes caches and loops over requests).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.models.mhc import hc_head, hc_post, hc_pre

from .dense_attention import dense_attention


@dataclass
class DenseForward:
    """Outputs of `model_forward`."""

    streams: torch.Tensor  # final streams [B * L, N, D]
    layer_inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # captured input streams [B * L, N, D]
    indexer_kl: list[torch.Tensor] = field(default_factory=list)  # one per CSA layer


def mix_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_pre` in float32 even under autocast, as the engine computes the mHC mixes."""
    with torch.autocast(streams.device.type, enabled=False):
        return hc_pre(streams, fn, base, scale, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)


def block_forward(block: torch.nn.Module, streams: torch.Tensor, ids: torch.Tensor, shape: tuple[int, int],
                  rotary_main, rotary_compress, with_indexer_loss: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`Block.forward` with dense attention. streams [B * L, N, D], ids [B * L]."""
    cfg, (b, length) = block.cfg, shape
    post, comb, x = mix_pre(streams, block.hc_attn_fn, block.hc_attn_base, block.hc_attn_scale, cfg)
    out, aux = dense_attention(block.attn, block.attn_norm(x).view(b, length, -1), rotary_main, rotary_compress,
                               with_indexer_loss)
    streams = hc_post(out.reshape(b * length, -1), streams, post, comb)
    post, comb, x = mix_pre(streams, block.hc_ffn_fn, block.hc_ffn_base, block.hc_ffn_scale, cfg)
    streams = hc_post(block.ffn(block.ffn_norm(x), ids), streams, post, comb)
    return streams, aux.indexer_kl


def model_forward(model: torch.nn.Module, tokens: torch.Tensor, capture: tuple[int, ...] = (),
                  with_indexer_loss: bool = False) -> DenseForward:
    """All layers over tokens [B, L]. `capture`: layer ids whose INPUT streams to keep
    (the DSpark drafter's target features, as `DeepseekV4Model.forward(capture=...)`)."""
    b, length = tokens.shape
    ids = tokens.reshape(-1)
    streams = model.embed(ids).unsqueeze(1).repeat(1, model.cfg.hc_mult, 1)
    result = DenseForward(streams)
    for i, layer in enumerate(model.layers):
        if i in capture:
            result.layer_inputs[i] = streams
        streams, kl = block_forward(layer, streams, ids, (b, length), model.rotary_main, model.rotary_compress,
                                    with_indexer_loss)
        if kl is not None:
            result.indexer_kl.append(kl)
    result.streams = streams
    return result


def head_logits(model: torch.nn.Module, streams: torch.Tensor, owner: torch.nn.Module | None = None,
                norm: torch.nn.Module | None = None) -> torch.Tensor:
    """hc_head collapse (with `owner`'s hc_head parameters, default the model's), `norm`,
    shared LM head -> float32 logits [T, V] (`compute_logits` without no_grad)."""
    cfg, owner = model.cfg, owner if owner is not None else model
    with torch.autocast(streams.device.type, enabled=False):
        x = hc_head(streams, owner.hc_head_fn, owner.hc_head_base, owner.hc_head_scale, cfg.hc_eps, cfg.rms_norm_eps)
    return model.head((norm if norm is not None else model.norm)(x)).float()


def mtp_forward(model: torch.nn.Module, final_streams: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """MTP stage 0 over every row t < L-1: h_proj(hnorm(h_t)) + e_proj(enorm(embed(x_{t+1})))
    at position t, predicting x_{t+2}. Returns float32 logits [B, L-1, V]."""
    mtp, cfg = model.mtp[0], model.cfg
    b, length = tokens.shape
    n, d = cfg.hc_mult, cfg.hidden_size
    prev = final_streams.view(b, length, n, d)[:, :-1].reshape(-1, n, d)
    ids = tokens[:, 1:].reshape(-1)
    streams = mtp.h_proj(mtp.hnorm(prev)) + mtp.e_proj(mtp.enorm(model.embed(ids))).unsqueeze(1)
    streams, _ = block_forward(mtp, streams, ids, (b, length - 1), model.rotary_main, model.rotary_compress)
    return head_logits(model, streams, mtp, mtp.norm).view(b, length - 1, -1)
