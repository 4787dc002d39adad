"""DeepSeek-V4.1 attention (reference path): own window KV, shared compressed KV read from
the nearest KV source, indexer selection, bounded-replay narrowing (see v41/model.py)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer import batch_invariant as bi
from .. import invariant_ops
from ..kv_quant import fp4_block_sim, fp8_block_sim
from ..linear import GroupedLinear, Linear
from ..norm import RMSNorm
from ..paged_batch import SeqMeta, gather_rows, scatter_rows
from ..rope import apply_rope
from .config import DeepseekV41Config
from .kv_cache import GROUP_SRC
from .layers import QUERY_BLOCK, Compressor41, Indexer41, V41Context




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
