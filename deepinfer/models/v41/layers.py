"""DeepSeek-V4.1 building blocks: shifted hyper-connection mixes, the router and MoE,
the shared-KV compressor and the source/consumer indexer (see v41/model.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
import torch
import torch.nn.functional as F
from torch import nn
QUERY_BLOCK = 256  # queries scored / attended at a time (bounds the [q, keys] buffers)

from deepinfer import batch_invariant as bi
from .. import invariant_ops
from ..kv_quant import fp4_block_sim
from ..linear import Linear
from ..moe import MoE, score
from ..norm import RMSNorm, unweighted_rms_norm
from ..paged_batch import ForwardBatch, SeqMeta
from ..rope import Rotary, apply_rope
from .config import DeepseekV41Config
from .kv_cache import KVCacheV41


@dataclass
class V41Context:
    """What every layer of one pass shares. `narrow` marks the decoder pass, whose window
    attention starts at each sequence's `cuts` entry; `shared[i]` carries sequence i's
    top-k / candidate blocks from the latest index source of this pass."""

    batch: ForwardBatch
    cache: KVCacheV41
    rotary_main: Rotary
    rotary_compress: Rotary
    cuts: list[int]
    narrow: bool = False
    shared: list[dict] = field(default_factory=list)

    def fresh(self, batch: ForwardBatch | None = None, narrow: bool | None = None) -> "V41Context":
        b = batch or self.batch
        return V41Context(b, self.cache, self.rotary_main, self.rotary_compress, self.cuts,
                          self.narrow if narrow is None else narrow, [{} for _ in b.seqs])


# ---- hyper-connections (shifted) -------------------------------------------------------
def hc_mixes(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
             hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, N, D] -> (pre [T, N], post [T, N], comb [T, N, N]) in float32."""
    n = streams.shape[1]
    flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), norm_eps)
    mixes = invariant_ops.linear(flat, fn.float())
    s, b = scale.float(), base.float()
    pre = invariant_ops.sigmoid(mixes[:, :n] * s[0] + b[:n]) + hc_eps
    post = 2 * invariant_ops.sigmoid(mixes[:, n:2 * n] * s[1] + b[n:2 * n])
    comb = torch.softmax(mixes[:, 2 * n:].view(-1, n, n) * s[2] + b[2 * n:].view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return invariant_ops.collapse_streams(pre, streams.float()).to(streams.dtype)


def hc_expand(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """new_k = post_k * out + sum_j comb[j, k] * streams_j (the j-sum in a fixed order)."""
    s = streams.float()
    mixed = comb[:, 0, :, None] * s[:, 0:1]
    for j in range(1, s.shape[1]):
        mixed = mixed + comb[:, j, :, None] * s[:, j:j + 1]
    return (post.unsqueeze(-1) * out.float().unsqueeze(1) + mixed).to(streams.dtype)


# ---- MoE ------------------------------------------------------------------------------
class Gate41(nn.Module):
    """Router: float32 scores of logits / gate_temp; `bias` steers selection only;
    `bias_vl` (image spans) is loaded but unused on the text-only path."""

    def __init__(self, hidden: int, n_experts: int, top_k: int, cfg: DeepseekV41Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, hidden, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))
        self.top_k, self.func, self.temp = top_k, cfg.scoring_func, cfg.gate_temp
        # one expert is never normalised (its weight stays its score): the effective flag, so
        # every executor of this gate (the fast path's router kernel too) reads the same
        self.route_scale, self.normalize = cfg.routed_scaling_factor, cfg.norm_topk_prob and top_k > 1

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = score(invariant_ops.linear(x.float(), self.weight.float()) / self.temp, self.func)
        ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, ids


class MoE41(MoE):
    def __init__(self, cfg: DeepseekV41Config, n_experts: int, top_k: int, dtype: torch.dtype) -> None:
        super().__init__(cfg.hidden_size, cfg.moe_intermediate_size, n_experts, top_k, cfg.n_shared_experts,
                         False, cfg.vocab_size, cfg.scoring_func, cfg.routed_scaling_factor, cfg.norm_topk_prob,
                         cfg.swiglu_limit, dtype)
        self.gate = Gate41(cfg.hidden_size, n_experts, top_k, cfg, dtype)


# ---- compressor / indexer -------------------------------------------------------------
class Compressor41(nn.Module):
    """`attn.compressor` of a KV source: ratio r > 1 pools each aligned group of r tokens
    (softmax over `wgate(x)` per channel, float32), ratio 1 projects every token; both end
    with `norm`. Returns the pre-RoPE latents of the groups closing in this chunk."""

    def __init__(self, hidden: int, dim: int, ratio: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.ratio, self.dim = ratio, dim
        self.wkv = Linear(hidden, dim, dtype)
        self.wgate = Linear(hidden, dim, dtype) if ratio > 1 else None
        self.norm = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, seq: SeqMeta, ring: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """(latents [groups, dim], first group id) for one request's chunk."""
        r, s, e = self.ratio, seq.start, seq.start + seq.length
        if r == 1:
            return self.norm(self.wkv(x)), s
        kv = invariant_ops.linear(x.float(), self.wkv.weight.float())
        sc = invariant_ops.linear(x.float(), self.wgate.weight.float())
        # The ring holds the projections of the last ring_len positions at position % ring_len.
        # ring_len = r, or more with speculative decoding (deepinfer/spec/kv.py): a verify step
        # writes drafts that may be rejected, and the next step re-reads the open group before them.
        n_ring = ring.shape[0]
        lo = (s // r) * r  # start of the group open at the chunk start
        hist = torch.arange(lo, s, device=x.device) % n_ring
        kv_seq = torch.cat([ring[hist, 0], kv])
        sc_seq = torch.cat([ring[hist, 1], sc])
        w_a, w_b = s // r, e // r  # groups [w_a, w_b) close in this chunk
        keep = torch.arange(max(lo, e - n_ring), e, device=x.device)  # includes the group left open
        ring[keep % n_ring, 0] = kv_seq[keep - lo]
        ring[keep % n_ring, 1] = sc_seq[keep - lo]
        if w_b <= w_a:
            return kv.new_zeros(0, self.dim).to(x.dtype), w_a
        n = w_b - w_a
        kv_win = kv_seq[: n * r].view(n, r, -1)
        sc_win = sc_seq[: n * r].view(n, r, -1)
        latent = (kv_win * sc_win.softmax(dim=1)).sum(dim=1)
        return self.norm(latent.to(x.dtype)), w_a


class Indexer41(nn.Module):
    """`attn.indexer` of an index source (`wq_b`, `weights_proj`) and, on KV sources, the
    index-key projection (`wk`, `k_norm`) of the pooled latents."""

    def __init__(self, cfg: DeepseekV41Config, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.n_heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.ratio = cfg.compress_ratios[layer]
        self.sim = cfg.simulate_kv_quant
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.dim, dtype)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, dtype)
        if layer in cfg.kv_source_layer_ids:
            self.wk = Linear(cfg.head_dim, self.dim, dtype)
            self.k_norm = RMSNorm(self.dim, cfg.rms_norm_eps)
        c = cfg.candidate_source_layer_id
        self.is_candidate_source = layer == c
        self.uses_candidates = 0 <= c < layer
        self.cand_topk, self.cand_block = cfg.candidate_topk_blocks, cfg.candidate_block_size

    def keys(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        k = apply_rope(self.k_norm(self.wk(latent)), cos, sin)
        return fp4_block_sim(k, 32) if self.sim else k

    def select(self, x: torch.Tensor, q_res: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor, rotary: Rotary,
               shared: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k entry ids per query and their validity ([L, k] int64, [L, k] bool).
        Ties (frequent: relu zeroes many scores) go to the lowest entry id."""
        n = keys.shape[0]
        cos, sin = rotary.cos_sin(pos, q_res.dtype)
        q = apply_rope(self.wq_b(q_res).view(-1, self.n_heads, self.dim), cos, sin)
        if self.sim:
            q = fp4_block_sim(q, 32)
        weights = self.weights_proj(x).float() * self.n_heads ** -0.5
        k = min(self.topk, n)
        tops, valids, cands = [], [], []
        for a in range(0, q.shape[0], QUERY_BLOCK):
            b = min(a + QUERY_BLOCK, q.shape[0])
            idx = self._scores(q[a:b], keys, weights[a:b])  # [Lb, n]
            lens = (pos[a:b] + 1) // self.ratio  # entries each query may see
            idx = idx.masked_fill(torch.arange(n, device=idx.device)[None, :] >= lens[:, None], float("-inf"))
            if self.is_candidate_source:
                cands.append(self._candidate_blocks(idx, lens))
            elif self.uses_candidates and shared.get("cand") is not None:
                allowed = shared["cand"][a:b].repeat_interleave(self.cand_block, dim=1)[:, :n]
                idx = idx.masked_fill(~allowed, float("-inf"))
            order = torch.sort(idx, dim=-1, descending=True, stable=True)
            tops.append(order.indices[:, :k])
            valids.append(order.values[:, :k] > float("-inf"))
        if self.is_candidate_source:
            shared["cand"] = torch.cat(cands)
        return torch.cat(tops), torch.cat(valids)

    def _scores(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_h weights_h * relu(q_h . k) * dim^-0.5: [Lb, H, D] x [n, D] -> [Lb, n]."""
        if not bi.enabled():
            scores = torch.relu(torch.einsum("lhd,nd->lhn", q.float(), keys.float())) * self.dim ** -0.5
            return (scores * weights.unsqueeze(-1)).sum(dim=1)
        # batch-invariant: every score from a fixed-shape GEMM, heads added in order
        lb, h = q.shape[0], q.shape[1]
        scores = invariant_ops.matmul_nt(q.reshape(lb * h, -1).float(), keys.float()).view(lb, h, -1)
        scores = torch.relu(scores) * self.dim ** -0.5
        out = scores[:, 0] * weights[:, 0:1]
        for i in range(1, h):
            out = out + scores[:, i] * weights[:, i:i + 1]
        return out

    def _candidate_blocks(self, idx: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Level one of the two-level top-k: [Lb, n_blocks] bool of the kept blocks."""
        bs, n = self.cand_block, idx.shape[1]
        nb = -(-n // bs)
        blocks = F.pad(idx, (0, nb * bs - n), value=float("-inf")).view(-1, nb, bs).amax(dim=-1)
        newest = ((lens - 1) // bs).clamp(min=0)
        pin = (torch.arange(nb, device=idx.device)[None, :] == newest[:, None]) & (lens[:, None] > 0)
        blocks = blocks.masked_fill(pin, float("inf"))
        order = torch.sort(blocks, dim=-1, descending=True, stable=True)
        kb = min(self.cand_topk, nb)
        keep = torch.zeros_like(blocks, dtype=torch.bool)
        return keep.scatter_(1, order.indices[:, :kb], order.values[:, :kb] > float("-inf"))
