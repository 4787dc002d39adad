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

CUDA graphs: one graph per (batch bucket 1, 2, 4, ..., max_graph_batch; table width), all
in one memory pool. :meth:`FastPath.warmup` (at engine start) captures every shape the
engine's limits allow, the largest first so that the smaller graphs reuse the pool the
largest allocated, on dummy steps that write only block 0 / state slot 0 at position 0
(overwritten or reset before any request reads them); a shape still missing is captured
the first time a pure-decode step of it runs (after an eager warm-up of the same step,
which is harmless: every decode write is idempotent). Rows past the real batch repeat
row 0 (same request, same slot, same position), so they write exactly what row 0 writes
and need no dummy block or slot.
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

from ..kv_cache import ForwardBatch
from .decode import DecodeMeta, kernel_ops
from .moe import supported as moe_supported

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: Most tokens of one request a step may feed on this path (a token + up to 7 drafts).
MAX_ROWS = 8

# DEEPINFER_FASTPATH, DEEPINFER_CUDA_GRAPHS, DEEPINFER_CUDA_GRAPH_WARMUP: declared in deepinfer/envs.py


@dataclass(frozen=True)
class DecodeProgram:
    """A family's batched decode forward: ``logits(model, batch, cache, capture)`` -> [R, V]
    float32, ``streams(...)`` -> the final streams a speculative verify step computes its
    logits and drafts from (None: that family's verify rows run on the reference path)."""

    logits: Any
    streams: Any = None


def decode_program(model: Any) -> DecodeProgram | None:
    """The model's family's decode program (models/registry.py), None without one."""
    from ..registry import family_of

    load = family_of(model.cfg).decode_program
    return load() if load is not None else None


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


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
        self.program = program or decode_program(model)
        self.graphs_enabled = graphs
        self.max_graph_batch = BUCKETS[-1]
        self._inputs: dict[tuple[int, int], StepInputs] = {}  # persistent per graph shape
        self._graphs: dict[tuple, tuple[Any, Any]] = {}  # key -> (graph, its static outputs)
        self._pool = None
        self.stats = {"fast_steps": 0, "graph_steps": 0, "captures": 0}
        #: the last graphed step's per-row reductions of its logits (views of the graph's
        #: outputs, valid until the next replay): packed [R, 2] int64 (argmax, its log-prob's
        #: float32 bits), logsumexp [R], argmax [R], argmax log-prob [R], state slots [R]
        self.reduced: GraphReductions | None = None
        self.warmed: list[tuple[int, int]] = []  # shapes :meth:`warmup` ran, in order
        self._moe_checked: tuple[tuple, bool] = ((), False)

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

    def _graphed(self, so: Any, n_rows: int) -> bool:
        return (self.graphs_enabled and n_rows <= self.max_graph_batch
                and all(r.needs_sample for r in so.scheduled))

    def _host_inputs(self, so: Any, width: int, rows: int) -> np.ndarray:
        """The flat int32 layout of :class:`StepInputs` on the host; rows past the batch repeat row 0
        (each its own group), ids are filled on the device. Built with one numpy
        conversion per field (per-request slice assignments: 442 vs 212 us for 64 requests
        on the CPU box)."""
        reqs = so.scheduled
        lens = [r.num_tokens for r in reqs]
        n, k = sum(lens), len(lens)
        head = np.zeros(4 * rows + 1, dtype=np.int32)
        pos, slot, starts = head[rows:2 * rows], head[2 * rows:3 * rows], head[3 * rows:]
        tables = np.zeros((len(self.groups), rows, width), dtype=np.int32)
        first = np.fromiter((r.start_pos for r in reqs), dtype=np.int32, count=k)
        ends = np.cumsum(lens)
        offsets = np.arange(n, dtype=np.int32) - np.repeat(ends - lens, lens)  # row index inside its request
        pos[:n] = np.repeat(first, lens) + offsets
        slot[:n] = np.repeat(np.fromiter((r.state_slot for r in reqs), dtype=np.int32, count=k), lens)
        for i, g in enumerate(self.groups):
            padded = [t + [0] * (width - len(t)) if len(t) < width else t[:width]
                      for t in (r.block_table[g] for r in reqs)]
            tables[i, :n] = np.repeat(np.array(padded, dtype=np.int32), lens, axis=0) if n > k else padded
        pos[n:], slot[n:], tables[:, n:] = pos[0], slot[0], tables[:, :1]
        starts[:k] = ends - lens
        starts[k:k + rows - n] = np.arange(n, rows)  # padded rows: one group each
        starts[k + rows - n:] = rows
        return np.concatenate([head, tables.ravel()])

    def _width(self, so: Any) -> int:
        need = max(len(r.block_table[g]) for r in so.scheduled for g in self.groups)
        return _next_pow2(max(need, 1))

    def prepare(self, so: Any, batch: ForwardBatch, eager: bool = False) -> DecodeMeta | None:
        """Fill the step's device inputs (None unless :meth:`_decode_like`). Graphed steps use
        their bucket's persistent buffer (padded rows repeat row 0); ``eager`` never pads."""
        if not self._decode_like(so):
            return None
        n, width = batch.num_tokens, self._width(so)
        graphed = not eager and self._graphed(so, n)
        rows = next(b for b in BUCKETS if b >= n) if graphed else n
        inputs = (self._graph_inputs(rows, width) if graphed
                  else StepInputs.allocate(rows, width, self.groups, self.device))
        copy_to_device(inputs.flat, self._host_inputs(so, width, rows))  # staged: never waits for the stream
        inputs.ids[:n].copy_(batch.input_ids)  # async scheduling gathers placeholders on the device
        if rows > n:
            inputs.ids[n:].copy_(inputs.ids[:1].expand(rows - n))
        self.stats["fast_steps"] += 1
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
        """Every (rows bucket, table width) a plain decode step can take under these limits,
        largest first: buckets up to the first one holding ``max_num_seqs`` rows, widths
        (powers of two) up to the blocks of a ``max_model_len`` context."""
        rows = [b for b in BUCKETS if b < max_num_seqs] + [next((b for b in BUCKETS if b >= max_num_seqs),
                                                                BUCKETS[-1])]
        widest = _next_pow2(-(-(max_model_len + 1) // block_size))
        widths = [1 << i for i in range(widest.bit_length())]
        return sorted({(r, w) for r in rows for w in widths}, key=lambda rw: (-rw[0], -rw[1]))

    def warmup(self, max_num_seqs: int, max_model_len: int, block_size: int) -> int:
        """Capture the decode graphs of :meth:`warmup_shapes` (CUDA with graphs on, unless
        ``DEEPINFER_CUDA_GRAPH_WARMUP=0``; ``=1`` also runs the same dummy steps eagerly on a
        host cache with emulated graphs: tests); returns how many ran."""
        mode = os.environ.get("DEEPINFER_CUDA_GRAPH_WARMUP", "auto").lower()
        if mode not in ("auto", "0", "1"):
            from deepinfer.errors import ConfigError
            raise ConfigError(f"DEEPINFER_CUDA_GRAPH_WARMUP={mode!r}: expected auto, 0 or 1")
        if not self.graphs_enabled or mode == "0" or (mode == "auto" and self.device.type != "cuda"):
            return 0
        shapes = self.warmup_shapes(max_num_seqs, max_model_len, block_size)
        for rows, width in shapes:
            inputs = self._graph_inputs(rows, width)
            inputs.flat.zero_()  # ids 0, position 0, slot 0, block 0 for every row ...
            inputs.starts.copy_(torch.arange(rows + 1, dtype=torch.int32, device=self.device))  # one row per group
            self._replay((rows, width), self._meta(inputs, width, True, rows), self._logits_reduced)
            self.warmed.append((rows, width))
        return len(shapes)

    # ---- execution -------------------------------------------------------------------
    def _logits(self, meta: DecodeMeta, capture: dict | None = None) -> torch.Tensor:
        batch = ForwardBatch(meta.ids, meta.positions, [])
        batch.decode = meta
        return self.program.logits(self.model, batch, self.cache, capture)

    def eager_logits(self, batch: ForwardBatch, capture: dict | None = None) -> torch.Tensor:
        """Logits [R, V] of a prepared step run eagerly (graphs bypassed); ``capture`` as in
        :func:`forward.decode_logits` (numerics studies)."""
        return self._logits(batch.decode, capture)

    def _streams(self, meta: DecodeMeta, layers: tuple[int, ...]) -> tuple[torch.Tensor, dict]:
        batch = ForwardBatch(meta.ids, meta.positions, [])
        batch.decode = meta
        capture = dict.fromkeys(layers) if layers else None
        return self.program.streams(self.model, batch, self.cache, capture), capture or {}

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
            streams, hidden = self._replay(("streams", meta.ids.shape[0], meta.width, layers), meta,
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
        logits, red = self._replay((meta.ids.shape[0], meta.width), meta, self._logits_reduced)
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

    def _replay(self, key: tuple, meta: DecodeMeta, fn: Any) -> Any:
        """``fn(meta)``'s outputs from the CUDA graph of ``key`` (captured on first use, after
        an eager warm-up: decode writes are idempotent); eager on a host cache (tests)."""
        self.stats["graph_steps"] += 1
        if self.device.type != "cuda":  # host emulation: the padded buffers, eagerly
            return fn(meta)
        entry = self._graphs.get(key)
        if entry is None:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up (Triton compiles)
                fn(meta)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the async engine may run steps in a worker thread while the main one schedules
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = fn(meta)
            if self._pool is None:
                self._pool = graph.pool()
            entry = self._graphs[key] = (graph, out)
            self.stats["captures"] += 1
        graph, out = entry
        graph.replay()
        return out
