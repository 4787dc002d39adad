"""Parameter layout of the DSpark drafter stages (V4-Flash 0731 release).

Checkpoint layout (REFERENCE.md section 6, confirmed against public loaders): three
stages `mtp.{0,1,2}`, each a full sliding-only block (attn, ffn, mHC, norms) with no
e_proj/h_proj; stage 0 also owns `main_proj` ([hidden, n_targets * hidden], the
projection of the target model's features from `dspark_target_layer_ids`) and
`main_norm`; the last stage owns the output `norm`, `hc_head_*`, the low-rank Markov
head (`markov_w1`, `markov_w2`: [vocab, rank]) and the confidence head
(`proj`: [1, hidden + rank]).

The per-stage drafting math lives here (`DSparkStage.context_kv`: K/V of target-feature
rows; `DSparkStage.block_forward`: the stage over draft blocks that attend densely to
their context rows and bidirectionally to themselves; `MarkovHead`, `ConfidenceHead`);
the orchestration (features, window cache writes, sequential sampling) is
`deepinfer/spec/dspark_drafter.py`. Assumptions: docs/dspark_assumptions.md.
"""

from __future__ import annotations

import torch
from torch import nn

from ..linear import Linear
from ..mhc import hc_head, hc_post, hc_pre
from ..norm import RMSNorm, unweighted_rms_norm
from ..rope import Rotary, apply_rope
from .block import Block
from .config import DeepseekV4Config


class MarkovHead(nn.Module):
    """Transition bias W2 . W1[previous token]: two [vocab, rank] tables."""

    def __init__(self, vocab: int, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.markov_w1 = Linear(rank, vocab, dtype)  # stored [vocab, rank]: row = embedding of a token
        self.markov_w2 = Linear(rank, vocab, dtype)  # stored [vocab, rank]: logits = W2 @ embedding

    def embedding(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """[R] token ids -> [R, rank]: the rows W1[prev]."""
        return self.markov_w1.weight[prev_tokens]

    def forward(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """[R] token ids -> [R, vocab] bias W2 @ W1[prev] (float32)."""
        return self.bias(self.embedding(prev_tokens))

    def bias(self, embedding: torch.Tensor) -> torch.Tensor:
        """[R, rank] rows W1[prev] -> [R, vocab] bias W2 @ W1[prev] (float32)."""
        return self.markov_w2(embedding).float()


class ConfidenceHead(nn.Module):
    """sigmoid(w . [hidden ; Markov embedding of the previous token]) before temperature."""

    def __init__(self, hidden: int, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = Linear(hidden + rank, 1, dtype)

    def forward(self, hidden: torch.Tensor, markov_emb: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """hidden [R, D] (normed last-stage hidden), markov_emb [R, rank] (W1[previous
        token]) -> [R] float32 survival probabilities sigmoid(w . [h ; e] / T); ``temperature``
        may be a tensor that broadcasts against [R]."""
        z = self.proj(torch.cat([hidden, markov_emb.to(hidden.dtype)], dim=-1)).float().squeeze(-1)
        return torch.sigmoid(z / temperature)


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

    #: How the stage rounds its window KV (a ``norm_rope`` quant mode): V4 keeps it as computed.
    window_kv_quant = "none"

    # ------------------------------------------------------------------ drafting
    def context_kv(self, main_x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """Keys/values of target-feature rows for this stage: RoPE(kv_norm(wkv(main_x))) at
        the rows' positions. main_x [L, D] = main_norm(main_proj(features)) -> [L, head_dim]."""
        cos, sin = rotary.cos_sin(positions, main_x.dtype)
        return apply_rope(self.attn.kv_norm(self.attn.wkv(main_x)), cos, sin)

    def block_forward(self, streams: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, block: int,
                      ctx_kv: torch.Tensor, ctx_pos: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """The stage over R draft blocks of ``block`` rows each (flattened, [R * block, N, D]).

        Block r's queries attend to its context rows ``ctx_kv[r]`` [L, head_dim] (target
        features at positions ``ctx_pos[r]``, all before the block, padding at
        ``NO_POSITION``; a row is visible when it lies within the sliding window of the
        query) and to every row of the same block (bidirectional). Block K/V are not
        written anywhere."""
        cfg = self.cfg
        post, comb, x = hc_pre(streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale,
                               cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        streams = hc_post(self._block_attention(self.attn_norm(x), positions, block, ctx_kv, ctx_pos, rotary),
                          streams, post, comb)
        post, comb, x = hc_pre(streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale,
                               cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        return hc_post(self.ffn(self.ffn_norm(x), ids), streams, post, comb)

    def _block_attention(self, x: torch.Tensor, pos: torch.Tensor, block: int, ctx_kv: torch.Tensor,
                         ctx_pos: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """Dense version of `Attention.forward` (same projections, sinks, inverse RoPE on the
        output) with the DSpark key set. x: [R * block, D] normed -> [R * block, D]."""
        attn, cfg = self.attn, self.cfg
        cos, sin = rotary.cos_sin(pos, x.dtype)
        q_res = attn.q_norm(attn.wq_a(x))
        q = unweighted_rms_norm(attn.wq_b(q_res).view(-1, attn.n_heads, attn.head_dim), cfg.rms_norm_eps)
        q = apply_rope(q, cos, sin)
        kv = apply_rope(attn.kv_norm(attn.wkv(x)), cos, sin)
        out = block_attention(q, kv, pos, block, ctx_kv, ctx_pos, attn.window, attn.attn_sink)
        out = apply_rope(out, cos, -sin)
        return attn.wo_b(attn.wo_a(out.reshape(out.shape[0], cfg.o_groups, -1)))


def draft_pass(stages: list, streams: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, block: int,
               ctx_kvs: list[torch.Tensor], ctx_pos: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """Every stage's `block_forward` over R draft blocks (stage s attends to ``ctx_kvs[s]``),
    then the last stage's hyper-connection head: streams [R * block, N, D] -> hidden
    [R * block, D] before the output norm. The V4 family's ``dspark_draft_pass``."""
    for stage, ctx_kv in zip(stages, ctx_kvs):
        streams = stage.block_forward(streams, ids, positions, block, ctx_kv, ctx_pos, rotary)
    last = stages[-1]
    return hc_head(streams, last.hc_head_fn, last.hc_head_base, last.hc_head_scale, last.cfg.hc_eps,
                   last.cfg.rms_norm_eps)


#: Position of a padded context row: never within any query's window.
NO_POSITION = -(1 << 40)


def block_attention(q: torch.Tensor, kv: torch.Tensor, pos: torch.Tensor, block: int, ctx_kv: torch.Tensor,
                    ctx_pos: torch.Tensor, window: int, attn_sink: torch.Tensor) -> torch.Tensor:
    """Single-KV-head attention of R draft blocks (V4 and V4.1 stages), all at once.

    q [R * block, H, Dh], kv [R * block, Dh] (the blocks' own keys = values, post-RoPE);
    ctx_kv [R, L, Dh] / ctx_pos [R, L]: each block's context rows (padding at position
    ``NO_POSITION``). Block r's queries see its context rows within the sliding window
    and every row of their own block (bidirectional), plus a per-head sink. Returns
    [R * block, H, Dh] (still rotated: the caller un-ropes). One batched pass: no loop
    over requests (the drafter's step must not grow with the batch in launches)."""
    rows, h, dh = q.shape
    r = rows // block
    qb = q.view(r, block, h, dh)
    keys = torch.cat([ctx_kv.to(kv.dtype), kv.view(r, block, dh)], dim=1)  # [R, L + block, Dh]
    qp = pos.view(r, block)
    ctx_vis = ctx_pos[:, None, :] > qp[:, :, None] - window  # [R, block, L]
    mask = torch.cat([ctx_vis, ctx_vis.new_ones(r, block, block)], dim=2)
    logits = torch.einsum("rlhd,rkd->rlhk", qb, keys).float() * dh ** -0.5
    logits = logits.masked_fill(~mask[:, :, None, :], float("-inf"))
    sink = attn_sink.float()[None, None, :, None].expand(r, block, -1, 1)
    combined = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum("rlhk,rkd->rlhd", probs.to(keys.dtype), keys).reshape(rows, h, dh)
