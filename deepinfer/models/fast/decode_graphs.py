"""The decode CUDA graphs of the fast path: which shapes exist, their capture, and their memory.

Shapes. A decode step is keyed by (rows bucket, table-width class): rows round up to a
bucket of ``BUCKETS``, and the block-table width (the longest table of the step, in blocks)
rounds up to a power of two, so a step's kernels iterate the blocks of its own width class
(a 1k-token batch reads 8-block tables even on a 1M-token engine). :func:`graph_shapes` lists
every shape an engine's limits allow (rows up to the bucket holding ``max_num_seqs``, widths
up to the class of a ``max_model_len`` context); ``FastPath.warmup`` captures all of them at
start, largest first, into one memory pool, then :meth:`DecodeGraphs.seal` closes the set:
a step whose shape is missing (more rows than the largest bucket: a verify step, several
short last chunks) runs eagerly on the same padded buffers and is counted
(``stats["uncaptured_steps"]``), but nothing is captured while serving. Without a warm-up
(``DEEPINFER_CUDA_GRAPH_WARMUP=0``, speculative decoding) shapes are captured on first use.

Memory. The graphs share one private pool. Temporaries of one capture are free again when
the next one starts and later graphs' outputs (they stay allocated: a replay writes them)
are carved out of them, so the pool is neither the largest graph's temporaries plus
every output (that sum over-counts when the largest graph's temporaries are big, as at
``max_model_len`` 1M) nor free of fragmentation (it under-counts when outputs dominate);
profiling/results/decode_grid_h200_*.json records both. Each shape also has a persistent
input buffer outside the pool. :class:`GraphMemory` is therefore measured, before the KV cache
is sized (``deepinfer/engine/memory_profile.py``): the whole set captured over a
throwaway one-block cache in the warm-up's order through the warm-up's own code; the
engine's warm-up then measures what the set really took (``FastPath.graph_bytes``).

On a host cache (CPU tests) graphs are emulated: a "capture" records the shape and a
replay runs the step eagerly on the padded buffers, so coverage, sealing and the shape a
step takes are the same as on a GPU.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# The CUDA caching allocator's rounding (c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize,
# kSmallSize, kRoundLarge): requests up to 1 MiB round to 512 bytes inside shared 2 MiB
# segments, larger ones to 2 MiB.
_MIN_BLOCK = 512
_SMALL = 1 << 20
_ROUND_LARGE = 2 << 20


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def rows_bucket(n: int) -> int | None:
    """The bucket a step of ``n`` rows pads to, None above the largest."""
    return next((b for b in BUCKETS if b >= n), None)


def width_class(blocks: int) -> int:
    """The table width (blocks) a step whose longest table has ``blocks`` blocks runs at."""
    return next_pow2(max(blocks, 1))


def graph_shapes(max_num_seqs: int, max_model_len: int, block_size: int) -> list[tuple[int, int]]:
    """Every (rows bucket, width class) a plain decode step can take under these limits,
    largest first: buckets up to the first one holding ``max_num_seqs`` rows (the largest
    when none does), widths up to the class of the longest table a decode step can have:
    ``max_model_len - 1`` tokens (the last step feeds position ``max_model_len - 2`` and
    samples the request's last token; a wider class would double the widest graphs, and the
    probe's largest temporaries, for power-of-two lengths)."""
    for name, value in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                        ("block_size", block_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"graph_shapes: {name} must be an int >= 1, got {value!r}")
    top = rows_bucket(max_num_seqs) or BUCKETS[-1]
    rows = [b for b in BUCKETS if b <= top]
    widest = width_class(-(-max(max_model_len - 1, 1) // block_size))
    widths = [1 << i for i in range(widest.bit_length())]
    return sorted(((r, w) for r in rows for w in widths), key=lambda rw: (-rw[0], -rw[1]))


def allocation_bytes(nbytes: int) -> int:
    """Bytes the CUDA caching allocator reserves for one tensor of ``nbytes``."""
    if nbytes <= 0:
        return 0
    unit = _MIN_BLOCK if nbytes <= _SMALL else _ROUND_LARGE
    return -(-nbytes // unit) * unit


def input_bytes(rows: int, width: int, n_groups: int) -> int:
    """Bytes of one shape's persistent int32 input buffer (``StepInputs``)."""
    return 4 * (4 * rows + 1 + n_groups * width * rows)


@dataclass(frozen=True)
class GraphMemory:
    """What a decode graph set takes, measured on a throwaway runner before the KV cache exists.

    ``probe``: the largest shape, run eagerly; ``pool_bytes``: device bytes the whole set of
    ``shapes`` took when captured as the warm-up captures it (pool + input buffers; None on
    a host: no allocator to ask); ``output_row_bytes``: bytes per row of each static output
    tensor (from the eager run); ``eager_peak_bytes``: that run's peak in the regular
    allocator (None on a host); ``n_groups``: block groups; ``shapes``: the set measured;
    ``left_bytes``: what the capture left allocated once the set was dropped (kept for the
    engine's life, so counted as used memory and not in ``pool_bytes``; None on a host)."""

    probe: tuple[int, int]
    pool_bytes: int | None
    output_row_bytes: tuple[int, ...]
    eager_peak_bytes: int | None
    n_groups: int
    shapes: tuple[tuple[int, int], ...] = ()
    left_bytes: int | None = None

    def outputs_bytes(self, rows: int) -> int:
        """Allocator bytes of one graph's static outputs at ``rows`` rows."""
        return sum(allocation_bytes(b * rows) for b in self.output_row_bytes)

    def bound(self, shapes: list[tuple[int, int]]) -> int:
        """Bytes the graph set of ``shapes`` takes: the measurement when it covers exactly
        these shapes; otherwise (a host, or another set) every graph's static outputs plus
        every shape's input buffer, a floor that leaves out the capture's temporaries."""
        if self.pool_bytes is not None and tuple(shapes) == self.shapes:
            return int(self.pool_bytes)
        outputs = sum(self.outputs_bytes(r) for r, _ in shapes)
        inputs = sum(allocation_bytes(input_bytes(r, w, self.n_groups)) for r, w in shapes)
        return int(outputs + inputs)


def tensors_of(out: Any) -> list[torch.Tensor]:
    """The tensors of a graph body's output (a tensor or nested tuples / lists of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in tensors_of(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in tensors_of(o)]
    return []


class DecodeGraphs:
    """The captured decode graphs of one runner (one pool), or their host emulation."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.emulated = device.type != "cuda"
        self._entries: dict[tuple, tuple[Any, Any]] = {}  # key -> (graph, its static outputs); CUDA only
        self.captured: list[tuple] = []  # keys in capture order
        self._captured_set: set[tuple] = set()
        self._pool = None
        self.sealed = False
        #: replays per key: which graph each step took (tests, the decode grid)
        self.replays: Counter = Counter()
        self.stats = {"captures": 0, "uncaptured_steps": 0}

    def has(self, key: tuple) -> bool:
        return key in self._captured_set

    def seal(self) -> None:
        """No capture from now on: a missing shape runs eagerly (counted)."""
        self.sealed = True

    def replay(self, key: tuple, arg: Any, fn: Callable[[Any], Any]) -> Any:
        """``fn(arg)``'s outputs from the graph of ``key`` (captured on first use unless sealed,
        after an eager warm-up: decode writes are idempotent); eager when sealed and missing,
        and on a host cache."""
        if key not in self._captured_set:
            if self.sealed:
                self.stats["uncaptured_steps"] += 1
                return fn(arg)
            self.capture(key, arg, fn)
        self.replays[key] += 1
        if self.emulated:
            return fn(arg)
        graph, out = self._entries[key]
        graph.replay()
        return out

    def capture(self, key: tuple, arg: Any, fn: Callable[[Any], Any], pool: Any = "shared") -> Any:
        """Capture ``fn(arg)`` as the graph of ``key`` (an eager run first: Triton compiles);
        returns its static outputs (None when emulated). ``pool=None``: a fresh pool of its
        own (the memory probe), else the set's shared one."""
        if key in self._captured_set:
            raise RuntimeError(f"decode graph {key} is already captured")
        if self.sealed:
            raise RuntimeError(f"decode graph {key}: the graph set is sealed (nothing is captured while serving)")
        self._captured_set.add(key)
        self.captured.append(key)
        self.stats["captures"] += 1
        if self.emulated:
            return None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up (Triton compiles)
            fn(arg)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        shared = pool == "shared"
        # thread_local: the async engine may run steps in a worker thread while the main one schedules
        with torch.cuda.graph(graph, pool=self._pool if shared else None, capture_error_mode="thread_local"):
            out = fn(arg)
        if shared and self._pool is None:
            self._pool = graph.pool()
        self._entries[key] = (graph, out)
        return out

    def release(self) -> None:
        """Drop every graph and its pool (the memory probe's throwaway set)."""
        self._entries.clear()
        self._captured_set.clear()
        self.captured.clear()
        self._pool = None


def reserved_bytes(device: torch.device) -> int | None:
    """Bytes the device allocator holds now, after returning its unused cache (None off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_reserved(device))


__all__ = ["BUCKETS", "DecodeGraphs", "GraphMemory", "allocation_bytes", "graph_shapes", "input_bytes",
           "next_pow2", "reserved_bytes", "rows_bucket", "tensors_of", "width_class"]
