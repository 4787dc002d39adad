"""The bookkeeping of DSpark's work inside a greedy verify graph (`spec/dspark_verify_tail.py`)
in one launch: every verify row's window-pool row, each group's record for a plan made
ahead, and the next draft blocks' input rows.

For a verify step of R rows (``starts`` [R + 1] its groups, ``greedy`` the greedy
verification: ``greedy[2R + g]`` group g's first rejected row) and S staged draft rows:

* row i < R: ``rows[:, i] = (p, table[i, p // B] * B + p % B)`` (p its position, B the
  pool's rows per block): where its features go, as the target's attention reads its window;
* group g < R: accepted ``a = clamp(min(first - start, drafts), 0)``, the bonus token
  ``packed[at, 0]`` with ``at = min(start + a, R - 1)``, recorded as ``last[slot, 0]`` and
  ``shift[slot] = a - drafts`` (``slot``: its first row's state slot; padded groups, g >=
  ``n_groups``, write the spare last row);
* draft row s < S (group ``min(s, R - 1)``): ``[bonus, p_last, 0, 1, bits(1.0)]`` then the
  pool rows of positions ``p_last + 2 - W + j`` (j < W - 1; 0 below position 0), with
  ``p_last`` the position of the group's first row + a: the input row of
  ``DSparkDrafter``'s draft graphs (`models/fast/draft_dspark.py` ``INPUT_COLUMNS``), and
  ``dest[s]`` the slot its drafts are recorded at (spare for s >= ``n_groups``).

Why a kernel: as torch ops this is about thirty tiny launches (gathers, clamps, wheres,
index_puts) inside every batch-1 verify graph, whose time is launches, not bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, next_pow2
from .spec_lane import lane_groups_ref

#: float32 bits of temperature 1.0 (a greedy draft row's)
ONE_BITS = 0x3F800000
#: a draft row's columns before its window's pool rows: token, position, seed, greedy,
#: temperature bits (``deepinfer/models/fast/draft_dspark.py`` INPUT_COLUMNS)
N_COLS = 5


@triton.jit
def _group(starts_ptr, greedy_ptr, g, r):
    start = tl.load(starts_ptr + g).to(tl.int64)
    nd = tl.maximum(tl.load(starts_ptr + g + 1).to(tl.int64) - start - 1, 0)
    acc = tl.maximum(tl.minimum(tl.load(greedy_ptr + 2 * r + g) - start, nd), 0)
    first_row = tl.minimum(start, r - 1)
    at = tl.minimum(first_row + acc, r - 1)
    return nd, acc, first_row, at


@triton.jit(do_not_specialize=["r", "s_rows", "width"])
def _tail_stage_kernel(starts_ptr, slots_ptr, pos_ptr, table_ptr, greedy_ptr, packed_ptr, n_groups_ptr,
                       last_ptr, last_stride, shift_ptr, spare, staged_ptr, dest_ptr, pool_rows_ptr,
                       r, s_rows, width, window, bs, COLS: tl.constexpr, N_COLS: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    i = tl.program_id(0)
    n_groups = tl.load(n_groups_ptr).to(tl.int64)
    if i < r:
        p = tl.load(pos_ptr + i).to(tl.int64)
        blk = tl.load(table_ptr + i * width + p // bs).to(tl.int64)
        tl.store(pool_rows_ptr + i, p)
        tl.store(pool_rows_ptr + r + i, blk * bs + p % bs)
        nd, acc, first_row, at = _group(starts_ptr, greedy_ptr, i, r)
        dest = tl.where(i < n_groups, tl.load(slots_ptr + first_row).to(tl.int64), spare)
        tl.store(last_ptr + dest * last_stride, tl.load(packed_ptr + 2 * at).to(last_ptr.dtype.element_ty))
        tl.store(shift_ptr + dest, (acc - nd).to(shift_ptr.dtype.element_ty))
    if i < s_rows:
        src = tl.minimum(i, r - 1)
        nd, acc, first_row, at = _group(starts_ptr, greedy_ptr, src, r)
        dest = tl.where(i < n_groups, tl.load(slots_ptr + first_row).to(tl.int64), spare)
        tl.store(dest_ptr + i, dest)
        p_last = tl.load(pos_ptr + first_row).to(tl.int64) + acc
        row = staged_ptr + i.to(tl.int64) * COLS
        tl.store(row, tl.load(packed_ptr + 2 * at))
        tl.store(row + 1, p_last)
        tl.store(row + 2, 0)
        tl.store(row + 3, 1)
        tl.store(row + 4, ONE_BITS)
        for c0 in range(0, window - 1, BLOCK_C):
            j = c0 + tl.arange(0, BLOCK_C)
            live = j < window - 1
            q = p_last + 2 - window + j
            qc = tl.maximum(q, 0)
            blk = tl.load(table_ptr + first_row * width + qc // bs, mask=live, other=0).to(tl.int64)
            tl.store(row + N_COLS + j, tl.where(q >= 0, blk * bs + qc % bs, 0), mask=live)


def _check(starts, slots, positions, table, greedy, packed, staged, dest, window: int) -> None:
    r = packed.shape[0]
    if starts.shape != (r + 1,) or slots.shape != (r,) or positions.shape != (r,) or table.shape[0] != r:
        raise ValueError(f"dspark_tail_stage: starts {tuple(starts.shape)} / slots / positions / table rows must "
                         f"fit {r} verify rows")
    if greedy.shape != (3 * r + 1,) or packed.shape != (r, 2):
        raise ValueError(f"dspark_tail_stage: greedy [{3 * r + 1}] and packed [{r}, 2], got "
                         f"{tuple(greedy.shape)} / {tuple(packed.shape)}")
    if staged.dim() != 2 or staged.shape[1] != N_COLS + window - 1 or dest.shape != (staged.shape[0],):
        raise ValueError(f"dspark_tail_stage: staged [S, {N_COLS + window - 1}] and dest [S], got "
                         f"{tuple(staged.shape)} / {tuple(dest.shape)}")


def dspark_tail_stage(starts: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, table: torch.Tensor,
                      greedy: torch.Tensor, packed: torch.Tensor, n_groups: torch.Tensor, last: torch.Tensor,
                      shift: torch.Tensor, staged: torch.Tensor, dest: torch.Tensor, window: int,
                      block_size: int) -> torch.Tensor:
    """See the module doc. starts / slots / positions / table int32 (the step's inputs),
    greedy [3R + 1] and packed [R, 2] int64 (the lane's), n_groups [1]; writes ``last``,
    ``shift``, ``staged`` [S, N_COLS + W - 1] and ``dest`` [S] (int64) in place. Returns
    every verify row's (position, pool row) [2, R] int64."""
    check_device(starts, slots, positions, table, greedy, packed, n_groups, last, shift, staged, dest)
    _check(starts, slots, positions, table, greedy, packed, staged, dest, window)
    if last.stride(1) != 1 or not staged.is_contiguous() or not table.is_contiguous():
        raise ValueError("dspark_tail_stage: last needs contiguous rows; staged and table must be contiguous")
    r, s = packed.shape[0], staged.shape[0]
    pool_rows = torch.empty(2, r, dtype=torch.int64, device=packed.device)
    if r:
        _tail_stage_kernel[(max(r, s),)](
            starts, slots, positions, table, greedy, packed, n_groups, last, last.stride(0), shift,
            last.shape[0] - 1, staged, dest, pool_rows, r, s, table.shape[1], window, block_size,
            COLS=staged.shape[1], N_COLS=N_COLS, BLOCK_C=min(256, next_pow2(max(1, window - 1))), num_warps=1)
    return pool_rows


def dspark_tail_stage_ref(starts: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, table: torch.Tensor,
                          greedy: torch.Tensor, packed: torch.Tensor, n_groups: torch.Tensor, last: torch.Tensor,
                          shift: torch.Tensor, staged: torch.Tensor, dest: torch.Tensor, window: int,
                          block_size: int) -> torch.Tensor:
    """Torch reference of :func:`dspark_tail_stage` (graph-safe: no host reads)."""
    _check(starts, slots, positions, table, greedy, packed, staged, dest, window)
    r, dev, bs = packed.shape[0], packed.device, block_size
    if r == 0:
        return torch.empty(2, 0, dtype=torch.int64, device=dev)
    pos, tab = positions.long(), table.long()
    pool_rows = tab.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
    num_drafts, accepted, first_row, at = lane_groups_ref(starts, greedy, r)
    spare = last.shape[0] - 1
    group = torch.arange(r, device=dev)
    record = torch.where(group < n_groups.long(), slots[first_row].long(), torch.full_like(group, spare))
    last[record, 0] = packed[at, 0].to(last.dtype)
    shift[record] = (accepted - num_drafts).to(shift.dtype)
    g = torch.arange(staged.shape[0], device=dev)
    src = g.clamp(max=r - 1)
    p_last = pos[first_row[src]] + accepted[src]
    ctx = p_last[:, None] + (2 - window) + torch.arange(window - 1, device=dev)
    c = ctx.clamp(min=0)
    ctx_rows = tab[first_row[src]].gather(1, c // bs) * bs + c % bs
    staged[:, 0] = packed[at[src], 0]
    staged[:, 1] = p_last
    staged[:, 2], staged[:, 3], staged[:, 4] = 0, 1, ONE_BITS
    staged[:, N_COLS:] = torch.where(ctx >= 0, ctx_rows, torch.zeros_like(ctx_rows))
    dest.copy_(torch.where(g < n_groups.long(), slots[first_row[src]].long(), torch.full_like(g, spare)))
    return torch.stack([pos, pool_rows])


__all__ = ["N_COLS", "ONE_BITS", "dspark_tail_stage", "dspark_tail_stage_ref"]
