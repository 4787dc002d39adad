"""dspark_tail_stage (DSpark's bookkeeping inside a greedy verify graph) vs its torch
reference (interpreter on CPU), on verify steps laid out as the fast path lays them out."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, gen  # noqa: E402

from deepinfer_kernels.dspark_tail import ONE_BITS, dspark_tail_stage, dspark_tail_stage_ref  # noqa: E402

BS, WINDOW, WIDTH = 8, 12, 16  # rows per pool block, sliding window, table width


def _step(seed: int, lens: list[int], rows: int, staged_rows: int):
    """A verify step of len(lens) requests (lens[g] rows each) padded to ``rows``, as
    ``FastPath._host_inputs`` lays it out, with a fresh greedy verification."""
    g = gen(seed)
    n, k = sum(lens), len(lens)
    starts = torch.full((rows + 1,), rows, dtype=torch.int32)
    ends = torch.tensor(lens).cumsum(0)
    starts[:k] = (ends - torch.tensor(lens)).int()
    starts[k:k + rows - n] = torch.arange(n, rows, dtype=torch.int32)
    first_pos = torch.randint(0, 80, (k,), generator=g)
    first_pos[0] = 2  # near the start: context positions below 0
    req = torch.repeat_interleave(torch.arange(k), torch.tensor(lens))
    offsets = torch.arange(n) - torch.repeat_interleave(ends - torch.tensor(lens), torch.tensor(lens))
    pos = torch.empty(rows, dtype=torch.int32)
    pos[:n] = (first_pos[req] + offsets).int()
    pos[n:] = pos[0]
    state = torch.randperm(10, generator=g)[:k].int()
    slots = torch.empty(rows, dtype=torch.int32)
    slots[:n], slots[n:] = state[req], state[0]
    req_tables = torch.randint(0, 50, (k, WIDTH), generator=g, dtype=torch.int32)
    table = torch.empty(rows, WIDTH, dtype=torch.int32)
    table[:n], table[n:] = req_tables[req], req_tables[0]
    packed = torch.randint(0, 1000, (rows, 2), generator=g)
    greedy = torch.empty(3 * rows + 1, dtype=torch.int64)
    greedy[:2 * rows] = packed.reshape(-1)
    # each group's first rejected row: anywhere in the group, or past it (all accepted)
    span = (starts[1:].long() - starts[:-1].long()).clamp(min=1)
    greedy[2 * rows:3 * rows] = starts[:-1].long() + torch.randint(0, 8, (rows,), generator=g) % (span + 1)
    greedy[3 * rows] = rows
    last = torch.randint(0, 5, (11, 6), generator=g)
    shift = torch.randint(-3, 1, (11,), generator=g)
    staged = torch.randint(0, 9, (staged_rows, 5 + WINDOW - 1), generator=g)
    dest = torch.randint(0, 9, (staged_rows,), generator=g)
    n_groups = torch.tensor([k], dtype=torch.int32)
    return [t.to(DEVICE) for t in (starts, slots, pos, table, greedy, packed, n_groups, last, shift, staged, dest)]


@pytest.mark.parametrize("lens,rows,staged_rows", [([6], 8, 4), ([6, 3, 6], 16, 4), ([2, 2], 4, 8), ([1], 1, 2)])
def test_matches_the_reference(fresh_seed: int, lens, rows, staged_rows) -> None:
    """Padded rows, empty groups, more staged rows than verify rows and fewer."""
    args = _step(fresh_seed, lens, rows, staged_rows)
    mine = [t.clone() for t in args]
    ref = [t.clone() for t in args]
    got = dspark_tail_stage(*mine, WINDOW, BS)
    want = dspark_tail_stage_ref(*ref, WINDOW, BS)
    assert torch.equal(got, want)
    for name, a, b in zip(("last", "shift", "staged", "dest"), mine[7:], ref[7:]):
        assert torch.equal(a, b), name


def test_a_block_reads_its_accepted_run(fresh_seed: int) -> None:
    """One request of 6 rows at positions 40..45 with 2 drafts accepted: its block's last token is
    row 2's argmax at position 42, its context the pool rows of positions 31..42, its record
    that bonus and shift 2 - 5; a padded group records into the spare row only."""
    starts, slots, pos, table, greedy, packed, n_groups, last, shift, staged, dest = _step(fresh_seed, [6], 8, 2)
    pos[:6] = torch.arange(40, 46, dtype=torch.int32, device=DEVICE)
    greedy[16] = 2  # group 0 stops at row 2 (its argmax is not draft 3): 2 drafts accepted
    before_last = last.clone()
    pool_rows = dspark_tail_stage(starts, slots, pos, table, greedy, packed, n_groups, last, shift, staged, dest,
                                  WINDOW, BS)
    slot = int(slots[0])
    assert int(last[slot, 0]) == int(packed[2, 0]) and int(shift[slot]) == -3
    assert torch.equal(last[:10][torch.arange(10) != slot], before_last[:10][torch.arange(10) != slot])
    assert staged[0, :5].tolist() == [int(packed[2, 0]), 42, 0, 1, ONE_BITS]
    ctx = torch.arange(42 + 2 - WINDOW, 43)
    want = table[0].long()[ctx // BS] * BS + ctx % BS
    assert torch.equal(staged[0, 5:], want)
    assert int(dest[0]) == slot and int(dest[1]) == last.shape[0] - 1
    assert pool_rows[:, 3].tolist() == [43, int(table[3, 43 // BS]) * BS + 43 % BS]


def test_rejects_bad_shapes() -> None:
    args = _step(0, [6], 8, 2)
    with pytest.raises(ValueError, match="staged"):
        dspark_tail_stage(*args[:9], args[9][:, :-1], args[10], WINDOW, BS)
    with pytest.raises(ValueError, match="greedy"):
        dspark_tail_stage(*args[:4], args[4][:-1], *args[5:], WINDOW, BS)
