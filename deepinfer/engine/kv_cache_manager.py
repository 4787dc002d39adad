"""Hybrid KV cache manager: one block pool per layer group, one interface.

Every group uses the same *token* block size ``B``: block ``i`` of a request
covers token positions ``[i*B, (i+1)*B)`` in every group (a CSA group stores
B/4 compressed entries per block, an HCA group B/128, a window group B raw
KV rows; the runner maps positions to rows). What differs per group is the
lifetime:

* full-context groups (``sliding_window=None``) keep every block;
* window groups only keep the blocks that the earliest query of the current
  step can still read (a query at position p reads p-W+1 .. p); older
  entries in the table become ``-1`` and the block returns to the pool.

Prefix-cache hashes are registered by ``cache_blocks`` which the scheduler
calls from ``update()``, i.e. only *after* the runner has written a block, so
a block never becomes hittable before its KV exists.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer.engine.block_pool import BlockPool
from deepinfer.engine.request import Request


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """A layer group: ``sliding_window=None`` means it keeps the whole context."""

    name: str
    sliding_window: int | None = None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVFit:
    """What admission reads of a KV cache: its groups, sizes and each pool's block count. A
    picklable snapshot (the API process of `deepinfer serve` admits requests with it,
    deepinfer/engine/admission_local.py); the manager answers through the same code."""

    groups: tuple[KVCacheGroupSpec, ...]
    block_size: int
    window_slack: int
    num_blocks: dict[str, int]

    def max_blocks_needed(self, num_tokens: int, max_chunk: int) -> dict[str, int]:
        """Peak blocks one request of ``num_tokens`` can hold per group.

        A window group holds its window plus the current chunk; ``max_chunk``
        is the largest chunk the scheduler may feed in one step.
        """
        return blocks_needed(self.groups, self.block_size, self.window_slack, num_tokens, max_chunk)


def blocks_needed(groups, block_size: int, window_slack: int, num_tokens: int, max_chunk: int) -> dict[str, int]:
    """`KVFit.max_blocks_needed` over plain values (the manager asks it on every schedule)."""
    out = {}
    for g in groups:
        full = _cdiv(num_tokens, block_size)
        if g.sliding_window is not None:
            window = _cdiv(g.sliding_window - 1 + window_slack + min(max_chunk, num_tokens), block_size) + 1
            full = min(full, window)
        out[g.name] = full
    return out


class HybridKVCacheManager:
    """Block tables, prefix hits and state slots for all layer groups."""

    def __init__(
        self,
        groups: list[KVCacheGroupSpec],
        num_blocks: dict[str, int],
        block_size: int,
        max_num_seqs: int,
        enable_prefix_caching: bool = True,
        hit_alignment: int = 1,
        hit_limit: Callable[[Request], int] | None = None,
    ) -> None:
        """``hit_alignment`` (tokens): prefix hits are multiples of
        lcm(block_size, hit_alignment). Set it to the largest compression ratio
        (e.g. 128 for HCA) when block_size is smaller, so a hit always ends on a
        compression boundary where the compressor's partial state is empty."""
        if not groups or len({g.name for g in groups}) != len(groups):
            raise ValueError("need at least one group and unique group names")
        self.groups = list(groups)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.enable_prefix_caching = enable_prefix_caching
        self._hit_step = math.lcm(block_size, hit_alignment) // block_size  # in blocks
        # Longest usable hit (tokens) per request, e.g. V4.1 bounded replay's cut; None = no cap.
        self.hit_limit = hit_limit
        self.pools = {g.name: BlockPool(num_blocks[g.name]) for g in groups}
        #: positions a step's rows may sit below ``num_computed_tokens`` (speculative steps
        #: planned ahead count every draft accepted: up to k more than the truth,
        #: deepinfer/spec/plan_ahead.py); window groups keep that much more behind the window
        self.window_slack = 0
        self._free_slots: list[int] = list(range(max_num_seqs - 1, -1, -1))  # pop() -> 0 first
        # Per request: how many leading blocks already went through cache_blocks.
        self._num_cached_blocks: dict[str, int] = {}

    # --------------------------------------------------------------- helpers
    def _first_needed_block(self, group: KVCacheGroupSpec, pos: int) -> int:
        """First block a query at ``pos`` (or later) can read in ``group``."""
        if group.sliding_window is None:
            return 0
        return max(0, pos - group.sliding_window + 1) // self.block_size

    def _update_hashes(self, request: Request) -> list[bytes]:
        """Extend the request's chained hashes to all its FULL blocks.

        sha256 (not ``hash()``) so content collisions are not a concern and
        hashes are stable across processes.
        """
        hashes, B = request.block_hashes, self.block_size
        toks = request.all_token_ids
        while len(hashes) < len(toks) // B:
            i = len(hashes)
            prev = hashes[-1] if hashes else b""
            hashes.append(hashlib.sha256(prev + toks[i * B : (i + 1) * B].tobytes()).digest())  # int64 array
        return hashes

    # ------------------------------------------------------------ prefix hits
    def get_computed_blocks(self, request: Request) -> tuple[dict[str, list[int]], int]:
        """Longest block-aligned cached prefix usable for ``request``.

        A hit of ``k`` blocks (``t = k*B`` tokens) needs, in every full group,
        blocks ``0..k-1`` and, in every window group, the blocks a query at
        ``t`` reads (``t-W+1 .. t-1``); earlier window blocks are ``-1``.
        Capped at ``(num_tokens-1)//B`` blocks so at least one token is
        computed (its logits are needed). Does not take references: pass the
        result to ``allocate_slots`` right away.
        """
        empty: dict[str, list[int]] = {g.name: [] for g in self.groups}
        if not self.enable_prefix_caching:
            return empty, 0
        assert request.num_computed_tokens == 0, "prefix lookup only on (re)admission"
        hashes = self._update_hashes(request)
        max_k = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        if self.hit_limit is not None:
            max_k = min(max_k, max(0, self.hit_limit(request)) // self.block_size)
        # Full groups: the hit is prefix-closed, so scan forward.
        k = max_k - max_k % self._hit_step
        for g in self.groups:
            if g.sliding_window is None:
                pool, n = self.pools[g.name], 0
                while n < k and pool.get_cached(hashes[n]) is not None:
                    n += 1
                k = n - n % self._hit_step
        # Window groups are not prefix-closed (old blocks may be evicted while
        # later ones survive), so try candidates from the longest down.
        while k > 0:
            tables: dict[str, list[int]] = {}
            for g in self.groups:
                pool, first = self.pools[g.name], self._first_needed_block(g, k * self.block_size)
                ids = [pool.get_cached(hashes[i]) for i in range(first, k)]
                if any(b is None for b in ids):
                    break
                tables[g.name] = [-1] * first + ids  # type: ignore[operator]
            else:
                return tables, k * self.block_size
            k -= self._hit_step
        return empty, 0

    # -------------------------------------------------------------- allocate
    def _covered(self, request: Request, start: int, need_blocks: int) -> bool:
        """Every group's table already holds ``need_blocks`` blocks and the window groups
        have nothing below this step's window left to free. Each allocation frees every
        block below its window and windows only move forward, so the freed entries (-1)
        form a prefix: the newest block below the window being -1 means all below are."""
        tables = request.block_table
        for g in self.groups:
            table = tables.get(g.name)
            if table is None or len(table) < need_blocks:
                return False
            if g.sliding_window is not None:
                first = self._first_needed_block(g, start - self.window_slack)
                if first and table[first - 1] != -1:
                    return False
        return True

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: dict[str, list[int]] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> bool:
        """Grow the request's tables to cover ``num_computed + hit + num_new_tokens``.

        All-or-nothing: if any pool (or the state-slot pool) is short, return
        False with nothing changed. On success: hit blocks are referenced,
        window blocks entirely below the window of this step's earliest query
        are freed (table entry -> -1), new blocks are appended, and the
        request gets a state slot if it had none. The caller then sets
        ``num_computed_tokens += num_new_computed_tokens``.
        """
        B = self.block_size
        start = request.num_computed_tokens + num_new_computed_tokens  # earliest query
        need_blocks = _cdiv(start + num_new_tokens, B)
        if new_computed_blocks is None and request.state_slot is not None and self._covered(request, start, need_blocks):
            return True  # a decode step inside its blocks: nothing to allocate, nothing to free
        if request.state_slot is None and not self._free_slots:
            return False
        plans = []  # (group, table, hit_ids, to_free_idx, n_new)
        for g in self.groups:
            pool = self.pools[g.name]
            table = list(request.block_table.get(g.name, []))
            hit = (new_computed_blocks or {}).get(g.name, [])
            table += hit
            first = self._first_needed_block(g, start - self.window_slack)
            to_free = [i for i in range(min(first, len(table))) if table[i] != -1]
            n_new = max(0, need_blocks - len(table))
            # Hits that sit in the free queue stop counting as free; our own
            # blocks that drop to ref 0 start counting.
            revived = sum(1 for b in hit if b != -1 and pool.is_free(b))
            released = sum(1 for i in to_free if pool.ref_cnt[table[i]] == 1)
            if pool.num_free - revived + released < n_new:
                return False
            plans.append((g, table, hit, to_free, n_new))
        for g, table, hit, to_free, n_new in plans:
            pool = self.pools[g.name]
            for b in hit:  # touch before allocating so a hit is never evicted
                if b != -1:
                    pool.touch(b)
            pool.free([table[i] for i in reversed(to_free)])
            for i in to_free:
                table[i] = -1
            table += pool.allocate(n_new)
            request.block_table[g.name] = table  # a new list: scheduled snapshots share the old one
        if request.state_slot is None:
            request.state_slot = self._free_slots.pop()
        if new_computed_blocks is not None:
            # Hit blocks are already registered; start registration after them.
            self._num_cached_blocks[request.req_id] = num_new_computed_tokens // B
        return True

    def cache_blocks(self, request: Request) -> None:
        """Register the hashes of blocks made full by the computed tokens.

        Called after the runner wrote them (``Scheduler.update``), so only
        blocks whose KV really exists become hittable.
        """
        if not self.enable_prefix_caching:
            return
        # min(): accepted speculative tokens count as computed a moment before they are
        # appended; only blocks whose tokens are known get a hash.
        n_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        done = self._num_cached_blocks.get(request.req_id, 0)
        if n_full <= done:
            return
        hashes = self._update_hashes(request)
        for g in self.groups:
            pool, table = self.pools[g.name], request.block_table[g.name]
            for i in range(done, n_full):
                if table[i] != -1:
                    pool.cache_block(table[i], hashes[i])
        self._num_cached_blocks[request.req_id] = n_full

    # ------------------------------------------------------------------ free
    def free(self, request: Request) -> None:
        """Release every block reference and the state slot of ``request``.

        Tail blocks are freed first so they are evicted before the prefix
        blocks that other requests are more likely to share.
        """
        for name, table in request.block_table.items():
            self.pools[name].free([b for b in reversed(table) if b != -1])
        request.block_table = {}
        if request.state_slot is not None:
            self._free_slots.append(request.state_slot)
            request.state_slot = None
        self._num_cached_blocks.pop(request.req_id, None)

    # ----------------------------------------------------------------- stats
    def num_free_blocks(self, group: str) -> int:
        return self.pools[group].num_free

    def usage(self) -> dict[str, float]:
        """Fraction of blocks in use per group (cached-but-free counts as free)."""
        return {name: p.num_used / p.num_blocks for name, p in self.pools.items()}

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def fit(self) -> KVFit:
        """The admission view of this cache now (window_slack may grow at start-up)."""
        return KVFit(tuple(self.groups), self.block_size, self.window_slack,
                     {name: p.num_blocks for name, p in self.pools.items()})

    def max_blocks_needed(self, num_tokens: int, max_chunk: int) -> dict[str, int]:
        """Peak blocks one request of ``num_tokens`` can hold per group (`KVFit.max_blocks_needed`)."""
        return blocks_needed(self.groups, self.block_size, self.window_slack, num_tokens, max_chunk)

    def assert_consistent(self) -> None:
        for pool in self.pools.values():
            pool.assert_consistent()
        assert len(set(self._free_slots)) == len(self._free_slots)
