"""DSpark's draft stages of DeepSeek-V4 on the compiled executor: the parallel block pass
of the stages over R draft blocks (the block inputs and the sampling around it are shared:
`models/fast/draft_dspark.py`). Each stage is one fused-mHC block (`models/fast/forward.py`
``run_block``: fused mHC, the fused MoE) with the stage's dense block attention as its
attention sublayer; the last stage's ``hc_head`` + output norm is fused with its last
``hc_post``. V4.1's stages: `models/v41/fast/draft.py`."""

from __future__ import annotations

from typing import Any

import torch

from ...fast.decode import _inv_freq
from ...fast.draft_dspark import stage_block_attention
from ...fast.forward import head_hidden, run_block
from ...rope import Rotary


def stages_hidden_v4(model: Any, stages: list, ops: Any, ids: torch.Tensor, pos: torch.Tensor, gamma: int,
                     ctx_kvs: list[torch.Tensor], ctx_pos: torch.Tensor, rotary: Rotary | None = None
                     ) -> torch.Tensor:
    """V4 stages over R blocks with fused mHC / MoE -> the normed hidden [R * gamma, D]
    (``rotary``: the model's main rope, on the device inside a graph)."""
    inv = _inv_freq(rotary or model.rotary_main, ids.device)
    streams = model.embed(ids).unsqueeze(1).expand(-1, model.cfg.hc_mult, -1)
    prev = None
    for stage, ctx_kv in zip(stages, ctx_kvs):
        def attention(attn, x, ctx_kv=ctx_kv):
            return stage_block_attention(attn, ops, x, pos, gamma, ctx_kv, ctx_pos, inv, "unweighted")

        streams, prev = run_block(stage, streams, prev, ids, ops, attention)
    return head_hidden(stages[-1], ops, streams, prev)
