"""Runner side of the fast path: picks it, builds the per-step device tensors of a
pure-decode step once, and runs such steps through CUDA graphs.

Selection (``FastPath.create``): the model is a plain ``DeepseekV4Model`` (not V4.1) in
bf16 / fp16, the cache lives on a CUDA device and ``deepinfer_kernels`` imports -> Triton
kernels (``DEEPINFER_FASTPATH=1`` also takes float32 models).
``DEEPINFER_FASTPATH=0`` turns it off; ``=ref`` / ``=triton`` force it on a host cache
with the kernels' torch references / the interpreted kernels (CPU tests; graphs are then
emulated eagerly on the same padded buffers when ``DEEPINFER_CUDA_GRAPHS=1``);
``DEEPINFER_ACCELERATOR=cpu`` keeps the reference path (the cache is then on the host).
``DEEPINFER_CUDA_GRAPHS=0`` keeps CUDA decode eager.

CUDA graphs: one graph per (batch bucket 1, 2, 4, ..., max_graph_batch; table width),
captured the first time a pure-decode step of that shape runs (after an eager warm-up
of the same step, which is harmless: every decode write is idempotent), all in one
memory pool. Rows past the real batch repeat row 0 (same request, same slot, same
position), so they write exactly what row 0 writes and need no dummy block or slot.
A graph computes the logits of every row; the runner reads the first R.
"""

from __future__ import annotations

import os
from typing import Any

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


class FastPath:
    unavailable: str | None = None  # why the kernels did not import, if they did not

    def __init__(self, model: Any, cache: Any, ops: Any, graphs: bool) -> None:
        self.model, self.cache, self.ops = model, cache, ops
        self.device = cache.swa[0].device
        self.groups = [g for g in ("swa", "csa", "hca") if g in cache.num_blocks]
        self.graphs_enabled = graphs
        self.max_graph_batch = BUCKETS[-1]
        self._graphs: dict[tuple[int, int], tuple[Any, dict, torch.Tensor]] = {}
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

    def _host_rows(self, so: Any, width: int, rows: int) -> torch.Tensor:
        """[rows, 3 + G * width] int64: input id, position, slot, then each group's table
        (padded with 0); rows past the batch repeat row 0."""
        out = []
        for r in so.scheduled:
            row = [0, r.start_pos, r.state_slot]  # ids come from the device batch (_set_ids)
            for g in self.groups:
                t = list(r.block_table[g])[:width]
                row += t + [0] * (width - len(t))
            out.append(row)
        out += [out[0]] * (rows - len(out))
        return torch.tensor(out, dtype=torch.int64)

    def _meta(self, packed: torch.Tensor, width: int) -> tuple[torch.Tensor, DecodeMeta]:
        """Split a packed [R, 3 + G * width] device tensor (device ops only: graph-safe)."""
        tables = {g: packed[:, 3 + i * width:3 + (i + 1) * width] for i, g in enumerate(self.groups)}
        tables32 = {g: t.to(torch.int32) for g, t in tables.items()}
        return packed[:, 0].contiguous(), DecodeMeta(packed[:, 1].contiguous(), packed[:, 2].contiguous(), tables,
                                                     tables32, width, self.ops)

    def _width(self, so: Any) -> int:
        need = max(len(r.block_table[g]) for r in so.scheduled for g in self.groups)
        return _next_pow2(max(need, 1))

    def prepare(self, so: Any, batch: ForwardBatch) -> DecodeMeta | None:
        """Device tensors of a pure-decode step (None for prefill / mixed steps)."""
        if not self._pure_decode(so):
            return None
        width = self._width(so)
        packed = self._host_rows(so, width, len(so.scheduled)).to(self.device)
        _, meta = self._meta(packed, width)
        meta.positions = batch.positions  # already on the device
        self.stats["fast_steps"] += 1
        return meta

    # ---- CUDA graphs -----------------------------------------------------------------
    def _forward_logits(self, packed: torch.Tensor, width: int) -> torch.Tensor:
        ids, meta = self._meta(packed, width)
        batch = ForwardBatch(ids, meta.positions, [])
        batch.decode = meta
        return decode_logits(self.model, batch, self.cache)

    def run(self, so: Any, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits [R, V] of a pure-decode step (``batch.decode`` from :meth:`prepare`):
        from its CUDA graph when one fits, else eagerly."""
        logits = self.run_graph(so, batch)
        return decode_logits(self.model, batch, self.cache) if logits is None else logits

    @staticmethod
    def _set_ids(packed: torch.Tensor, input_ids: torch.Tensor, n: int) -> None:
        """Token ids from the device batch (async scheduling fills its placeholders there, never
        on the host); padded rows stay exact copies of row 0."""
        packed[:n, 0] = input_ids
        packed[n:, 0] = input_ids[0]

    def run_graph(self, so: Any, batch: ForwardBatch) -> torch.Tensor | None:
        """Float32 logits [R, V] of a pure-decode step from its CUDA graph (captured on
        first use), or None when the step does not fit a graph."""
        n = len(so.scheduled)
        if (not self.graphs_enabled or batch.decode is None or n > self.max_graph_batch
                or not all(r.needs_sample for r in so.scheduled)):
            return None
        bucket = next(b for b in BUCKETS if b >= n)
        width = batch.decode.width
        host = self._host_rows(so, width, bucket)
        entry = self._graphs.get((bucket, width))
        if entry is None and self.device.type != "cuda":  # host emulation (tests): same buffers, eager
            entry = self._graphs[(bucket, width)] = (None, host.to(self.device), None)
        if entry is None:
            packed = host.to(self.device)
            self._set_ids(packed, batch.input_ids, n)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up (Triton compiles); decode writes are idempotent
                self._forward_logits(packed, width)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the async engine runs steps in a worker thread while the main one schedules
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = self._forward_logits(packed, width)
            if self._pool is None:
                self._pool = graph.pool()
            entry = self._graphs[(bucket, width)] = (graph, packed, logits)
            self.stats["captures"] += 1
        graph, packed, logits = entry
        packed.copy_(host, non_blocking=False)
        self._set_ids(packed, batch.input_ids, n)
        if graph is None:
            logits = self._forward_logits(packed, width)
        else:
            graph.replay()
        self.stats["graph_steps"] += 1
        return logits[:n]
