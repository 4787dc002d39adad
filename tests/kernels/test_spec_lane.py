"""The greedy speculative step's in-graph bookkeeping kernels (deepinfer_kernels/spec_lane.py)
vs their torch definitions, on fresh random steps (interpreter on CPU)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, gen  # noqa: E402

from deepinfer_kernels.spec_lane import (feed_placeholders, feed_placeholders_ref, greedy_verify,  # noqa: E402
                                         greedy_verify_ref, mtp_tail_record, mtp_tail_record_ref)


def _step(g: torch.Generator, groups: int, k: int, pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verify step: ``groups`` requests of 1..k+1 rows each, then ``pad`` padded rows of a
    group each; ids whose drafts match the previous row's argmax about half the time."""
    sizes = torch.randint(1, k + 2, (groups,), generator=g).tolist() + [1] * pad
    r = sum(sizes)
    starts = torch.full((r + 1,), r, dtype=torch.int32)
    starts[:len(sizes)] = torch.tensor([0] + sizes[:-1]).cumsum(0).to(torch.int32)
    argmax = torch.randint(0, 50, (r,), generator=g)
    ids = torch.randint(0, 50, (r,), generator=g)
    take = torch.rand(r, generator=g) < 0.6
    ids[1:] = torch.where(take[1:], argmax[:-1], ids[1:])  # a draft equal to the previous row's argmax
    bits = torch.randint(-(2 ** 31), 2 ** 31 - 1, (r,), generator=g)
    return ids.to(torch.int32), torch.stack([argmax, bits], 1), starts


@pytest.mark.parametrize("groups,k,pad", [(1, 1, 0), (3, 1, 2), (5, 4, 0), (7, 3, 9)])
def test_greedy_verify_matches_torch(fresh_seed: int, groups: int, k: int, pad: int) -> None:
    ids, packed, starts = _step(gen(fresh_seed), groups, k, pad)
    ids, packed, starts = ids.to(DEVICE), packed.to(DEVICE), starts.to(DEVICE)
    want = greedy_verify_ref(ids, packed, starts)
    assert torch.equal(greedy_verify(ids, packed, starts), want)
    out = torch.empty_like(want)
    out[:packed.numel()].copy_(packed.reshape(-1))  # packed written in place at the head: no copy
    assert torch.equal(greedy_verify(ids, out[:packed.numel()].view(-1, 2), starts, out=out), want)


@pytest.mark.parametrize("groups,k,pad", [(1, 1, 0), (4, 1, 3), (6, 2, 1)])
def test_mtp_tail_record_matches_torch(fresh_seed: int, groups: int, k: int, pad: int) -> None:
    g = gen(fresh_seed)
    ids, packed, starts = _step(g, groups, k, pad)
    r = ids.shape[0]
    greedy = greedy_verify_ref(ids, packed, starts)
    slots = torch.randperm(r + 4, generator=g)[:r].to(torch.int32)
    stage = torch.stack([torch.randint(0, 50, (r,), generator=g), torch.randint(0, 2 ** 31 - 1, (r,), generator=g)], 1)
    n_groups = torch.tensor([groups], dtype=torch.int32)
    row_shift = -torch.randint(0, 3, (r,), generator=g)
    last0 = torch.randint(0, 50, (r + 5, 3), generator=g)
    shift0 = torch.randint(-3, 1, (r + 5,), generator=g)
    args = [t.to(DEVICE) for t in (starts, slots, greedy, packed, stage, n_groups, row_shift)]
    last_ref, shift_ref = last0.clone().to(DEVICE), shift0.clone().to(DEVICE)
    want = mtp_tail_record_ref(*args, last_ref, shift_ref)
    last, shift = last0.clone().to(DEVICE), shift0.clone().to(DEVICE)
    got = mtp_tail_record(*args, last, shift)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    real = slice(0, last.shape[0] - 1)  # padded groups all write the spare row: any of them may win
    assert torch.equal(last[real], last_ref[real]) and torch.equal(shift[real], shift_ref[real])


def test_feed_placeholders_matches_torch(fresh_seed: int) -> None:
    g = gen(fresh_seed)
    slots, width, r = 6, 4, 11
    last = torch.randint(0, 9000, (slots, width), generator=g).to(DEVICE)
    shift = -torch.randint(0, width, (slots,), generator=g).to(DEVICE)
    ids = torch.randint(0, 9000, (r,), generator=g).to(torch.int32).to(DEVICE)
    positions = torch.randint(10, 500, (r,), generator=g).to(torch.int32).to(DEVICE)
    src = torch.randint(-1, slots * width, (r,), generator=g).to(torch.int32)
    src[torch.rand(r, generator=g) < 0.4] = -1
    src = src.to(DEVICE)
    for a, b in zip(feed_placeholders(last, shift, ids, positions, src),
                    feed_placeholders_ref(last, shift, ids, positions, src)):
        assert a.dtype == b.dtype and torch.equal(a, b)
