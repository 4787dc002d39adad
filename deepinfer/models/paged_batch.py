"""A step's flattened batch over the paged KV pools, shared by every family: each request's
slice of the step (`SeqMeta`), the batch (`ForwardBatch`), row access into a paged pool
through a request's block table, and the block-size rule every family's layout obeys.

A paged pool is ``[blocks, per_block, ...]``; block i of a request's table covers its
positions ``[i * per_block, (i + 1) * per_block)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class SeqMeta:
    """One request's slice of a flattened step."""

    start: int  # tokens already in the cache before this step
    length: int  # tokens fed this step
    offset: int  # first row in the flattened batch
    block_table: dict[str, list[int]]
    slot: int
    is_new: bool = False  # first chunk since admission: reset/restore the state slot
    prompt_len: int = 0  # the request's prompt length (V4.1 bounded replay; 0 = unknown)


@dataclass
class ForwardBatch:
    """Flattened tokens of several requests plus their metadata."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seqs: list[SeqMeta] = field(default_factory=list)
    replay: object | None = None  # V4.1 SWA bounded replay (bounded_replay.ReplayConfig)
    decode: object | None = None  # GPU fast path: pure-decode step tensors (models.fast.decode.DecodeMeta)
    #: [T] int64 on the device, already added to ``positions``: how far each row is from the
    #: position its SeqMeta says (a speculative step planned before the previous one's
    #: accepted counts landed, engine/token_buffer.py); None when the host positions are exact
    position_shift: object | None = None
    #: a batch built with its device tensors deferred (``ModelRunner.build_batch(so,
    #: deferred=True)``): the host ids (placeholders -1) and placeholder (rows, flat buffer
    #: indices) a graph that gathers on the device reads; ``materialize`` makes the tensors
    host_ids: list[int] | None = None
    placeholders: tuple[list[int], list[int]] | None = None
    _materialize: object | None = None

    @property
    def num_tokens(self) -> int:
        if self.input_ids is None:
            return sum(s.length for s in self.seqs)
        return int(self.input_ids.shape[0])

    @property
    def planned_ahead(self) -> bool:
        """Its ids include placeholders fed with shifted positions (a speculative step
        planned before the previous one landed)."""
        return self.position_shift is not None or bool(self.placeholders and self.placeholders[0]
                                                       and self.input_ids is None)

    def materialize(self) -> ForwardBatch:
        """Make the deferred device ids / positions (gathering placeholders); a no-op otherwise."""
        make, self._materialize = self._materialize, None
        if make is not None:
            make(self)
        return self


def check_block_size(cfg, block_size: int) -> None:
    """Every family: a block holds whole compressed entries of every compressed layer."""
    for ratio in {r for r in cfg.compress_ratios if r}:
        if block_size % ratio:
            raise ValueError(f"block_size={block_size} must be a multiple of every compress ratio (got ratio {ratio})")


def paged_slots(table: list[int], start: int, n: int, per_block: int, valid: np.ndarray | None = None) -> np.ndarray:
    """Flat pool rows (block * per_block + offset) of positions [start, start + n) of one
    request. Positions marked invalid (``valid`` False, e.g. before 0) map to row 0 for the
    caller to mask. A valid position in a freed block (table entry < 0) is a bookkeeping
    bug: it raises."""
    pos = start + np.arange(n)
    ok = np.ones(n, dtype=bool) if valid is None else valid
    safe = np.where(ok, pos, 0)
    blocks = np.asarray(table, dtype=np.int64)[safe // per_block]
    if (blocks[ok] < 0).any():
        raise RuntimeError(f"read or write of a freed block: rows [{start}, {start + n}) of table {table}")
    return np.where(ok, blocks * per_block + safe % per_block, 0)


def padded_tables(tables: list[list[int]]) -> np.ndarray:
    """Block tables as one int64 array [requests, longest], short ones padded with -1."""
    out = np.full((len(tables), max((len(t) for t in tables), default=0) or 1), -1, dtype=np.int64)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out


def paged_slots_of(tables: np.ndarray, positions: np.ndarray, valid: np.ndarray, per_block: int) -> np.ndarray:
    """:func:`paged_slots` for many requests at once: ``tables`` [R, L] (`padded_tables`),
    ``positions`` / ``valid`` [R, N] -> flat pool rows [R, N] (invalid positions map to 0;
    a valid one past its table or in a freed block raises, as there)."""
    safe = np.where(valid, positions, 0)
    col = safe // per_block
    inside = col < tables.shape[1]
    blocks = np.take_along_axis(tables, np.minimum(col, tables.shape[1] - 1), axis=1)
    bad = valid & (~inside | (blocks < 0))
    if bad.any():
        r, n = map(int, np.argwhere(bad)[0])
        raise RuntimeError(f"read or write of a freed block: position {int(positions[r, n])} of table "
                           f"{tables[r][tables[r] != -1].tolist()}")
    return np.where(valid, blocks * per_block + safe % per_block, 0)


def gather_rows(pool: torch.Tensor, table: list[int], start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of one request's paged sequence: pool is [blocks, per_block, ...]."""
    slots = torch.from_numpy(paged_slots(table, start, end - start, pool.shape[1]))
    return pool.view(-1, *pool.shape[2:])[slots]


def scatter_rows(pool: torch.Tensor, table: list[int], start: int, rows: torch.Tensor) -> None:
    """Write rows at sequence positions [start, start + len(rows)) of one request."""
    slots = torch.from_numpy(paged_slots(table, start, rows.shape[0], pool.shape[1]))
    pool.view(-1, *pool.shape[2:])[slots] = rows.to(pool.dtype)
