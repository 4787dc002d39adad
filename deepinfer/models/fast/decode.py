"""Batched pure-decode attention of DeepSeek-V4: one query token per request, every request
of the step at once, no Python loop over requests and no host sync (CUDA-graph safe).

Mirrors ``Attention.forward`` / ``Compressor.forward`` / ``Indexer.select`` for the case
``seq.length == 1 and not seq.is_new``:

* the window KV row of each request is scattered into the swa pool at its position;
* each compressor writes the token's (kv, score) projections into the request's ring
  slot; a window closes for the requests with ``(pos + 1) % ratio == 0``: the pooled
  entry is computed for every request and written with ``torch.where(closes, new, old)``
  (a read-modify-write of the entry the window owns, which lies in the request's
  current, private block), likewise the overlap tail at a block end;
* CSA layers select entries with the indexer top-k (fixed ``index_topk`` slots, -1 =
  none), HCA layers read all visible entries; attention is ``decode_attention`` with
  ``max_keys`` derived from the (fixed) table width.

Every write is idempotent (the same inputs write the same values), so a step may run
twice (warm-up before a graph capture) without changing the cache.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ..kv_cache import GROUP_CSA, GROUP_HCA, GROUP_SWA
from ..norm import unweighted_rms_norm
from ..rope import Rotary, apply_rope


def _ensure_kernels_importable() -> None:
    """A source checkout that was not pip-installed (e.g. the device machine with
    PYTHONPATH=.) has deepinfer_kernels only as the folder kernels/ next to deepinfer/."""
    if importlib.util.find_spec("deepinfer_kernels") is not None:
        return
    init = Path(__file__).resolve().parents[3] / "kernels" / "__init__.py"
    if not init.exists():
        raise ImportError("deepinfer_kernels is neither installed nor next to the deepinfer package")
    spec = importlib.util.spec_from_file_location("deepinfer_kernels", init,
                                                  submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["deepinfer_kernels"] = module
    spec.loader.exec_module(module)


def kernel_ops(kind: str) -> SimpleNamespace:
    """The batched ops: ``"triton"`` (deepinfer_kernels) or ``"ref"`` (their torch
    references: per-request loops with host reads, for CPU tests only)."""
    _ensure_kernels_importable()
    from deepinfer_kernels import decode_attention as da
    from deepinfer_kernels import fused_moe as fm
    from deepinfer_kernels import indexer_topk as it
    from deepinfer_kernels import mhc
    from deepinfer_kernels import router as rt

    if kind not in ("triton", "ref"):
        raise ValueError(f"unknown fast-path op kind {kind!r}")
    sfx = "" if kind == "triton" else "_ref"
    mods = {"decode_attention": da, "indexer_topk": it, "router": rt, "fused_moe": fm, "hc_pre": mhc,
            "hc_post_pre": mhc, "hc_head": mhc}
    return SimpleNamespace(kind=kind, **{name: getattr(mod, name + sfx) for name, mod in mods.items()})


@dataclass
class DecodeMeta:
    """Per-step device tensors of a pure-decode step (built once by the runner).

    positions [R] int64; slots [R] int64 (compressor ring slots); tables: group ->
    [R, width] int64 physical block ids (padding = 0, never read for a visible row);
    tables32: the same as int32 for the kernels."""

    positions: torch.Tensor
    slots: torch.Tensor
    tables: dict[str, torch.Tensor]
    tables32: dict[str, torch.Tensor]
    width: int
    ops: Any
    _rope: dict = field(default_factory=dict)

    def cos_sin(self, rotary: Rotary, positions: torch.Tensor, dtype: torch.dtype, key: Any
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``rotary.cos_sin(positions, dtype)`` with the frequencies kept on the device
        (Rotary moves them from the host each call, which a graph capture forbids),
        computed once per step for each (rotary, key)."""
        k = (id(rotary), key, dtype)
        if k not in self._rope:
            inv = getattr(rotary, "_inv_freq_dev", None)
            if inv is None or inv.device != positions.device:
                inv = rotary.inv_freq.to(positions.device)
                rotary._inv_freq_dev = inv
            freqs = positions.float()[:, None] * inv[None, :]
            self._rope[k] = (freqs.cos().to(dtype).float(), freqs.sin().to(dtype).float())
        return self._rope[k]


def _row_blocks(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table [R, W] int64, index [R] -> table[r, index[r]]."""
    return table.gather(1, index[:, None])[:, 0]


def compressor_decode(comp: torch.nn.Module, x: torch.Tensor, meta: DecodeMeta, store: Any, rotary: Rotary,
                      block_size: int) -> None:
    """``Compressor.forward`` for one new token per request, all requests at once."""
    r, d, pos, slot = comp.ratio, comp.dim, meta.positions, meta.slots
    kv = comp.wkv(x)
    sc = comp.wgate(x) + comp.ape[pos % r]
    ring = store.ring  # [slots, L, 2, coff * d] float32
    ring_len = ring.shape[1]
    ring[slot, pos % ring_len] = torch.stack([kv.float(), sc.float()], dim=1)
    w = pos // r
    own = w[:, None] * r + torch.arange(r, device=x.device)[None, :]  # [R, r]
    rows = ring[slot[:, None], own % ring_len]  # [R, r, 2, coff * d]
    if comp.overlap:
        prev = ring[slot[:, None], (own - r) % ring_len]
        has_prev = (w >= 1)[:, None, None]
        kv_a = torch.where(has_prev, prev[:, :, 0, :d].to(kv.dtype), torch.zeros((), dtype=kv.dtype, device=x.device))
        sc_a = torch.where(has_prev, prev[:, :, 1, :d], torch.full((), float("-inf"), device=x.device))
        kv_win = torch.cat([kv_a, rows[:, :, 0, d:].to(kv.dtype)], dim=1)  # [R, 2r, d]
        sc_win = torch.cat([sc_a, rows[:, :, 1, d:]], dim=1)
    else:
        kv_win, sc_win = rows[:, :, 0].to(kv.dtype), rows[:, :, 1]
    weights = sc_win.softmax(dim=1, dtype=torch.float32).to(kv_win.dtype)
    pooled = comp.norm((kv_win * weights).sum(dim=1))
    cos, sin = meta.cos_sin(rotary, w * r, pooled.dtype, ("win", r))
    entry = apply_rope(pooled, cos, sin)
    per = store.entries.shape[1]
    table = meta.tables[store.group]
    blk, sub = _row_blocks(table, w // per), w % per
    closes = ((pos + 1) % r == 0)[:, None]
    store.entries[blk, sub] = torch.where(closes, entry.to(store.entries.dtype), store.entries[blk, sub])
    if store.tail is not None:  # a block ends with this token: save its last window's Ca rows
        last = ring[slot[:, None], (pos[:, None] - r + 1 + torch.arange(r, device=x.device)[None, :]) % ring_len]
        tblk = _row_blocks(table, pos // block_size)
        ends = ((pos + 1) % block_size == 0)[:, None, None, None]
        store.tail[tblk] = torch.where(ends, last[..., :d], store.tail[tblk])


def attention_decode(attn: torch.nn.Module, x: torch.Tensor, ctx: Any) -> torch.Tensor:
    """``Attention.forward`` for a pure-decode batch: x [R, hidden] -> [R, hidden]."""
    meta: DecodeMeta = ctx.batch.decode
    cfg, cache, pos = attn.cfg, ctx.cache, meta.positions
    rotary = ctx.rotary_compress if attn.ratio else ctx.rotary_main
    cos, sin = meta.cos_sin(rotary, pos, x.dtype, "pos")
    q_res = attn.q_norm(attn.wq_a(x))
    q = unweighted_rms_norm(attn.wq_b(q_res).view(-1, attn.n_heads, attn.head_dim), cfg.rms_norm_eps)
    q = apply_rope(q, cos, sin)
    kv = apply_rope(attn.kv_norm(attn.wkv(x)), cos, sin)
    bs = cache.block_size
    swa = cache.swa[attn.cache_id]
    swa[_row_blocks(meta.tables[GROUP_SWA], pos // bs), pos % bs] = kv.to(swa.dtype)
    kv_store, index_store = attn._stores(cache)
    comp_pool = comp_table = topk = None
    max_keys = attn.window
    if attn.compressor is not None:
        compressor_decode(attn.compressor, x, meta, kv_store, ctx.rotary_compress, bs)
        comp_pool, comp_table = kv_store.entries, meta.tables32[kv_store.group]
        n_cols = meta.width * bs // attn.ratio
        if attn.indexer is not None:
            ix = attn.indexer
            compressor_decode(ix.compressor, x, meta, index_store, ctx.rotary_compress, bs)
            iq = apply_rope(ix.wq_b(q_res).view(-1, ix.n_heads, ix.dim), cos, sin)
            iw = ix.weights_proj(x).float() * ix.n_heads ** -0.5
            topk = meta.ops.indexer_topk(iq, iw, pos, index_store.entries, meta.tables32[GROUP_CSA], attn.ratio,
                                         ix.topk, n_cols)
            max_keys += ix.topk
        else:
            max_keys += n_cols
    o = meta.ops.decode_attention(q, pos, swa, meta.tables32[GROUP_SWA], attn.window, attn.attn_sink,
                                  comp_pool, comp_table, attn.ratio if comp_pool is not None else 0, topk,
                                  max_keys=max_keys).to(q.dtype)
    o = apply_rope(o, cos, -sin)
    return attn.wo_b(attn.wo_a(o.reshape(o.shape[0], cfg.o_groups, -1)))


__all__ = ["DecodeMeta", "GROUP_CSA", "GROUP_HCA", "attention_decode", "compressor_decode", "kernel_ops"]
