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

Inputs: one int32 buffer per (rows, table width) holds ids | positions | slots | every
group's block table as contiguous views (:class:`StepInputs`); a step costs one pinned
host -> device copy plus the device copy of its token ids (async scheduling fills those
on the device), and nothing is rebuilt inside the graph.

CUDA graphs: one graph per (batch bucket 1, 2, 4, ..., max_graph_batch; table width),
captured the first time a pure-decode step of that shape runs (after an eager warm-up
of the same step, which is harmless: every decode write is idempotent), all in one
memory pool. Rows past the real batch repeat row 0 (same request, same slot, same
position), so they write exactly what row 0 writes and need no dummy block or slot.
A graph computes the logits of every row; the runner reads the first R.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deepinfer.config import register_env_var

from ..kv_cache import ForwardBatch
from .decode import DecodeMeta, kernel_ops
from .forward import decode_logits
from .moe import supported as moe_supported

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

register_env_var("DEEPINFER_FASTPATH", "auto|0|1|ref|triton: fast path of pure-decode steps (auto = bf16/fp16 on CUDA, 1 = any dtype; "
                 "ref / triton force it on the host with the torch references / interpreted kernels: tests)")
register_env_var("DEEPINFER_CUDA_GRAPHS", "0|1 (default 1): CUDA graphs of pure-decode steps on the fast path")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class StepInputs:
    """Device int32 inputs of a decode step with ``rows`` rows: views of one flat buffer."""

    flat: torch.Tensor
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    tables: dict[str, torch.Tensor]

    @classmethod
    def allocate(cls, rows: int, width: int, groups: list[str], device: torch.device) -> StepInputs:
        flat = torch.zeros((3 + len(groups) * width) * rows, dtype=torch.int32, device=device)
        tables = {g: flat[(3 + i * width) * rows:(3 + (i + 1) * width) * rows].view(rows, width)
                  for i, g in enumerate(groups)}
        return cls(flat, flat[:rows], flat[rows:2 * rows], flat[2 * rows:3 * rows], tables)


class FastPath:
    unavailable: str | None = None  # why the kernels did not import, if they did not

    def __init__(self, model: Any, cache: Any, ops: Any, graphs: bool) -> None:
        self.model, self.cache, self.ops = model, cache, ops
        self.device = cache.swa[0].device
        self.groups = [g for g in ("swa", "csa", "hca") if g in cache.num_blocks]
        self.graphs_enabled = graphs
        self.max_graph_batch = BUCKETS[-1]
        self._inputs: dict[tuple[int, int], StepInputs] = {}  # persistent per graph shape
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self._pool = None
        self.stats = {"fast_steps": 0, "graph_steps": 0, "captures": 0}

    @classmethod
    def create(cls, model: Any, cache: Any) -> FastPath | None:
        from ..deepseek_v4 import DeepseekV4Model

        mode = os.environ.get("DEEPINFER_FASTPATH", "auto").lower()
        if mode in ("0", "off", "false", "no") or type(model) is not DeepseekV4Model:
            return None
        if getattr(model.cfg, "is_v41", False):
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
    def _pure_decode(self, so: Any) -> bool:
        return bool(so.scheduled) and all(r.num_tokens == 1 and not r.is_new for r in so.scheduled) and all(
            moe_supported(layer.ffn) for layer in self.model.layers)

    def _graphed(self, so: Any) -> bool:
        return (self.graphs_enabled and len(so.scheduled) <= self.max_graph_batch
                and all(r.needs_sample for r in so.scheduled))

    def _host_inputs(self, so: Any, width: int, rows: int) -> torch.Tensor:
        """The flat int32 layout of :class:`StepInputs` on the host (pinned on CUDA: the
        copy never makes the host wait for the stream); rows past the batch repeat row 0,
        ids are filled on the device."""
        n = len(so.scheduled)
        head = np.zeros((3, rows), dtype=np.int32)
        head[1, :n] = [r.start_pos for r in so.scheduled]
        head[2, :n] = [r.state_slot for r in so.scheduled]
        tables = np.zeros((len(self.groups), rows, width), dtype=np.int32)
        for j, r in enumerate(so.scheduled):
            for i, g in enumerate(self.groups):
                t = r.block_table[g][:width]
                tables[i, j, :len(t)] = t
        head[:, n:], tables[:, n:] = head[:, :1], tables[:, :1]
        flat = torch.from_numpy(np.concatenate([head.ravel(), tables.ravel()]))
        return flat.pin_memory() if self.device.type == "cuda" else flat

    def _width(self, so: Any) -> int:
        need = max(len(r.block_table[g]) for r in so.scheduled for g in self.groups)
        return _next_pow2(max(need, 1))

    def prepare(self, so: Any, batch: ForwardBatch) -> DecodeMeta | None:
        """Fill the step's device inputs (None for prefill / mixed steps). Graphed steps use
        their bucket's persistent buffer (padded rows repeat row 0)."""
        if not self._pure_decode(so):
            return None
        n, width = len(so.scheduled), self._width(so)
        graphed = self._graphed(so)
        rows = next(b for b in BUCKETS if b >= n) if graphed else n
        inputs = self._inputs.get((rows, width)) if graphed else None
        if inputs is None:
            inputs = StepInputs.allocate(rows, width, self.groups, self.device)
            if graphed:
                self._inputs[(rows, width)] = inputs
        inputs.flat.copy_(self._host_inputs(so, width, rows), non_blocking=True)
        inputs.ids[:n].copy_(batch.input_ids)  # async scheduling gathers placeholders on the device
        if rows > n:
            inputs.ids[n:].copy_(inputs.ids[:1].expand(rows - n))
        self.stats["fast_steps"] += 1
        return DecodeMeta(inputs.positions, inputs.slots, inputs.tables, width, self.ops, ids=inputs.ids,
                          graphed=graphed)

    # ---- execution -------------------------------------------------------------------
    def _logits(self, meta: DecodeMeta, capture: dict | None = None) -> torch.Tensor:
        batch = ForwardBatch(meta.ids, meta.positions, [])
        batch.decode = meta
        return decode_logits(self.model, batch, self.cache, capture)

    def eager_logits(self, batch: ForwardBatch, capture: dict | None = None) -> torch.Tensor:
        """Logits [R, V] of a prepared step run eagerly (graphs bypassed); ``capture`` as in
        :func:`forward.decode_logits` (numerics studies)."""
        return self._logits(batch.decode, capture)

    def run(self, so: Any, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits [R, V] of a pure-decode step (``batch.decode`` from :meth:`prepare`):
        replayed from its CUDA graph (captured on first use) or run eagerly."""
        logits = self.run_graph(so, batch)
        return self._logits(batch.decode) if logits is None else logits

    def run_graph(self, so: Any, batch: ForwardBatch) -> torch.Tensor | None:
        """Float32 logits [R, V] from the step's CUDA graph, or None when it is not graphed."""
        meta: DecodeMeta | None = batch.decode
        if meta is None or not meta.graphed:
            return None
        n, key = len(so.scheduled), (meta.ids.shape[0], meta.width)
        self.stats["graph_steps"] += 1
        if self.device.type != "cuda":  # host emulation (tests): the padded buffers, eagerly
            return self._logits(meta)[:n]
        entry = self._graphs.get(key)
        if entry is None:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up (Triton compiles); decode writes are idempotent
                self._logits(meta)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the async engine may run steps in a worker thread while the main one schedules
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = self._logits(meta)
            if self._pool is None:
                self._pool = graph.pool()
            entry = self._graphs[key] = (graph, logits)
            self.stats["captures"] += 1
        graph, logits = entry
        graph.replay()
        return logits[:n]
