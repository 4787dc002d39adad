"""The DSpark drafter stages of DeepSeek-V4.1 (`mtp.{0,1,2}`) and their drafting math.

Layout (REFERENCE.md section 7, docs/v41_assumptions.md): each stage is a sliding-only
V4.1 block with the drafter's own MoE (``dspark_n_routed_experts``, top
``dspark_num_experts_per_tok``); stage 0 owns ``main_proj`` / ``main_norm``, the last stage
the output ``norm``, the Markov and the confidence heads. No ``hc_head``: as in the V4.1
backbone the output collapses the streams with the last site's ``pre``.

Drafting (`deepinfer/spec/dspark_drafter.py` orchestrates): the block's streams start as
the embedding repeated hc_mult times with the one-hot "stream 0" incoming pre, and the
shifted hyper-connections carry each site's ``pre`` to the next sublayer (a stage's
attention collapses with the previous stage's ffn-site pre, its ffn with its own
attention-site pre), exactly like `Block41.forward`. Attention is the V4.1 one (no
per-head query RMSNorm; window KV rounded like the backbone's when `simulate_kv_quant`)
over the DSpark key set: context rows (target features, `context_kv`) in the window and
the block's own rows bidirectionally (`dspark.block_attention`).
"""

from __future__ import annotations

import torch

from ..kv_quant import fp8_block_sim
from ..linear import Linear
from ..norm import RMSNorm
from ..rope import Rotary, apply_rope
from ..v4.dspark import ConfidenceHead, MarkovHead, block_attention
from .block import Block41
from .config import DeepseekV41Config
from .layers import hc_collapse, hc_expand


class DSparkStage41(Block41):
    """`mtp.K` of the V4.1 DSpark drafter (cache id / layer id num_hidden_layers + K)."""

    def __init__(self, cfg: DeepseekV41Config, stage: int, n_stages: int, dtype: torch.dtype) -> None:
        super().__init__(cfg, cfg.num_hidden_layers + stage, 0, dtype, cfg.dspark_n_routed_experts,
                         cfg.dspark_num_experts_per_tok)
        h = cfg.hidden_size
        if stage == 0:
            self.main_proj = Linear(len(cfg.dspark_target_layer_ids) * h, h, dtype)
            self.main_norm = RMSNorm(h, cfg.rms_norm_eps)
        if stage == n_stages - 1:
            self.norm = RMSNorm(h, cfg.rms_norm_eps)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank, dtype)
            self.confidence_head = ConfidenceHead(h, cfg.dspark_markov_rank, dtype)

    @property
    def window_kv_quant(self) -> str:
        """How the stage rounds its window KV (a ``norm_rope`` quant mode): as the backbone stores it."""
        return "fp8" if self.attn.sim else "none"

    def _window_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attn = self.attn
        kv = apply_rope(attn.kv_norm(attn.wkv(x)), cos, sin)
        return fp8_block_sim(kv, 32) if attn.sim else kv

    def context_kv(self, main_x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """Window K/V of target-feature rows: RoPE(kv_norm(wkv(main_x))) at their positions
        (rounded like stored window KV). main_x [L, D] -> [L, head_dim]."""
        cos, sin = rotary.cos_sin(positions, main_x.dtype)
        return self._window_kv(main_x, cos, sin)

    def block_forward(self, streams: torch.Tensor, pre: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                      block: int, ctx_kv: torch.Tensor, ctx_pos: torch.Tensor, rotary: Rotary
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(streams [R * block, N, D], incoming pre [R * block, N]) -> (streams, this stage's
        ffn-site pre), over R draft blocks of ``block`` rows (see the module docstring)."""
        a_pre, a_post, a_comb = self._mixes(streams, "hc_attn")
        x = self.attn_norm(hc_collapse(streams, pre))
        streams = hc_expand(self._block_attention(x, positions, block, ctx_kv, ctx_pos, rotary), streams,
                            a_post, a_comb)
        f_pre, f_post, f_comb = self._mixes(streams, "hc_ffn")
        x = self.ffn_norm(hc_collapse(streams, a_pre))
        return hc_expand(self.ffn(x, ids), streams, f_post, f_comb), f_pre

    def _block_attention(self, x: torch.Tensor, pos: torch.Tensor, block: int, ctx_kv: torch.Tensor,
                         ctx_pos: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        attn, cfg = self.attn, self.cfg
        cos, sin = rotary.cos_sin(pos, x.dtype)
        q = apply_rope(attn.wq_b(attn.q_norm(attn.wq_a(x))).view(-1, attn.n_heads, attn.head_dim), cos, sin)
        out = block_attention(q, self._window_kv(x, cos, sin), pos, block, ctx_kv, ctx_pos, attn.window,
                              attn.attn_sink)
        out = apply_rope(out, cos, -sin)
        return attn.wo_b(attn.wo_a(out.reshape(out.shape[0], cfg.o_groups, -1)))


def draft_pass(stages: list, streams: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, block: int,
               ctx_kvs: list[torch.Tensor], ctx_pos: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """The stages over R draft blocks with shifted hyper-connections: the first site
    collapses stream 0 (one-hot pre), each stage's ffn-site pre feeds the next stage, the
    last pre collapses the output streams (no hc_head). streams [R * block, N, D] -> hidden
    [R * block, D] before the output norm. The V4.1 family's ``dspark_draft_pass``."""
    pre = streams.new_zeros(streams.shape[:2], dtype=torch.float32)
    pre[:, 0] = 1.0
    for stage, ctx_kv in zip(stages, ctx_kvs):
        streams, pre = stage.block_forward(streams, pre, ids, positions, block, ctx_kv, ctx_pos, rotary)
    return hc_collapse(streams, pre)
