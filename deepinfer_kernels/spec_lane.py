"""The bookkeeping of a greedy speculative step inside its verify graph, one launch each:

* :func:`feed_placeholders`: rows planned ahead read their id from the device token
  buffer and add their slot's position shift (``DeviceTokenBuffer.fill`` on the device);
* :func:`greedy_verify`: per request group, the first row whose argmax is not the next
  draft (greedy verification), written after the rows' packed (argmax, log-prob bits);
* :func:`mtp_tail_record`: per group, the accepted drafts, the row the MTP stage's first
  draft is read at, and the record a plan made ahead reads (bonus token, first draft,
  shift) scattered into the token buffer.

Why kernels: as torch ops these are dozens of tiny launches (arange, searchsorted, roll,
where, scatter_reduce, cat, gathers, index_put) beside a few hundred of model work in a
batch-1 speculative step, whose time is launches, not bytes (counts: the session note).
The ``*_ref`` functions are the torch definitions (CPU, and the tests' oracle).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device


@triton.jit(do_not_specialize=["n", "width"])
def _feed_kernel(last_ptr, shift_ptr, ids_ptr, pos_ptr, src_ptr, fed_ptr, pos_out_ptr, row_shift_ptr, n, width,
                 BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n
    src = tl.load(src_ptr + rows, mask=ok, other=-1)
    given = src >= 0
    at = tl.maximum(src, 0).to(tl.int64)
    ids = tl.load(ids_ptr + rows, mask=ok, other=0).to(tl.int64)
    tok = tl.load(last_ptr + at, mask=ok & given, other=0).to(tl.int64)
    sh = tl.load(shift_ptr + at // width, mask=ok & given, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + rows, mask=ok, other=0)
    tl.store(fed_ptr + rows, tl.where(given, tok, ids).to(fed_ptr.dtype.element_ty), mask=ok)
    tl.store(pos_out_ptr + rows, (pos + sh).to(pos_out_ptr.dtype.element_ty), mask=ok)
    tl.store(row_shift_ptr + rows, sh, mask=ok)


def feed_placeholders(last: torch.Tensor, shift: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                      src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows with ``src >= 0`` (flat indices into ``last`` [slots, width]) take their id from
    there and add their slot's ``shift`` to their position; other rows keep theirs. Returns
    (ids like ``ids``, positions like ``positions``, row shifts [R] int64, 0 where not given)."""
    check_device(last, shift, ids, positions, src)
    n = ids.shape[0]
    fed, pos = torch.empty_like(ids), torch.empty_like(positions)
    row_shift = torch.empty(n, dtype=torch.int64, device=ids.device)
    if n:
        _feed_kernel[(triton.cdiv(n, 256),)](last.contiguous(), shift, ids, positions, src, fed, pos, row_shift, n,
                                             last.shape[1], BLOCK=256, num_warps=4)
    return fed, pos, row_shift


def feed_placeholders_ref(last: torch.Tensor, shift: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                          src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`feed_placeholders`."""
    given = src >= 0
    at = src.clamp(min=0).long()
    fed = torch.where(given, last.reshape(-1)[at], ids.long()).to(ids.dtype)
    row_shift = torch.where(given, shift[at // last.shape[1]], 0)
    return fed, positions + row_shift.to(positions.dtype), row_shift


@triton.jit(do_not_specialize=["r"])
def _greedy_verify_kernel(ids_ptr, packed_ptr, starts_ptr, out_ptr, r, COPY: tl.constexpr):
    g = tl.program_id(0)  # groups 0..r: group 0 starts at row 0, group r holds rows >= starts[r]
    begin = tl.where(g == 0, 0, tl.load(starts_ptr + g)).to(tl.int32)
    end = tl.load(starts_ptr + tl.minimum(g + 1, r)).to(tl.int32)
    end = tl.where(g == r, r, end)
    if COPY:
        if g < r:
            tl.store(out_ptr + 2 * g, tl.load(packed_ptr + 2 * g))
            tl.store(out_ptr + 2 * g + 1, tl.load(packed_ptr + 2 * g + 1))
    first = begin.to(tl.int64) * 0 + r  # an empty group keeps r
    stopped = begin * 0
    for j in range(begin, end):
        nxt = tl.load(ids_ptr + tl.minimum(j + 1, r - 1)).to(tl.int64)
        match = ((j + 1 < end) & (nxt == tl.load(packed_ptr + 2 * j))).to(tl.int32)
        hit = (stopped == 0) & (match == 0)
        first = tl.where(hit, first * 0 + j, first)
        stopped = tl.where(hit, 1, stopped)
    tl.store(out_ptr + 2 * r + g, first)


def greedy_verify(ids: torch.Tensor, packed: torch.Tensor, starts: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy verification: ``ids`` [R] the step's input tokens (per request its last token,
    then its drafts), ``packed`` [R, 2] int64 each row's (argmax, log-prob bits), ``starts``
    [R + 1] int32 the request groups (group g is rows [starts[g], starts[g + 1]); empty
    groups repeat R). Returns int64 [3R + 1]: ``packed`` flattened, then per group the first
    row whose argmax is not the next draft (its last row when every draft matches; R when
    empty). ``out``: the result tensor; when ``packed`` is a view of its head, not copied."""
    check_device(ids, packed, starts)
    r = ids.shape[0]
    if out is None:
        out = torch.empty(3 * r + 1, dtype=torch.int64, device=ids.device)
    if out.shape != (3 * r + 1,) or out.dtype != torch.int64 or packed.shape != (r, 2) or not packed.is_contiguous():
        raise ValueError(f"greedy_verify: out must be int64 [{3 * r + 1}] and packed contiguous int64 [{r}, 2], got "
                         f"{out.dtype} {tuple(out.shape)} / {packed.dtype} {tuple(packed.shape)}")
    copy = packed.data_ptr() != out.data_ptr()
    if r:
        _greedy_verify_kernel[(r + 1,)](ids, packed, starts, out, r, COPY=copy, num_warps=1)
    else:
        out.fill_(0)
    return out


def greedy_verify_ref(ids: torch.Tensor, packed: torch.Tensor, starts: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`greedy_verify` (fixed shapes, no host sync: graph-safe)."""
    r = ids.shape[0]
    row = torch.arange(r, device=ids.device, dtype=starts.dtype)
    group = torch.searchsorted(starts[1:].contiguous(), row, right=True)
    same_next = torch.zeros(r, dtype=torch.bool, device=ids.device)
    same_next[:-1] = group[1:] == group[:-1]
    match = same_next & (ids.roll(-1).long() == packed[:, 0])
    stop_row = torch.where(match, torch.full_like(row, r), row).long()
    first = torch.full((r + 1,), r, dtype=torch.int64, device=ids.device)
    first = first.scatter_reduce(0, group.long(), stop_row, reduce="amin", include_self=True)
    result = torch.cat([packed.reshape(-1), first])
    if out is None:
        return result
    return out.copy_(result)


@triton.jit(do_not_specialize=["r"])
def _tail_kernel(starts_ptr, slots_ptr, greedy_ptr, packed_ptr, stage_ptr, n_groups_ptr, row_shift_ptr,
                 last_ptr, last_stride, shift_ptr, spare, draft_ptr, at_ptr, acc_ptr, acc_shift_ptr, r):
    g = tl.program_id(0)
    start = tl.load(starts_ptr + g).to(tl.int64)
    nd = tl.maximum(tl.load(starts_ptr + g + 1).to(tl.int64) - start - 1, 0)
    acc = tl.maximum(tl.minimum(tl.load(greedy_ptr + 2 * r + g) - start, nd), 0)
    at = tl.minimum(start + acc, r - 1)
    first_row = tl.minimum(start, r - 1)
    tok = tl.load(stage_ptr + 2 * at)
    tl.store(draft_ptr + 2 * g, tok)
    tl.store(draft_ptr + 2 * g + 1, tl.load(stage_ptr + 2 * at + 1))
    tl.store(at_ptr + g, at)
    tl.store(acc_ptr + g, acc)
    tl.store(acc_shift_ptr + g, acc + tl.load(row_shift_ptr + first_row))
    real = g < tl.load(n_groups_ptr)
    dest = tl.where(real, tl.load(slots_ptr + first_row).to(tl.int64), spare)
    tl.store(last_ptr + dest * last_stride, tl.load(packed_ptr + 2 * at).to(last_ptr.dtype.element_ty))
    tl.store(last_ptr + dest * last_stride + 1, tok.to(last_ptr.dtype.element_ty))
    tl.store(shift_ptr + dest, (acc - nd).to(shift_ptr.dtype.element_ty))


def mtp_tail_record(starts: torch.Tensor, slots: torch.Tensor, greedy: torch.Tensor, packed: torch.Tensor,
                    stage_packed: torch.Tensor, n_groups: torch.Tensor, row_shift: torch.Tensor,
                    last: torch.Tensor, shift: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group g < R of a k = 1 MTP verify step (``starts`` [R + 1], ``slots`` [R] the rows'
    state slots, ``greedy`` :func:`greedy_verify`'s result, ``packed`` [R, 2] int64 every
    row's (argmax, log-prob bits), ``stage_packed`` [R, 2] the MTP stage's (draft, log-prob bits) per row,
    ``n_groups`` [1] the real groups, ``row_shift`` [R] int64): its accepted drafts, the row
    ``at`` its first draft is read at, and the record ``last[slot] = (packed[at, 0], draft)``,
    ``shift[slot] = accepted - drafts`` (padded groups write the spare last row). Returns
    (draft packed [R, 2], at [R], accepted [R], accepted + the group's row shift [R]), int64."""
    check_device(starts, slots, greedy, packed, stage_packed, n_groups, row_shift, last, shift)
    r = packed.shape[0]
    if last.stride(1) != 1 or not packed.is_contiguous() or not stage_packed.is_contiguous():
        raise ValueError("mtp_tail_record: last needs contiguous rows; packed and stage_packed must be contiguous")
    dev = packed.device
    draft = torch.empty(r, 2, dtype=torch.int64, device=dev)
    at, acc, acc_shift = (torch.empty(r, dtype=torch.int64, device=dev) for _ in range(3))
    if r:
        _tail_kernel[(r,)](starts, slots, greedy, packed, stage_packed, n_groups, row_shift, last, last.stride(0),
                           shift, last.shape[0] - 1, draft, at, acc, acc_shift, r, num_warps=1)
    return draft, at, acc, acc_shift


def lane_groups_ref(starts: torch.Tensor, greedy: torch.Tensor, r: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group g < r of a greedy verify step (``starts`` [r + 1], ``greedy``
    :func:`greedy_verify`'s result): (drafts, accepted drafts, first row clamped to the
    step, the row its bonus token is read at), int64 [r] each (graph-safe)."""
    first = starts[:r].long()
    num_drafts = (starts[1:r + 1].long() - first - 1).clamp(min=0)
    accepted = torch.minimum(greedy[2 * r: 3 * r] - first, num_drafts).clamp(min=0)
    first_row = first.clamp(max=r - 1)
    return num_drafts, accepted, first_row, (first_row + accepted).clamp(max=r - 1)


def mtp_tail_record_ref(starts: torch.Tensor, slots: torch.Tensor, greedy: torch.Tensor, packed: torch.Tensor,
                        stage_packed: torch.Tensor, n_groups: torch.Tensor, row_shift: torch.Tensor,
                        last: torch.Tensor, shift: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`mtp_tail_record` (graph-safe)."""
    r = packed.shape[0]
    num_drafts, accepted, first_row, at = lane_groups_ref(starts, greedy, r)
    draft = stage_packed[at]
    group = torch.arange(r, device=packed.device)
    dest = torch.where(group < n_groups.long(), slots[first_row].long(), torch.full_like(group, last.shape[0] - 1))
    last[dest, 0] = packed[at, 0].to(last.dtype)
    last[dest, 1] = draft[:, 0].to(last.dtype)
    shift[dest] = (accepted - num_drafts).to(shift.dtype)
    return draft, at, accepted, accepted + row_shift[first_row]


__all__ = ["feed_placeholders", "feed_placeholders_ref", "greedy_verify", "greedy_verify_ref", "lane_groups_ref",
           "mtp_tail_record", "mtp_tail_record_ref"]
