"""A pool of fixed-size KV blocks with ref counts and a prefix-cache index.

Block ids are ``0 .. num_blocks-1``. A block is either *in use*
(``ref_cnt > 0``) or *free* (``ref_cnt == 0``, sitting in the free queue).
A free block may still carry a hash: it is a cached block that can be hit
(``get_cached`` + ``touch``) until allocation reuses it, which is the
eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterable


class BlockPool:
    """Ref-counted blocks + LRU free queue + hash -> block map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"BlockPool needs num_blocks > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt: list[int] = [0] * num_blocks
        self.block_hash: list[Hashable | None] = [None] * num_blocks
        # OrderedDict as an O(1) deque with removal from the middle (touch):
        # the head is the next block to hand out (= to evict), the tail the
        # most recently freed cached block.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: dict[Hashable, int] = {}

    # ----------------------------------------------------------------- queries
    @property
    def num_free(self) -> int:
        """Blocks that ``allocate`` can hand out now (cached-but-free included)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def get_cached(self, block_hash: Hashable) -> int | None:
        """The block holding content ``block_hash``, in use or free, else None."""
        return self._cached.get(block_hash)

    def is_free(self, block: int) -> bool:
        return self.ref_cnt[block] == 0

    # ------------------------------------------------------------- mutations
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue (ref count 1 each).

        A reused block loses its hash: that is the eviction of a cached block.
        """
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self._free)} free")
        out: list[int] = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            h = self.block_hash[block]
            if h is not None:
                # Only drop the index entry if it still points at this block.
                if self._cached.get(h) == block:
                    del self._cached[h]
                self.block_hash[block] = None
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; at zero it returns to the queue.

        Cached blocks go to the tail (evicted last, LRU); blocks without a
        hash go to the head because nobody can ever hit them, so reusing them
        first keeps cached content alive longer. Callers pass a request's
        blocks tail-first so its later (less shared) blocks are evicted first.
        """
        for block in blocks:
            if self.ref_cnt[block] <= 0:
                raise ValueError(f"double free of block {block}")
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self._free[block] = None
                if self.block_hash[block] is None:
                    self._free.move_to_end(block, last=False)

    def touch(self, block: int) -> None:
        """Take a reference on a prefix-cache hit (revives it if it was free)."""
        if self.ref_cnt[block] == 0:
            del self._free[block]
        self.ref_cnt[block] += 1

    def cache_block(self, block: int, block_hash: Hashable) -> bool:
        """Register an in-use full block under ``block_hash``.

        Returns False (and changes nothing) if the block is already hashed or
        another block already holds the same content: the first copy stays
        the canonical one and the duplicate simply is not hittable.
        """
        if self.ref_cnt[block] <= 0:
            raise ValueError(f"cache_block on free block {block}")
        if self.block_hash[block] is not None or block_hash in self._cached:
            return False
        self.block_hash[block] = block_hash
        self._cached[block_hash] = block
        return True

    # ------------------------------------------------------------- checking
    def assert_consistent(self) -> None:
        """Check every invariant of the pool (tests call this after each step)."""
        assert len(self.ref_cnt) == self.num_blocks
        for b in range(self.num_blocks):
            assert self.ref_cnt[b] >= 0, f"block {b} has negative ref count"
            assert (self.ref_cnt[b] == 0) == (b in self._free), (
                f"block {b}: ref_cnt={self.ref_cnt[b]} but in_free_queue={b in self._free}"
            )
        for h, b in self._cached.items():
            assert self.block_hash[b] == h, f"hash map points at block {b} with another hash"
        hashed = sum(1 for h in self.block_hash if h is not None)
        assert hashed == len(self._cached), "a hashed block is missing from the hash map"
