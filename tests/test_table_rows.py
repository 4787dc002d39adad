"""TableRows: the decode step's block tables gathered from per-slot host rows equal the
tables padded from the requests' lists, through growth, window frees, slot reuse and wider
steps; unchanged tables cost no row writes."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np

from deepinfer.models.fast.table_rows import TableRows

GROUPS = ["swa", "csa", "hca"]


def padded(reqs, width: int) -> np.ndarray:
    """The reference: every table as a list padded with 0 (or cut) to ``width``."""
    return np.array([[(t + [0] * width)[:width] for t in (r.block_table[g] for r in reqs)] for g in GROUPS],
                    dtype=np.int32).reshape(len(GROUPS), len(reqs), width)


def width_of(reqs) -> int:
    longest = max(len(t) for r in reqs for t in r.block_table.values())
    return 1 << max(0, longest - 1).bit_length()


def test_gather_matches_padded_lists_through_a_serving_run() -> None:
    rng = random.Random()
    rows = TableRows(GROUPS)
    free_slots = list(range(12))
    rng.shuffle(free_slots)
    live = []
    for step in range(300):
        if live and rng.random() < 0.1:  # a request finishes: its slot is reused by a later one
            free_slots.append(live.pop(rng.randrange(len(live))).state_slot)
        if free_slots and rng.random() < 0.3:
            n = rng.randint(1, 40)
            live.append(SimpleNamespace(state_slot=free_slots.pop(), block_table={
                g: [rng.randrange(1, 10_000) for _ in range(n if g != "hca" else n // 4 + 1)] for g in GROUPS}))
        if not live:
            continue
        for r in live:  # the manager's contract: a changed table is a new list, never mutated in place
            if rng.random() < 0.2:
                t = list(r.block_table["swa"])
                t[:max(0, len(t) - 3)] = [-1] * max(0, len(t) - 3)  # window frees below the window
                r.block_table = {**r.block_table, "swa": t + [rng.randrange(1, 10_000)],
                                 "csa": r.block_table["csa"] + [rng.randrange(1, 10_000)]}
        batch = rng.sample(live, rng.randint(1, len(live)))
        width = width_of(batch) * rng.choice((1, 1, 2))
        assert np.array_equal(rows.gather(batch, width), padded(batch, width)), step
        out = np.full((len(GROUPS), len(batch), width), 7, dtype=np.int32)
        before = rows.rewrites
        assert rows.gather(batch, width, out=out) is out and np.array_equal(out, padded(batch, width))
        assert rows.rewrites == before  # same lists again: no row rewritten


def test_a_table_longer_than_the_width_is_cut() -> None:
    r = SimpleNamespace(state_slot=3, block_table={g: list(range(1, 11)) for g in GROUPS})
    got = TableRows(GROUPS).gather([r], 4)
    assert got.shape == (3, 1, 4) and got[:, 0].tolist() == [[1, 2, 3, 4]] * 3
