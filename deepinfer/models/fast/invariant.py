"""Batch-invariant mode on the compiled executor: which launches change, and why.

In batch-invariant mode (``deepinfer.batch_invariant``) a token's hidden states, logits
and log-probs must not depend on what else shares its step. Through the compiled
executor a token can land in a graphed decode step of any bucket, or in a prefill /
mixed step of any size, so every row must come out of the same instructions in the
same order in all of them. :func:`invariant_ops` turns a fast-path op namespace into the
mode's (``ops.invariant`` is then True and the code of ``fast/`` takes these branches):

* every GEMM through ``invariant_ops.linear`` (the "linear" kernel: one tiling per dtype
  and width, never from the row count) instead of cuBLAS / the skinny GEMMs;
* mHC with one launch shape for every step size (:data:`INVARIANT_MHC`: the row mix
  kernel, or the IEEE dot kernel at one split, never the tensor-core variant that
  large steps take), every row reduced the same way in the finish kernel;
* decode attention with at least two KV splits, so every row goes through the split
  merge (splits are fixed 256-key ranges; an empty one adds exact zeros), whether its
  step's table width gives it one split or several; prefill / mixed steps use the same
  kernel per row (V4: ``models/v4/fast/invariant_prefill.py``), and the same indexer scores + stable top-k;
* compressed entries pooled by one kernel for both step kinds
  (``deepinfer_kernels.batch_invariant_compressor``): :func:`compress_decode` runs the
  decode compressor (ring, tail) and re-pools the closing windows from the ring;
* the MoE's expert GEMMs at one tiling with the combine in ascending expert id
  (``batch_invariant_moe.routed_experts``), the router kernel per row.

Norms, RoPE, the router and argmax / log-sum-exp are per-row kernels whose launch shape
depends on the widths only, so they serve the mode unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["INVARIANT_MHC", "invariant_ops", "is_invariant", "compress_decode", "decode_pool_plan"]


def _invariant_mhc():
    from deepinfer_kernels.mhc import MhcTuning

    never = 1 << 62  # no step size switches kernels
    return dataclasses.replace(MhcTuning(), rows_max_t=never, small_work=never, tc_min_t=never)


#: The mHC launch shape of the mode (built on first use: Triton loads with the kernels).
INVARIANT_MHC: Any = None


def is_invariant(ops: Any) -> bool:
    """Whether ``ops`` is a batch-invariant namespace from :func:`invariant_ops`."""
    return bool(getattr(ops, "invariant", False))


def _merged_attention(fn: Any) -> Any:
    """``decode_attention`` that always splits the keys at least twice: the merge kernel's
    arithmetic for every row, whatever the step's table width (``max_keys``)."""

    @functools.wraps(fn)
    def attention(*args: Any, max_keys: int, kv_chunk: int = 256, **kwargs: Any) -> torch.Tensor:
        return fn(*args, max_keys=max(int(max_keys), kv_chunk + 1), kv_chunk=kv_chunk, **kwargs)

    return attention


def invariant_ops(ops: Any) -> SimpleNamespace:
    """The batch-invariant version of a fast-path op namespace (``kernel_ops`` /
    ``prefill_ops``), built once per namespace; an invariant namespace is returned as is."""
    global INVARIANT_MHC
    if is_invariant(ops):
        return ops
    cached = getattr(ops, "_invariant_ops", None)
    if cached is not None:
        return cached
    from deepinfer_kernels import batch_invariant_compressor as bic

    inv = SimpleNamespace(**{k: v for k, v in vars(ops).items() if not k.startswith("_")})
    inv.invariant = True
    inv.decode_attention = _merged_attention(ops.decode_attention)
    if ops.kind == "triton":
        if INVARIANT_MHC is None:
            INVARIANT_MHC = _invariant_mhc()
        for name in ("hc_pre", "hc_post_pre", "hc_head", "hc_shifted"):  # hc_shifted: V4.1's site
            setattr(inv, name, functools.partial(getattr(ops, name), tuning=INVARIANT_MHC))
        inv.pool_windows = bic.pool_windows
    else:
        inv.pool_windows = bic.pool_windows_ref
    ops._invariant_ops = inv
    return inv


def decode_pool_plan(positions: torch.Tensor, slots: torch.Tensor, table: torch.Tensor, ratio: int, overlap: bool,
                     ring_len: int, per_block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(idx [R, NWIN] ring rows, win_pos [R], dest [R]) of every decode row's window: the
    ring rows ``slot * ring_len + q % ring_len`` of positions q from the window's first
    (the previous window's for an overlapping compressor; -1 before position 0), its
    first position, and its entry row in the paged pool (-1 unless the row closes it).
    Device ops only (graph-safe)."""
    pos, slot = positions.long(), slots.long()
    w = pos // ratio
    first = w * ratio - (ratio if overlap else 0)
    q = first[:, None] + torch.arange((2 if overlap else 1) * ratio, device=pos.device)[None, :]
    idx = torch.where(q >= 0, slot[:, None] * ring_len + q % ring_len, -1)
    blk = table.long().gather(1, (w // per_block)[:, None])[:, 0]
    dest = torch.where((pos + 1) % ratio == 0, blk * per_block + w % per_block, -1)
    return idx, w * ratio, dest


def compress_decode(ops: Any, comp: torch.nn.Module, kv: torch.Tensor, score: torch.Tensor, meta: Any, store: Any,
                    inv_freq: torch.Tensor, block_size: int) -> None:
    """One compressor for a decode step of one row per request in the mode: the decode
    kernel writes the ring row, the tail and its entry, then the closing windows' entries
    are re-pooled from the ring by the kernel prefill steps use (same bits in both)."""
    ops.compressor_decode(kv, score, comp.ape, meta.positions, meta.slots, store.ring, store.entries,
                          meta.tables32[store.group], store.tail, comp.norm.weight, comp.norm.eps, inv_freq,
                          comp.ratio, comp.overlap, block_size)
    ring = store.ring
    idx, win_pos, dest = decode_pool_plan(meta.positions, meta.slots, meta.tables32[store.group], comp.ratio,
                                          comp.overlap, ring.shape[1], store.entries.shape[1])
    ops.pool_windows(ring.view(-1, 2, ring.shape[-1]), idx, win_pos, dest, store.entries, comp.norm.weight,
                     comp.norm.eps, inv_freq, comp.ratio, comp.overlap, kv.dtype)
