"""Runner side of the fast path: picks it, fills one persistent device buffer with a
pure-decode step's inputs, and runs such steps through CUDA graphs.

Selection (``FastPath.create``): the model is a plain ``DeepseekV4Model`` (not V4.1) in
bf16 / fp16, the cache lives on a CUDA device and ``deepinfer_kernels`` imports -> Triton
kernels (``DEEPINFER_FASTPATH=1`` also takes float32 models).
``DEEPINFER_FASTPATH=0`` turns it off; ``=ref`` / ``=triton`` force it on a host cache
with the kernels' torch references / the interpreted kernels (CPU tests; graphs are then
emulated eagerly on the same padded buffers when ``DEEPINFER_CUDA_GRAPHS=1``);
``DEEPINFER_ACCELERATOR=cpu`` keeps the reference path (the cache is then on the host).
``DEEPINFER_CUDA_GRAPHS=0`` keeps CUDA decode eager.

Steps: every request continues with 1..MAX_ROWS tokens (a decode token, or a token and its
drafts in a speculative verify step; the spec runner calls :meth:`forward_streams`).

Inputs: one int32 buffer per (rows, table width) holds ids | positions | slots | request
row groups | every group's block table as contiguous views (:class:`StepInputs`); a step
costs one pinned host -> device copy plus the device copy of its token ids (async
scheduling fills those on the device), and nothing is rebuilt inside the graph.

CUDA graphs (fast/decode_graphs.py): one graph per (rows bucket 1, 2, 4, ..., 256; table
width class: a power of two of blocks), all in one memory pool. :meth:`FastPath.warmup` (at
engine start) captures every shape the engine's limits allow, the largest first so that the
smaller graphs reuse the pool the largest allocated, on dummy steps that write only block 0 /
state slot 0 at position 0 (overwritten or reset before any request reads them), then seals
the set: nothing is captured while serving (a step of a shape outside it runs eagerly and is
counted). A step runs at its own width class, so its kernels iterate only the blocks its
longest table can have. Rows past the real batch repeat row 0 (same request, same slot, same
position), so they write exactly what row 0 writes and need no dummy block or slot.
A graph computes the logits of every row; the runner reads the first R. It also reduces
them to each row's argmax and log-sum-exp (:attr:`FastPath.reduced`), so an all-greedy
step samples without a launch of its own (the runner's greedy lane).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deepinfer.engine.transfer import copy_to_device

from ..paged_batch import ForwardBatch
from .decode import DecodeMeta, kernel_ops
from .decode_graphs import BUCKETS, DecodeGraphs, GraphMemory, graph_shapes, reserved_bytes, rows_bucket
from .decode_graphs import tensors_of, width_class
from .moe import supported as moe_supported
from .table_rows import TableRows

#: Most tokens of one request a step may feed on this path (a token + up to 7 drafts).
MAX_ROWS = 8

# DEEPINFER_FASTPATH, DEEPINFER_CUDA_GRAPHS, DEEPINFER_CUDA_GRAPH_WARMUP: declared in deepinfer/envs.py


@dataclass(frozen=True)
class DecodeProgram:
    """A family's batched decode forward: ``logits(model, batch, cache, capture)`` -> [R, V]
    float32, ``streams(...)`` -> the final streams a speculative verify step computes its
    logits and drafts from (None: that family's verify rows run on the reference path),
    ``verify(...)`` -> (those streams, the logits of every row, computed as ``logits`` does):
    the verify graphs' greedy lane (None: verify steps take their logits outside the graph)."""

    logits: Any
    streams: Any = None
    verify: Any = None


def decode_program(model: Any) -> DecodeProgram | None:
    """The model's family's decode program (models/registry.py), None without one."""
    from ..registry import family_of

    load = family_of(model.cfg).decode_program
    return load() if load is not None else None


@dataclass
class StepInputs:
    """Device int32 inputs of a decode step with ``rows`` rows: views of one flat buffer.
    ``starts`` [rows + 1]: group g (one request's consecutive rows: a token and its drafts,
    or a padded row) is rows [starts[g], starts[g + 1]); later groups are empty."""

    flat: torch.Tensor
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    starts: torch.Tensor
    tables: dict[str, torch.Tensor]

    @classmethod
    def allocate(cls, rows: int, width: int, groups: list[str], device: torch.device) -> StepInputs:
        head = 4 * rows + 1
        flat = torch.zeros(head + len(groups) * width * rows, dtype=torch.int32, device=device)
        tables = {g: flat[head + i * width * rows:head + (i + 1) * width * rows].view(rows, width)
                  for i, g in enumerate(groups)}
        return cls(flat, flat[:rows], flat[rows:2 * rows], flat[2 * rows:3 * rows], flat[3 * rows:head], tables)

    def fill_dummy(self) -> None:
        """The warm-up's dummy step: ids 0, position 0, slot 0, block 0 for every row, one row
        per group (a capture writes only that row, rewritten before any request reads it)."""
        self.flat.zero_()
        self.starts.copy_(torch.arange(self.starts.shape[0], dtype=torch.int32, device=self.flat.device))


@dataclass
class GraphReductions:
    """Per-row reductions of a graphed decode step's logits (see ``FastPath.reduced``)."""

    packed: torch.Tensor
    lse: torch.Tensor
    argmax: torch.Tensor
    argmax_logprob: torch.Tensor
    slots: torch.Tensor


class FastPath:
    unavailable: str | None = None  # why the kernels did not import, if they did not

    def __init__(self, model: Any, cache: Any, ops: Any, graphs: bool, program: DecodeProgram | None = None) -> None:
        self.model, self.cache, self.ops = model, cache, ops
        self.device = cache.swa[0].device
        self.groups = list(cache.num_blocks)  # the family's block groups (V4: swa/csa/hca, V4.1: swa/dec/src)
        self.table_rows = TableRows(self.groups)  # host rows of the running requests' tables
        self.program = program or decode_program(model)
        self.graphs_enabled = graphs
        self.max_graph_batch = BUCKETS[-1]
        self._inputs: dict[tuple[int, int], StepInputs] = {}  # persistent per graph shape
        self.graphs = DecodeGraphs(self.device)  # captured (or emulated) graphs, one pool
        self._counts = {"fast_steps": 0, "graph_steps": 0, "eager_steps": 0}
        #: device bytes the warm-up's graph set took (pool + input buffers; None: not measured)
        self.graph_bytes: int | None = None
        #: the last graphed step's per-row reductions of its logits (views of the graph's
        #: outputs, valid until the next replay): packed [R, 2] int64 (argmax, its log-prob's
        #: float32 bits), logsumexp [R], argmax [R], argmax log-prob [R], state slots [R]
        self.reduced: GraphReductions | None = None
        self.warmed: list[tuple[int, int]] = []  # shapes :meth:`warmup` ran, in order
        self._moe_checked: tuple[tuple, bool] = ((), False)

    @property
    def stats(self) -> dict[str, int]:
        """Step counts: fast_steps, graph_steps, eager_steps (graphs on, but more rows than the
        largest bucket or a request that does not sample), captures, uncaptured_steps (a shape
        outside the sealed set: run eagerly)."""
        return {**self._counts, **self.graphs.stats}

    @property
    def _graphs(self) -> dict[tuple, tuple[Any, Any]]:
        """key -> (CUDA graph, its static outputs) (profiling scripts replay / clear them)."""
        return self.graphs._entries

    @classmethod
    def create(cls, model: Any, cache: Any) -> FastPath | None:
        mode = os.environ.get("DEEPINFER_FASTPATH", "auto").lower()
        if mode in ("0", "off", "false", "no") or decode_program(model) is None:
            return None
        n = model.cfg.hc_mult
        if n < 4 or n & (n - 1):  # the fused mHC kernels hold N x N in registers
            cls.unavailable = f"hc_mult={n} (fused mHC needs a power of two >= 4)"
            return None
        device = cache.swa[0].device
        graphs_env = os.environ.get("DEEPINFER_CUDA_GRAPHS", "")
        if mode in ("ref", "triton") and device.type != "cuda":  # forced on the host (tests); graphs emulated
            return cls(model, cache, kernel_ops(mode), graphs=graphs_env == "1")
        if device.type != "cuda":
            return None
        if mode == "auto" and getattr(model, "dtype", None) not in (torch.bfloat16, torch.float16):
            return None  # float32 models keep the reference path (tl.dot may round through tf32); "1" forces it
        try:
            ops = kernel_ops("triton")
        except Exception as exc:  # no triton / kernels: reference path
            cls.unavailable = repr(exc)
            return None
        graphs = graphs_env.lower() not in ("0", "off", "false", "no")
        return cls(model, cache, ops, graphs)

    # ---- per-step inputs -------------------------------------------------------------
    def _decode_like(self, so: Any) -> bool:
        """Every request continues (not newly admitted) with at most MAX_ROWS tokens: a decode
        token, a token and its drafts (speculative verify), or a short last chunk."""
        return bool(so.scheduled) and self._moe_supported() \
            and all(1 <= r.num_tokens <= MAX_ROWS and not r.is_new for r in so.scheduled)

    def _moe_supported(self) -> bool:
        """Every layer's FFN runs on the fused MoE kernel; re-checked only when a layer's FFN
        module changes (expert-parallel setups swap them after the fast path is created)."""
        ffns = tuple(id(layer.ffn) for layer in self.model.layers)
        if ffns != self._moe_checked[0]:
            self._moe_checked = (ffns, all(moe_supported(layer.ffn) for layer in self.model.layers))
        return self._moe_checked[1]

    def _graphed(self, so: Any, n_rows: int, width: int) -> bool:
        """The step replays a graph: graphs on, every request samples, and its shape is in the
        set (once sealed; before that a missing shape is captured on first use). A step of
        graphs-on CUDA that cannot is counted (``eager_steps`` / ``uncaptured_steps``)."""
        if not self.graphs_enabled:
            return False
        bucket = rows_bucket(n_rows)
        if bucket is None or bucket > self.max_graph_batch or not all(r.needs_sample for r in so.scheduled):
            self._counts["eager_steps"] += 1
            return False
        if self.graphs.sealed and not self.graphs.has((bucket, width)):
            self.graphs.stats["uncaptured_steps"] += 1
            return False
        return True

    def _host_inputs(self, so: Any, width: int, rows: int) -> np.ndarray:
        """The flat int32 layout of :class:`StepInputs` on the host; rows past the batch repeat row 0
        (each its own group), ids are filled on the device. Built with one numpy
        conversion per field (per-request slice assignments were twice as slow for 64
        requests on the CPU box; docs/measurements.md)."""
        reqs = so.scheduled
        lens = [r.num_tokens for r in reqs]
        n, k = sum(lens), len(lens)
        flat = np.empty(4 * rows + 1 + len(self.groups) * rows * width, dtype=np.int32)  # one buffer, no concat
        head = flat[:4 * rows + 1]
        head[:] = 0
        pos, slot, starts = head[rows:2 * rows], head[2 * rows:3 * rows], head[3 * rows:]
        tables = flat[4 * rows + 1:].reshape(len(self.groups), rows, width)
        first = np.fromiter((r.start_pos for r in reqs), dtype=np.int32, count=k)
        ends = np.cumsum(lens)
        offsets = np.arange(n, dtype=np.int32) - np.repeat(ends - lens, lens)  # row index inside its request
        pos[:n] = np.repeat(first, lens) + offsets
        slot[:n] = np.repeat(np.fromiter((r.state_slot for r in reqs), dtype=np.int32, count=k), lens)
        if n > k:  # several rows per request (verify): each repeats its request's tables
            tables[:, :n] = np.repeat(self.table_rows.gather(reqs, width), lens, axis=1)
        else:
            self.table_rows.gather(reqs, width, out=tables[:, :n])
        pos[n:], slot[n:], tables[:, n:] = pos[0], slot[0], tables[:, :1]
        starts[:k] = ends - lens
        starts[k:k + rows - n] = np.arange(n, rows)  # padded rows: one group each
        starts[k + rows - n:] = rows
        return flat

    def _width(self, so: Any) -> int:
        """The step's table width class: its longest table's blocks, to a power of two."""
        return width_class(max(len(r.block_table[g]) for r in so.scheduled for g in self.groups))

    def prepare(self, so: Any, batch: ForwardBatch, eager: bool = False) -> DecodeMeta | None:
        """Fill the step's device inputs (None unless :meth:`_decode_like`). Graphed steps use
        their bucket's persistent buffer (padded rows repeat row 0); ``eager`` never pads."""
        if not self._decode_like(so):
            return None
        n, width = batch.num_tokens, self._width(so)
        graphed = not eager and self._graphed(so, n, width)
        rows = rows_bucket(n) if graphed else n
        inputs = (self._graph_inputs(rows, width) if graphed
                  else StepInputs.allocate(rows, width, self.groups, self.device))
        copy_to_device(inputs.flat, self._host_inputs(so, width, rows))  # staged: never waits for the stream
        inputs.ids[:n].copy_(batch.input_ids)  # async scheduling gathers placeholders on the device
        if rows > n:
            inputs.ids[n:].copy_(inputs.ids[:1].expand(rows - n))
        self._counts["fast_steps"] += 1
        return self._meta(inputs, width, graphed, n)

    def _graph_inputs(self, rows: int, width: int) -> StepInputs:
        """The persistent input buffer a graph of this shape reads (allocated once)."""
        inputs = self._inputs.get((rows, width))
        if inputs is None:
            inputs = self._inputs[(rows, width)] = StepInputs.allocate(rows, width, self.groups, self.device)
        return inputs

    def _meta(self, inputs: StepInputs, width: int, graphed: bool, n_rows: int) -> DecodeMeta:
        return DecodeMeta(inputs.positions, inputs.slots, inputs.tables, width, self.ops, ids=inputs.ids,
                          starts=inputs.starts, graphed=graphed, n_rows=n_rows)

    # ---- warm-up -----------------------------------------------------------------------
    @staticmethod
    def warmup_shapes(max_num_seqs: int, max_model_len: int, block_size: int) -> list[tuple[int, int]]:
        """Every (rows bucket, table width class) a plain decode step can take under these
        limits, largest first (:func:`decode_graphs.graph_shapes`)."""
        return graph_shapes(max_num_seqs, max_model_len, block_size)

    @staticmethod
    def warmup_mode() -> str:
        """``DEEPINFER_CUDA_GRAPH_WARMUP``: auto (CUDA), 0 (capture on first use), 1 (also emulated)."""
        mode = os.environ.get("DEEPINFER_CUDA_GRAPH_WARMUP", "auto").lower()
        if mode not in ("auto", "0", "1"):
            from deepinfer.errors import ConfigError
            raise ConfigError(f"DEEPINFER_CUDA_GRAPH_WARMUP={mode!r}: expected auto, 0 or 1",
                              field="DEEPINFER_CUDA_GRAPH_WARMUP")
        return mode

    def warms_up(self) -> bool:
        """Whether :meth:`warmup` captures the graph set (and then seals it)."""
        mode = self.warmup_mode()
        return self.graphs_enabled and mode != "0" and not (mode == "auto" and self.device.type != "cuda")

    def _dummy_meta(self, rows: int, width: int) -> DecodeMeta:
        """A shape's persistent inputs set to the dummy step: ids 0, position 0, slot 0, block 0
        for every row, one row per group."""
        inputs = self._graph_inputs(rows, width)
        inputs.fill_dummy()
        return self._meta(inputs, width, True, rows)

    def warmup(self, max_num_seqs: int, max_model_len: int, block_size: int) -> int:
        """Capture the decode graphs of :meth:`warmup_shapes` (CUDA with graphs on, unless
        ``DEEPINFER_CUDA_GRAPH_WARMUP=0``; ``=1`` also emulates them on a host cache: tests),
        then seal the set; returns how many shapes it captured. On CUDA the set's device
        bytes are measured (:attr:`graph_bytes`) and the eager warm-ups' cached blocks returned."""
        if not self.warms_up():
            return 0
        shapes = [s for s in self.warmup_shapes(max_num_seqs, max_model_len, block_size)
                  if not self.graphs.has(s)]
        self.graph_bytes = self._capture_set(shapes)
        self.warmed += shapes
        self.max_graph_batch = max((r for r, _ in self.warmed), default=self.max_graph_batch)
        self.graphs.seal()
        return len(shapes)

    def _capture_set(self, shapes: list[tuple[int, int]]) -> int | None:
        """Capture ``shapes`` in this order into the set's one pool, each on its persistent
        input buffer set to the dummy step; the device bytes this took (pool + input buffers,
        after returning the eager runs' cached blocks; None off CUDA). The warm-up and the
        memory probe both capture through here, so the probe measures what the warm-up takes."""
        before = reserved_bytes(self.device)
        for rows, width in shapes:
            self.graphs.capture((rows, width), self._dummy_meta(rows, width), self._logits_reduced)
        after = reserved_bytes(self.device)
        return None if before is None or after is None else after - before

    def probe_graph_memory(self, shapes: list[tuple[int, int]]) -> GraphMemory:
        """Measure the decode graph set of ``shapes`` (largest first) on this throwaway runner
        (:class:`GraphMemory`), then drop it: the memory profile's run before the KV cache is
        sized. The largest shape runs eagerly first (its Triton kernels compile, its peak in
        the regular allocator is measured, its outputs give the per-row bytes). On CUDA the
        whole set is then captured exactly as :meth:`warmup` will capture it and its bytes
        measured: the pool's temporaries overlap other graphs' outputs and the allocator's
        segments fragment, so no sum over shapes predicts it (the decode grid's results
        compare the old sum with the warm-up's measurement). What the capture leaves
        allocated after the set is dropped (e.g. library workspaces bound to the capture streams) stays
        allocated for the engine's life, so it counts as used memory, not as the set's."""
        rows, width = shapes[0]
        meta = self._dummy_meta(rows, width)
        set_bytes = eager_peak = leftover = None
        cuda = self.device.type == "cuda"
        if cuda:
            reserved_bytes(self.device)  # synchronized, cache returned
            torch.cuda.reset_peak_memory_stats(self.device)
            allocated = torch.cuda.memory_allocated(self.device)
        out = self._logits_reduced(meta)  # eager: compiles (and fuses weights) before anything is measured
        if cuda:
            torch.cuda.synchronize(self.device)
            eager_peak = int(torch.cuda.max_memory_allocated(self.device) - allocated)
        per_row = tuple(t.numel() * t.element_size() // rows for t in tensors_of(out))
        del out, meta
        self._inputs.clear()  # the warm-up allocates every input buffer inside its measurement
        if cuda:
            base = reserved_bytes(self.device)
            measured = self._capture_set(list(shapes))
            self.graphs.release()
            self._inputs.clear()
            leftover = reserved_bytes(self.device) - base
            set_bytes = measured - leftover
        return GraphMemory((rows, width), set_bytes, per_row, eager_peak, len(self.groups), tuple(shapes), leftover)

    # ---- execution -------------------------------------------------------------------
    @staticmethod
    def batch_of(meta: DecodeMeta) -> ForwardBatch:
        """The batch a decode program runs over the rows of ``meta``."""
        batch = ForwardBatch(meta.ids, meta.positions, [])
        batch.decode = meta
        return batch

    def _logits(self, meta: DecodeMeta, capture: dict | None = None) -> torch.Tensor:
        return self.program.logits(self.model, self.batch_of(meta), self.cache, capture)

    def eager_logits(self, batch: ForwardBatch, capture: dict | None = None) -> torch.Tensor:
        """Logits [R, V] of a prepared step run eagerly (graphs bypassed); ``capture`` as in
        :func:`forward.decode_logits` (numerics studies)."""
        return self._logits(batch.decode, capture)

    def _streams(self, meta: DecodeMeta, layers: tuple[int, ...]) -> tuple[torch.Tensor, dict]:
        capture = dict.fromkeys(layers) if layers else None
        return self.program.streams(self.model, self.batch_of(meta), self.cache, capture), capture or {}

    def forward_streams(self, so: Any, batch: ForwardBatch, capture: dict | None = None) -> torch.Tensor | None:
        """Final streams [T, N, D] of a decode-like step (speculative verify: the spec runner
        computes its logits and drafts from them), from a CUDA graph per (rows bucket, table
        width, captured layers) when one fits, else eagerly; None when the step is not
        decode-like. ``capture`` as ``DeepseekV4Model.forward``'s (the drafter's layers)."""
        if self.program.streams is None:  # the family's verify rows stay on the reference path for now
            return None
        meta = self.prepare(so, batch)
        if meta is None:
            return None
        layers = tuple(sorted(capture)) if capture else ()
        if meta.graphed:
            self._counts["graph_steps"] += 1
            streams, hidden = self.graphs.replay(("streams", meta.ids.shape[0], meta.width, layers), meta,
                                                 lambda m: self._streams(m, layers))
        else:
            streams, hidden = self._streams(meta, layers)
        n = meta.n_rows
        for i in layers:
            capture[i] = hidden[i][:n]
        return streams[:n]

    def run(self, so: Any, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits [R, V] of a pure-decode step (``batch.decode`` from :meth:`prepare`):
        replayed from its CUDA graph (captured on first use) or run eagerly."""
        logits = self.run_graph(so, batch)
        return self._logits(batch.decode) if logits is None else logits

    def run_graph(self, so: Any, batch: ForwardBatch) -> torch.Tensor | None:
        """Float32 logits [R, V] from the step's CUDA graph, or None when it is not graphed
        (sets :attr:`reduced` for a graphed step, clears it otherwise)."""
        meta: DecodeMeta | None = batch.decode
        self.reduced = None
        if meta is None or not meta.graphed:
            return None
        self._counts["graph_steps"] += 1
        logits, red = self.graphs.replay((meta.ids.shape[0], meta.width), meta, self._logits_reduced)
        n = meta.n_rows
        self.reduced = GraphReductions(*(t[:n] for t in red))
        return logits[:n]

    def _logits_reduced(self, meta: DecodeMeta) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The graph body: logits, and their per-row argmax / log-sum-exp (a few us of GPU
        time; an all-greedy step then needs no sampling launch)."""
        logits = self._logits(meta)
        packed = torch.empty(logits.shape[0], 2, dtype=torch.int64, device=logits.device)
        tok, lse, lp = self.ops.argmax_logsumexp(logits, packed=packed)
        return logits, (packed, lse, tok, lp, meta.slots.long())
