"""CUDA graphs of a drafter's step, one per (batch bucket, sampling mode), captured at start-up
(and :class:`FeatureGraphs`: the drafter's per-row feature writes into the paged cache).

A draft step of R requests pads to the smallest bucket of ``decode_graphs.BUCKETS`` >= R
(up to the one holding ``max_num_seqs``) and replays the graph captured for it: the
drafter's whole device pass (for DSpark: the stages' block pass, the head, the Markov
bias, the confidence head and the sequential sampling of the block) from the first rows of
one persistent int64 input tensor, written by one host -> device copy (or staged on the
device by the verify graph, :meth:`DraftGraphs.run_staged`); its results come back
with one device -> host read. Rows past the real batch repeat row 0 (the pass only reads
the cache, so padded rows change nothing).

Modes: ``greedy`` (every request greedy: no draft distributions) and ``sample``
(temperature sampling, greedy rows mixed in). A step with more requests than the largest
bucket runs the same body eagerly on the real rows, and the drafter keeps a step where some
request asks for top-k / top-p / min-p on its eager path (both counted in
``stats["eager_steps"]``): nothing is captured while serving.

On a host cache (CPU tests) graphs are emulated by ``DecodeGraphs``: replays run the body
eagerly on the padded buffers, so padding, bucketing and the on-device sampling are the
ones a GPU runs.

Memory: the set is captured after the KV cache is sized (``deepinfer.spec.setup``), into a
pool of its own; its largest outputs are the bucket's logits (R * gamma * V float32) and,
in the sample mode, the draft distributions (R * n * V).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from deepinfer.engine.transfer import copy_to_device

from .decode_graphs import BUCKETS, DecodeGraphs, rows_bucket

MODES = ("greedy", "sample")


class DraftGraphs:
    """The captured (or emulated) draft steps of one drafter.

    ``body(inp, greedy_only)``: the drafter's device pass over the rows of ``inp`` [R, cols]
    int64 -> (packed [R, C] int64, q [R, n, V] float32 or None)."""

    def __init__(self, body: Callable[[torch.Tensor, bool], tuple[torch.Tensor, Any]], cols: int, max_rows: int,
                 device: torch.device) -> None:
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"DraftGraphs: max_rows must be an int >= 1, got {max_rows!r}")
        if not isinstance(cols, int) or cols < 1:
            raise ValueError(f"DraftGraphs: cols must be an int >= 1, got {cols!r}")
        self.body, self.cols, self.device = body, cols, device
        top = rows_bucket(max_rows) or BUCKETS[-1]
        self.buckets = [b for b in BUCKETS if b <= top]
        self.graphs = DecodeGraphs(device)
        #: the largest bucket's input rows; every bucket reads its first rows, so work captured
        #: elsewhere (the verify graph's DSpark tail) can stage a step's rows with no copy
        self.staged = torch.zeros(self.buckets[-1], cols, dtype=torch.int64, device=device)
        self._inputs = {b: self.staged[:b] for b in self.buckets}
        self.stats = {"graph_steps": 0, "eager_steps": 0}

    def warmup(self, template: np.ndarray) -> None:
        """Capture every (bucket, mode), the largest first (the smaller graphs reuse its pool),
        on inputs that repeat ``template`` (one request's row: reads only), then seal."""
        row = torch.from_numpy(np.asarray(template, dtype=np.int64).reshape(1, self.cols))
        for b in sorted(self.buckets, reverse=True):
            self._inputs[b].copy_(row.expand(b, -1))
            for mode in MODES:
                self.graphs.capture((b, mode), self._inputs[b], self._fn(mode == "greedy"))
        self.graphs.seal()

    def _fn(self, greedy_only: bool) -> Callable[[torch.Tensor], tuple]:
        return lambda inp: self.body(inp, greedy_only)

    def run(self, rows: np.ndarray, greedy_only: bool) -> tuple[list[list[int]], torch.Tensor | None]:
        """The body over ``rows`` [R, cols]: (packed rows on the host, q [R, n, V] on the device
        or None); eager on the real rows past the largest bucket."""
        r = rows.shape[0]
        if r < 1 or rows.shape[1] != self.cols:
            raise ValueError(f"DraftGraphs.run: rows must be [R >= 1, {self.cols}], got {rows.shape}")
        b = rows_bucket(r)
        if b is None or b not in self._inputs:
            self.stats["eager_steps"] += 1
            packed, q = self.body(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(self.device),
                                  greedy_only)
            return packed.tolist(), q
        full = np.empty((b, self.cols), dtype=np.int64)
        full[:r], full[r:] = rows, rows[0]
        inp = self._inputs[b]
        copy_to_device(inp, full)  # staged: a pageable copy would wait for the stream
        packed, q = self._replay(b, r, greedy_only)
        return packed.tolist(), q

    def run_staged(self, r: int, greedy_only: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The body over rows already on the device in :attr:`staged` (its first ``r`` real, the
        rest of the bucket valid padding): (packed [r, C] on the device, q), nothing read back;
        None past the largest bucket (the caller drafts from the host)."""
        if not self.has_rows(r):
            return None
        return self._replay(rows_bucket(r), r, greedy_only)

    def has_rows(self, r: int) -> bool:
        """Whether :meth:`run_staged` replays a captured graph for ``r`` requests."""
        b = rows_bucket(r)
        return r >= 1 and b is not None and b in self._inputs

    def _replay(self, b: int, r: int, greedy_only: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        mode = "greedy" if greedy_only else "sample"
        packed, q = self.graphs.replay((b, mode), self._inputs[b], self._fn(greedy_only))
        self.stats["graph_steps"] += 1
        # q is a graph output the next replay rewrites: the verify step reads it after that
        # may have happened (async scheduling), so the requests get their own copy
        return packed[:r], (q[:r].clone() if q is not None else None)


class FeatureGraphs:
    """Captured writes of per-row drafter features into the paged cache (DSpark's context
    rows), one graph per power-of-two row count up to ``max_rows``.

    ``body(x, ints)``: x [T, F] features in the model dtype, ints [2, T] int64 (positions,
    flat pool rows) -> writes only. Rows past the real ones repeat row 0 (same features,
    position and pool row: the same value written twice), so padding writes nothing new.
    More rows than the largest graph run the body eagerly on the real rows (counted)."""

    def __init__(self, body: Callable[[torch.Tensor, torch.Tensor], Any], width: int, dtype: torch.dtype,
                 max_rows: int, device: torch.device) -> None:
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"FeatureGraphs: max_rows must be an int >= 1, got {max_rows!r}")
        self.body, self.device = body, device
        self.sizes = [1 << i for i in range(max(1, max_rows - 1).bit_length() + 1)]
        self.graphs = DecodeGraphs(device)
        self._x = {n: torch.zeros(n, width, dtype=dtype, device=device) for n in self.sizes}
        self._ints = {n: torch.zeros(2, n, dtype=torch.int64, device=device) for n in self.sizes}
        self.stats = {"graph_steps": 0, "eager_steps": 0}

    def warmup(self, pos: int, slot: int) -> None:
        """Capture every size, the largest first, writing zero features at one pool row
        (``slot``, position ``pos``: a row no request holds yet), then seal."""
        for n in sorted(self.sizes, reverse=True):
            self._ints[n][0].fill_(pos)
            self._ints[n][1].fill_(slot)
            self.graphs.capture(n, (self._x[n], self._ints[n]), self._fn)
        self.graphs.seal()

    def _fn(self, arg: tuple[torch.Tensor, torch.Tensor]) -> Any:
        return self.body(*arg)

    def run(self, x: torch.Tensor, positions: np.ndarray, slots: np.ndarray) -> None:
        """Write the features of T rows (x [T, F] on the device) at their positions / pool rows."""
        t = x.shape[0]
        n = next((m for m in self.sizes if m >= t), None)
        ints = np.stack([np.asarray(positions, dtype=np.int64), np.asarray(slots, dtype=np.int64)])
        if n is None:
            self.stats["eager_steps"] += 1
            self.body(x, torch.from_numpy(ints).to(self.device))
            return
        full = np.empty((2, n), dtype=np.int64)
        full[:, :t], full[:, t:] = ints, ints[:, :1]
        copy_to_device(self._ints[n], full)
        self._replay(x, n)

    def _replay(self, x: torch.Tensor, n: int) -> None:
        t = x.shape[0]
        buf = self._x[n]
        buf[:t].copy_(x)
        buf[t:].copy_(x[:1].expand(n - t, -1))
        self.graphs.replay(n, (buf, self._ints[n]), self._fn)
        self.stats["graph_steps"] += 1


__all__ = ["DraftGraphs", "FeatureGraphs", "MODES"]
