"""BlockPool: ref counts, LRU free queue, prefix-cache index, eviction."""

from __future__ import annotations

import random

import pytest

from deepinfer.engine.block_pool import BlockPool


def test_allocate_and_free_counts() -> None:
    pool = BlockPool(8)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 5 and pool.num_used == 3
    pool.free(a)
    assert pool.num_free == 8
    pool.assert_consistent()


def test_allocate_too_many_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(ValueError):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.assert_consistent()


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])


def test_freed_cached_block_stays_hittable_until_evicted() -> None:
    pool = BlockPool(3)
    b0, b1, b2 = pool.allocate(3)
    assert pool.cache_block(b0, "h0")
    pool.free([b0, b1, b2])
    # Cached block is free but still indexed.
    assert pool.num_free == 3 and pool.get_cached("h0") == b0
    # Uncached blocks are handed out first, the cached one survives.
    got = pool.allocate(2)
    assert b0 not in got and pool.get_cached("h0") == b0
    # The next allocation has to take it: that is the eviction.
    assert pool.allocate(1) == [b0]
    assert pool.get_cached("h0") is None and pool.block_hash[b0] is None
    pool.assert_consistent()


def test_lru_order_of_cached_blocks() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for b in blocks:
        pool.cache_block(b, f"h{b}")
    # Free in order 2, 0, 1: eviction must follow the same order.
    for b in (2, 0, 1):
        pool.free([b])
    assert [pool.allocate(1)[0] for _ in range(3)] == [2, 0, 1]


def test_touch_revives_free_block_and_shares_in_use_block() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.cache_block(b, "x")
    pool.touch(b)  # second user of an in-use block
    assert pool.ref_cnt[b] == 2
    pool.free([b])
    pool.free([b])
    assert pool.is_free(b) and pool.num_free == 4
    pool.touch(pool.get_cached("x"))  # hit on a free cached block
    assert pool.ref_cnt[b] == 1 and pool.num_free == 3
    assert b not in pool.allocate(3)
    pool.assert_consistent()


def test_duplicate_content_keeps_first_copy() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, "same")
    assert not pool.cache_block(b, "same")
    assert not pool.cache_block(a, "other")  # already hashed
    assert pool.get_cached("same") == a
    pool.free([a, b])
    pool.assert_consistent()


def test_cache_block_on_free_block_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.cache_block(0, "h")


def test_random_operations_keep_invariants() -> None:
    rng = random.Random(0)
    pool = BlockPool(16)
    held: list[int] = []
    for step in range(2000):
        op = rng.random()
        if op < 0.4 and pool.num_free:
            held += pool.allocate(rng.randint(1, pool.num_free))
        elif op < 0.7 and held:
            b = held.pop(rng.randrange(len(held)))
            pool.free([b])
        elif op < 0.85 and held:
            pool.cache_block(rng.choice(held), rng.randrange(40))
        else:
            hit = pool.get_cached(rng.randrange(40))
            if hit is not None:
                pool.touch(hit)
                held.append(hit)
        if step % 50 == 0:
            pool.assert_consistent()
    pool.free(held)
    assert pool.num_free == 16
    pool.assert_consistent()
