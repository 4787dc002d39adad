"""DeepSeek-V4 attention (reference path): shared-KV MQA with partial interleaved RoPE,
per-head attention sinks, a sliding-window branch in every layer and, in CSA / HCA
layers, a compressed branch; grouped low-rank output projection.

K = V: one 512-wide KV vector per token serves every head as key and value. Because
values carry RoPE on their trailing slice, the output's rope slice is rotated back by
the query position before the output projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer import batch_invariant

from .. import invariant_attention
from ..linear import GroupedLinear, Linear
from ..norm import RMSNorm, unweighted_rms_norm
from ..paged_batch import ForwardBatch, SeqMeta, gather_rows, scatter_rows
from ..rope import Rotary, apply_rope
from .compressor import Compressor, CompressorStore, Indexer, read_entries
from .config import DeepseekV4Config
from .kv_cache import GROUP_CSA, GROUP_HCA, GROUP_SWA, KVCache


@dataclass
class ForwardContext:
    """What every layer of one forward pass shares."""

    batch: ForwardBatch
    cache: KVCache
    rotary_main: Rotary
    rotary_compress: Rotary


class Attention(nn.Module):
    """`attn.*` of one layer. `cache_id` is the layer's id in the window cache (MTP
    stages use ids after the main layers)."""

    def __init__(self, cfg: DeepseekV4Config, cache_id: int, ratio: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg, self.cache_id, self.ratio = cfg, cache_id, ratio
        h, d, n = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
        self.n_heads, self.head_dim, self.window = n, d, cfg.sliding_window
        self.wq_a = Linear(h, cfg.q_lora_rank, dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, n * d, dtype)
        self.wkv = Linear(h, d, dtype)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = GroupedLinear(n * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups, dtype)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, h, dtype)
        self.attn_sink = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.is_csa = ratio == cfg.csa_ratio
        self.compressor = Compressor(h, d, ratio, self.is_csa, cfg.rms_norm_eps, dtype) if ratio else None
        self.indexer = (
            Indexer(h, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, ratio, cfg.index_topk,
                    cfg.rms_norm_eps, dtype)
            if self.is_csa else None
        )

    def _stores(self, cache: KVCache) -> tuple[CompressorStore | None, CompressorStore | None]:
        i = self.cache_id
        if self.is_csa:
            return (CompressorStore(cache.csa_kv[i], cache.ring[i], cache.csa_tail[i], GROUP_CSA),
                    CompressorStore(cache.csa_index[i], cache.index_ring[i], cache.csa_index_tail[i], GROUP_CSA))
        if self.ratio:
            return CompressorStore(cache.hca_kv[i], cache.ring[i], None, GROUP_HCA), None
        return None, None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [T, hidden] (normed sublayer input) -> [T, hidden]."""
        cfg, pos = self.cfg, ctx.batch.positions
        rotary = ctx.rotary_compress if self.ratio else ctx.rotary_main
        cos, sin = rotary.cos_sin(pos, x.dtype)
        q_res = self.q_norm(self.wq_a(x))
        q = unweighted_rms_norm(self.wq_b(q_res).view(-1, self.n_heads, self.head_dim), cfg.rms_norm_eps)
        q = apply_rope(q, cos, sin)
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        kv_store, index_store = self._stores(ctx.cache)
        out = torch.empty_like(q)
        for seq in ctx.batch.seqs:
            rows = slice(seq.offset, seq.offset + seq.length)
            out[rows] = self._attend_one(x[rows], q_res[rows], q[rows], kv[rows], pos[rows], seq, ctx,
                                         kv_store, index_store)
        out = apply_rope(out, cos, -sin)
        grouped = self.wo_a(out.reshape(out.shape[0], cfg.o_groups, -1))
        return self.wo_b(grouped)

    def _attend_one(self, x: torch.Tensor, q_res: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                    pos: torch.Tensor, seq: SeqMeta, ctx: ForwardContext, kv_store: CompressorStore | None,
                    index_store: CompressorStore | None) -> torch.Tensor:
        cache, s, e = ctx.cache, seq.start, seq.start + seq.length
        swa_table = seq.block_table[GROUP_SWA]
        scatter_rows(cache.swa[self.cache_id], swa_table, s, kv)
        k_lo = max(0, s - self.window + 1)
        keys = gather_rows(cache.swa[self.cache_id], swa_table, k_lo, e)  # [Lk, D]
        key_pos = torch.arange(k_lo, e, device=x.device)
        visible = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - self.window)
        parts, masks = [keys], [visible]
        if self.compressor is not None:
            n_entries = self.compressor(x, seq, kv_store, ctx.rotary_compress, cache.block_size)
            if n_entries:
                entries = read_entries(kv_store, seq, n_entries)
                if self.indexer is not None:
                    self.indexer.compressor(x, seq, index_store, ctx.rotary_compress, cache.block_size)
                    index_keys = read_entries(index_store, seq, n_entries)
                    top, valid = self.indexer.select(x, q_res, pos, index_keys, ctx.rotary_compress)
                    chosen = torch.zeros(x.shape[0], n_entries + 1, dtype=torch.bool, device=x.device)
                    chosen.scatter_(1, torch.where(valid, top, n_entries), True)
                    mask = chosen[:, :n_entries]
                else:
                    mask = torch.arange(n_entries, device=x.device)[None, :] < ((pos + 1) // self.ratio)[:, None]
                parts.append(entries)
                masks.append(mask)
            elif self.indexer is not None:  # keep the indexer's ring in step
                self.indexer.compressor(x, seq, index_store, ctx.rotary_compress, cache.block_size)
        if batch_invariant.enabled():  # one key order per query, whatever the chunk
            entries, entry_mask = (parts[1], masks[1]) if len(parts) > 1 else (None, None)
            return invariant_attention.attend(q, pos, keys, k_lo, self.window, entries, entry_mask,
                                              self.attn_sink, self.head_dim ** -0.5)
        kv_all = torch.cat(parts)  # [Lk + n, D]
        mask = torch.cat(masks, dim=1)  # [L, Lk + n]
        logits = torch.einsum("lhd,kd->lhk", q, kv_all) * self.head_dim ** -0.5
        logits = logits.float().masked_fill(~mask[:, None, :], float("-inf"))
        sink = self.attn_sink.float()[None, :, None].expand(logits.shape[0], -1, 1)
        combined = torch.cat([logits, sink], dim=-1)
        probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        return torch.einsum("lhk,kd->lhd", probs.to(kv_all.dtype), kv_all)
