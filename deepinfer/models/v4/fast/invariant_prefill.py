"""Prefill / mixed steps of the compiled executor in batch-invariant mode.

A row's result must be the bits it would get in a graphed decode step (the same token
lands in either kind of step depending on the traffic: a decode row shares a mixed step
with prompts, a prompt's last token may come alone). So every row runs the decode
step's per-row pieces, batched over the whole step: the projections and norms of
``attention_inputs``, the compressors' ring / tail bookkeeping of ``compress_prefill``
with the entries pooled by the kernel decode uses (``pool_windows``), the indexer
scores + stable top-k of ``indexer_topk`` and ``decode_attention`` (with its split
merge) over each row's own block tables, then the decode head (``hc_head`` + the LM
head) for the rows that sample. The ops are the mode's (``invariant_ops`` of models/fast/invariant.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...fast.decode import _inv_freq, grouped_out
from ...fast.forward import head_hidden, head_logits, run_layers
from ...fast.prefill_compressor import CompressorPlan, compress_prefill
from ...fast.prefill_meta import PrefillMeta
from ...rope import Rotary
from ..kv_cache import GROUP_CSA, GROUP_SWA, KVCache
from .decode import attention_inputs

__all__ = ["window_pool", "attention_prefill_invariant", "prefill_logits"]


def window_pool(ops: Any, comp: torch.nn.Module, plan: CompressorPlan, store: Any, inv_freq: torch.Tensor,
                dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """The ``pool`` hook of ``compress_prefill``: every closing window's rows (the ring's
    history, then the step's own rows) as float32 source rows in the ring's layout,
    pooled into the window's entry by ``ops.pool_windows``."""
    def pool(kv_src: torch.Tensor, sc_src: torch.Tensor) -> None:
        n_win, r = plan.win_pos.shape[0], comp.ratio
        if n_win == 0:
            return
        src = torch.stack([kv_src.float(), sc_src.float()], dim=1)  # [S, 2, C], exact
        if comp.overlap:  # the previous window's rows first (none for window 0), then its own
            idx = torch.full((n_win, 2 * r), -1, dtype=torch.long, device=src.device)
            idx[:, r:] = plan.own
            idx[plan.prev_win, :r] = plan.prev
        else:
            idx = plan.own
        dest = plan.entry_blk * store.entries.shape[1] + plan.entry_sub
        ops.pool_windows(src, idx, plan.win_pos, dest, store.entries, comp.norm.weight, comp.norm.eps, inv_freq,
                         r, comp.overlap, dtype)
    return pool


def attention_prefill_invariant(attn: torch.nn.Module, x: torch.Tensor, meta: PrefillMeta, cache: KVCache,
                                rotary_main: Rotary, rotary_compress: Rotary) -> torch.Tensor:
    """One layer's attention over a prefill / mixed step, x [T, hidden] -> [T, hidden],
    every row computed as ``decode.attention_decode`` computes a decode row."""
    cfg, ops, pos, bs = attn.cfg, meta.ops, meta.positions, meta.block_size
    n = x.shape[0]
    inv = _inv_freq(rotary_compress if attn.ratio else rotary_main, x.device)
    comp, ix = attn.compressor, attn.indexer
    swa = cache.swa[attn.cache_id]
    swa_rows = meta.row_tables(GROUP_SWA)
    proj, q_side, q = attention_inputs(attn, x, ops, pos, inv, swa, swa_rows)
    kv_store, index_store = attn._stores(cache)
    comp_pool = comp_table = topk = None
    max_keys = attn.window
    if comp is not None:
        inv_c = _inv_freq(rotary_compress, x.device)
        plan = meta.plan(comp, kv_store)
        compress_prefill(comp, proj[2], proj[3], pos, plan, kv_store, rotary_compress, bs,
                         pool=window_pool(ops, comp, plan, kv_store, inv_c, x.dtype))
        comp_pool, comp_table = kv_store.entries, meta.row_tables(kv_store.group)
        n_cols = comp_table.shape[1] * bs // attn.ratio
        if ix is not None:
            iplan = meta.plan(ix.compressor, index_store)
            compress_prefill(ix.compressor, proj[4], proj[5], pos, iplan, index_store, rotary_compress, bs,
                             pool=window_pool(ops, ix.compressor, iplan, index_store, inv_c, x.dtype))
            iq = q_side[1].view(n, ix.n_heads, ix.dim)  # RoPE'd inside the scores kernel
            topk = ops.indexer_topk(iq, proj[6], pos, index_store.entries, meta.row_tables(GROUP_CSA), attn.ratio,
                                    ix.topk, n_cols, weight_scale=ix.n_heads ** -0.5, rope_inv_freq=inv)
            max_keys += ix.topk
        else:
            max_keys += n_cols
    o = ops.decode_attention(q, pos, swa, swa_rows, attn.window, attn.attn_sink, comp_pool, comp_table,
                             attn.ratio if comp_pool is not None else 0, topk, max_keys=max_keys, rope_inv_freq=inv)
    return attn.wo_b(grouped_out(attn.wo_a, o.view(n, cfg.o_groups, -1), ops))


@torch.no_grad()
def prefill_logits(model: Any, cache: KVCache, input_ids: torch.Tensor, meta: PrefillMeta,
                   rows: torch.Tensor) -> torch.Tensor:
    """Float32 logits [R, V] of ``rows`` of a prefill / mixed step (``meta`` from
    ``PrefillPath.prepare`` with the mode's ops): every layer over every row, then the
    decode step's head (last ``hc_post`` + ``hc_head`` + final norm in the mHC kernels,
    the LM head) for those rows only."""
    ops = meta.ops
    streams, (out, post, comb) = run_layers(model, input_ids, ops, lambda attn, x: attention_prefill_invariant(
        attn, x, meta, cache, model.rotary_main, model.rotary_compress))
    if rows.numel() == 0:  # a step of prompt chunks only: the layers wrote the cache, nothing samples
        return torch.empty(0, model.cfg.vocab_size, dtype=torch.float32, device=input_ids.device)
    hidden = head_hidden(model, ops, streams[rows], (out[rows], post[rows], comb[rows]))
    return head_logits(model, ops, hidden)
