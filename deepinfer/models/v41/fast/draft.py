"""DSpark's draft stages of DeepSeek-V4.1 on the compiled executor: the parallel block pass
around which `models/fast/draft_dspark.py` builds the block inputs and the sampling (V4's
stages: `models/v4/fast/draft.py`), for
V4.1's shifted hyper-connections, the sites of ``decode_layers_v41`` (`forward.py`): the
previous expansion, this site's mixes, the collapse and the input norm, the fused MoE with
float32 router logits, and the output collapse + norm in one launch (``hc_collapse_norm``)."""

from __future__ import annotations

from typing import Any

import torch

from ...fast.decode import _inv_freq
from ...fast.draft_dspark import stage_block_attention
from ...fast.moe import moe_forward
from ...rope import Rotary
from .forward import _first_pre, _route_logits, _site


def stages_hidden_v41(model: Any, stages: list, ops: Any, ids: torch.Tensor, pos: torch.Tensor, gamma: int,
                      ctx_kvs: list[torch.Tensor], ctx_pos: torch.Tensor, rotary: Rotary | None = None
                      ) -> torch.Tensor:
    """V4.1 stages (shifted hyper-connections) over R blocks -> the normed hidden [R * gamma, D]."""
    cfg, inv = stages[0].cfg, _inv_freq(rotary or model.rotary_main, ids.device)
    iters, hc_eps, eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
    streams = model.embed(ids).unsqueeze(1).expand(-1, cfg.hc_mult, -1)
    pre, prev = _first_pre(streams), None
    for stage, ctx_kv in zip(stages, ctx_kvs):
        new, a_pre, a_post, a_comb, x = ops.hc_shifted(streams, *_site(stage, "attn"), iters, hc_eps, eps, pre,
                                                       (stage.attn_norm.weight, stage.attn_norm.eps), prev)
        streams = streams if new is None else new
        out = stage_block_attention(stage.attn, ops, x, pos, gamma, ctx_kv, ctx_pos, inv, "none",  # no query norm
                                    stage.window_kv_quant)
        streams, pre, f_post, f_comb, x = ops.hc_shifted(streams, *_site(stage, "ffn"), iters, hc_eps, eps, a_pre,
                                                         (stage.ffn_norm.weight, stage.ffn_norm.eps),
                                                         (out, a_post, a_comb))
        ffn = stage.ffn
        prev = (moe_forward(ffn, x, ids, ops, logits=_route_logits(ffn.gate, x, ops)), f_post, f_comb)
    last = stages[-1]
    return ops.hc_collapse_norm(streams, pre, (last.norm.weight, last.norm.eps), prev)
