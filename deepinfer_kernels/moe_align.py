"""Token sort / align by expert for the fused MoE, entirely on the device.

Input: expert ids [T, k] (int32). Flat slot ``i = t * k + j``. Output (fixed-size
buffers, so nothing is read back on the host and the step can be graph-captured):

* ``sorted_ids`` [max_padded]: flat slots grouped by expert, each expert's group
  padded to a multiple of ``block_m`` with the sentinel ``T * k``; inside a group the
  slots are in increasing order (the sort is stable, so the layout is deterministic);
* ``block_expert`` [max_blocks]: the expert of every ``block_m`` rows, -1 past the end;
* ``expert_start`` [E + 1]: padded start offset of each expert's group (last = total).

An id outside [0, E) (e.g. an expert that lives on another rank) is skipped.
Three launches: per-chunk histograms; one program that scans them into offsets and
writes the block -> expert map; a scatter of every slot to its place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import check_device, next_pow2


@triton.jit(do_not_specialize=["N"])
def _count_kernel(ids_ptr, counts_ptr, N, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    c = tl.program_id(0)
    i = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + i, mask=i < N, other=-1)
    experts = tl.arange(0, BLOCK_E)
    hot = (ids[:, None] == experts[None, :]).to(tl.int32)
    tl.store(counts_ptr + c * BLOCK_E + experts, tl.sum(hot, axis=0))


@triton.jit(do_not_specialize=["n_chunks", "max_blocks"])
def _offsets_kernel(counts_ptr, prefix_ptr, start_ptr, block_expert_ptr, n_chunks, E, max_blocks,
                    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr,
                    BLOCK_B: tl.constexpr):
    experts = tl.arange(0, BLOCK_E)
    running = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, n_chunks, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        m = cs[:, None] < n_chunks
        tile = tl.load(counts_ptr + cs[:, None] * BLOCK_E + experts[None, :], mask=m, other=0)
        incl = tl.cumsum(tile, axis=0)
        tl.store(prefix_ptr + cs[:, None] * BLOCK_E + experts[None, :], incl - tile + running[None, :], mask=m)
        running += tl.sum(tile, axis=0)
    padded = tl.where(experts < E, (running + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    end = tl.cumsum(padded, axis=0)
    tl.store(start_ptr + experts, end - padded, mask=experts < E)
    tl.store(start_ptr + E, tl.sum(padded, axis=0))
    end = tl.where(experts < E, end, 2147483647)
    for b0 in range(0, max_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        e = tl.sum((end[None, :] <= b[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(e < E, e, -1), mask=b < max_blocks)


@triton.jit(do_not_specialize=["N"])
def _scatter_kernel(ids_ptr, prefix_ptr, start_ptr, sorted_ptr, N, E,
                    CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    c = tl.program_id(0)
    i = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + i, mask=i < N, other=-1)
    experts = tl.arange(0, BLOCK_E)
    hot = (ids[:, None] == experts[None, :]).to(tl.int32)
    rank = tl.sum(tl.where(hot != 0, tl.cumsum(hot, axis=0) - hot, 0), axis=1)
    ok = (i < N) & (ids >= 0) & (ids < E)
    safe = tl.where(ok, ids, 0)
    base = tl.load(start_ptr + safe, mask=ok, other=0) + tl.load(prefix_ptr + c * BLOCK_E + safe, mask=ok, other=0)
    tl.store(sorted_ptr + base + rank, i, mask=ok)


@dataclass
class MoEAlignment:
    """Device buffers describing the expert-sorted row layout (see module doc)."""

    sorted_ids: torch.Tensor  # [max_padded] int32, sentinel = num_slots
    block_expert: torch.Tensor  # [max_blocks] int32, -1 = no work
    expert_start: torch.Tensor  # [E + 1] int32
    block_m: int
    num_slots: int  # T * k

    @property
    def max_blocks(self) -> int:
        return self.block_expert.numel()


def moe_align(topk_ids: torch.Tensor, n_experts: int, block_m: int) -> MoEAlignment:
    """Group the flat (token, slot) pairs of `topk_ids` [T, k] by expert (see module doc)."""
    check_device(topk_ids)
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    n, dev = ids.numel(), ids.device
    max_blocks = n // block_m + min(n_experts, n) + 1
    block_e = next_pow2(n_experts)
    chunk = max(16, min(64, 8192 // block_e))  # one [chunk, E] one-hot tile in registers
    n_chunks = max(1, triton.cdiv(n, chunk))
    counts = torch.empty(n_chunks, block_e, dtype=torch.int32, device=dev)
    prefix = torch.empty_like(counts)
    start = torch.empty(n_experts + 1, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    sorted_ids = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=dev)
    _count_kernel[(n_chunks,)](ids, counts, n, n_experts, CHUNK=chunk, BLOCK_E=block_e, num_warps=4)
    _offsets_kernel[(1,)](counts, prefix, start, block_expert, n_chunks, n_experts, max_blocks,
                          BLOCK_M=block_m, BLOCK_C=max(1, min(32, 8192 // block_e)), BLOCK_E=block_e,
                          BLOCK_B=max(1, min(64, 8192 // block_e)), num_warps=4)
    _scatter_kernel[(n_chunks,)](ids, prefix, start, sorted_ids, n, n_experts, CHUNK=chunk, BLOCK_E=block_e,
                                 num_warps=4)
    return MoEAlignment(sorted_ids, block_expert, start, block_m, n)


def moe_align_ref(topk_ids: torch.Tensor, n_experts: int, block_m: int) -> MoEAlignment:
    """Torch reference of :func:`moe_align` (same buffers, same layout)."""
    ids = topk_ids.reshape(-1).long()
    n = ids.numel()
    max_blocks = n // block_m + min(n_experts, n) + 1
    ok = (ids >= 0) & (ids < n_experts)
    counts = torch.bincount(ids[ok], minlength=n_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.zeros(n_experts + 1, dtype=torch.long)
    start[1:] = padded.cumsum(0)
    sorted_ids = torch.full((max_blocks * block_m,), n, dtype=torch.int32)
    block_expert = torch.full((max_blocks,), -1, dtype=torch.int32)
    for e in range(n_experts):
        slots = torch.nonzero(ids == e).flatten()
        sorted_ids[int(start[e]):int(start[e]) + slots.numel()] = slots.to(torch.int32)
        block_expert[int(start[e]) // block_m:int(start[e + 1]) // block_m] = e
    return MoEAlignment(sorted_ids.to(topk_ids.device), block_expert.to(topk_ids.device),
                        start.to(torch.int32).to(topk_ids.device), block_m, n)
