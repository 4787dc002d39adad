"""Memory profiling before the KV cache is sized: the peak device memory one worst-case
step allocates on top of the weights.

The step is the largest the scheduler can issue: one fresh request of
``min(max_num_batched_tokens, max_model_len)`` prompt tokens through the prefill path the
engine will use (the fast path on NVIDIA), over a throwaway cache just big enough for
it, then the float32 logits and log-softmax of ``max_num_seqs`` rows (the sampler's
widest temporaries). ``torch.cuda.max_memory_allocated`` above the level before the step
is the activation peak (it includes the throwaway cache, so it errs on the safe side).

The decode CUDA graphs the engine captures at start (models/fast/decode_graphs.py) are
measured the same way before the cache exists: the whole set the limits allow is captured
over a one-block throwaway cache by the warm-up's own code and its bytes measured
(:meth:`FastPath.probe_graph_memory`; the warm-up later records what the set really took,
``FastPath.graph_bytes``, which the decode grid compares). :func:`profile_step_peak_bytes`
returns the larger of the two transient peaks plus the graphs' bytes, and
:func:`deepinfer.engine.kv_sizing.kv_budget_bytes` subtracts it from
``gpu_memory_utilization`` of the device before handing the rest to the KV cache.

Hosts without a device allocator to ask (CPU) return None: there the cache is sized from
``kv_cache_memory_bytes`` (tests run :func:`worst_case_step` itself on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.config import EngineConfig
from deepinfer.engine.prefill_warmup import warm_prefill_kinds, warm_sampler
from deepinfer.models.fast.decode_graphs import GraphMemory
from deepinfer.models.paged_batch import ForwardBatch, SeqMeta
from deepinfer.models.registry import family_of

#: Kept free for decode CUDA graphs captured on first use (``DEEPINFER_CUDA_GRAPH_WARMUP=0``,
#: speculative decoding's verify graphs), which no profile run can size. Not measured: a
#: margin over the largest graph's logits (256 rows x 129,280 float32 = 132 MB) plus its
#: activations.
LAZY_GRAPH_RESERVE_BYTES = 512 << 20


def speculative_graph_bytes(model_cfg: Any, config: EngineConfig) -> int:
    """Device bytes the speculative graph sets hold in their pools beyond the lazy reserve:
    the float32 logits of their largest buckets (captured after the KV cache is sized, so
    they must be kept free up front). The verify graphs' greedy lane holds up to
    ``greedy_lane_max_rows(vocab)`` rows; the MTP stage's graphs a catch-up of every request's k + 1
    rows; DSpark's draft graphs every block's gamma rows plus, in the sampling mode, the
    draft distributions of its n drafts."""
    from deepinfer.models.fast.decode_graphs import BUCKETS, rows_bucket
    from deepinfer.models.fast.verify_graphs import greedy_lane_max_rows, verify_row_buckets

    k = config.num_speculative_tokens
    if k <= 0:
        return 0
    rows = verify_row_buckets(config.max_num_seqs, k)
    cap = greedy_lane_max_rows(model_cfg.vocab_size)
    lane = max((r for r in rows if r <= cap), default=0)
    if model_cfg.has_dspark:
        blocks = rows_bucket(config.max_num_seqs) or BUCKETS[-1]
        gamma = model_cfg.dspark_block_size
        draft = blocks * (gamma + min(k, gamma))
    else:
        draft = rows[-1]
    return 4 * model_cfg.vocab_size * (lane + draft)


@dataclass(frozen=True)
class MemoryProfile:
    """What the KV budget keeps free besides the weights: ``step_peak_bytes`` (the worst
    step's activation peak), ``graph_bytes`` (the decode graph set, bounded from ``graph``,
    the probe's measurement; or the lazy reserve; 0 without graphs)."""

    step_peak_bytes: int
    graph_bytes: int
    graph: GraphMemory | None = None

    @property
    def total(self) -> int:
        """Bytes to keep free: the larger transient peak (the eager prefill step, or the
        probe's eager decode step; both in the regular allocator) plus the graphs' pool."""
        eager = self.graph.eager_peak_bytes if self.graph is not None else None
        return max(self.step_peak_bytes, eager or 0) + self.graph_bytes


@torch.no_grad()
def profile_memory(model: torch.nn.Module, config: EngineConfig, device: torch.device) -> MemoryProfile | None:
    """The worst-case step's peak and the decode graphs' bytes on ``device`` (CUDA), or None.
    Also compiles the other prefill step kinds (deepinfer/engine/prefill_warmup.py)."""
    if device.type != "cuda":
        return None
    graph, graph_bytes = decode_graph_memory(model, config, device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    worst_case_step(model, config, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    warm_prefill_kinds(model, config, device)  # the other prefill kinds' compiles, off the first generate
    warm_sampler(model.cfg.vocab_size, device)  # and the sampler's (every prefill step samples through it)
    torch.cuda.empty_cache()
    return MemoryProfile(int(peak), graph_bytes, graph)


def keep_step_memory(profile: MemoryProfile | None, device: torch.device) -> int:
    """Leave the worst step's activation peak cached in the device allocator (one block,
    freed at once): the start-up profile and graph capture returned the allocator's cache
    to the driver, so the first ``generate()`` would otherwise pay a cudaMalloc for each
    of its large activations. The bytes are already kept free beside the KV cache
    (``MemoryProfile.total``). Returns the bytes held (0 off CUDA or without a profile)."""
    if profile is None or device.type != "cuda" or profile.step_peak_bytes <= 0:
        return 0
    torch.empty(int(profile.step_peak_bytes), dtype=torch.uint8, device=device)
    return int(profile.step_peak_bytes)


def profile_step_peak_bytes(model: torch.nn.Module, config: EngineConfig, device: torch.device) -> int | None:
    """Bytes a worst-case step and the decode graphs take beyond what is allocated now
    (:attr:`MemoryProfile.total`; CUDA), or None."""
    prof = profile_memory(model, config, device)
    return None if prof is None else prof.total


@torch.no_grad()
def decode_graph_memory(model: torch.nn.Module, config: EngineConfig,
                        device: torch.device) -> tuple[GraphMemory | None, int]:
    """(the probe's measurement, bytes to keep for the engine's decode graph set). The
    engine warms up every shape of ``FastPath.warmup_shapes`` unless graphs are off, the
    family has no compiled decode, or batch-invariant / speculative decoding keeps the
    warm-up off (then shapes captured on first use get :data:`LAZY_GRAPH_RESERVE_BYTES`).
    The probe runs on a one-block cache: the warm-up's dummy steps read block 0 only."""
    family = family_of(model.cfg)
    if family.decode_executor is None or config.batch_invariant:
        return None, 0
    groups = family.kv_group_names(model.cfg)
    cache = family.new_kv_cache(model.cfg, dict.fromkeys(groups, 1), config.block_size, 1, model.dtype, device)
    fast = family.decode_executor(model, cache)
    if fast is None or not fast.graphs_enabled:
        return None, 0
    if config.num_speculative_tokens > 0 or not fast.warms_up():
        lazy = LAZY_GRAPH_RESERVE_BYTES + speculative_graph_bytes(model.cfg, config)
        return None, lazy if device.type == "cuda" else 0
    shapes = fast.warmup_shapes(config.max_num_seqs, config.max_model_len, config.block_size)
    mem = fast.probe_graph_memory(shapes)
    return mem, mem.bound(shapes)


@torch.no_grad()
def worst_case_step(model: torch.nn.Module, config: EngineConfig, device: torch.device) -> torch.Tensor:
    """Run the profiled step (see the module doc) over a throwaway cache on ``device``;
    returns its log-probs [max_num_seqs, vocab]. Nothing it allocates outlives it."""
    mcfg = model.cfg
    tokens = max(1, min(config.max_num_batched_tokens, config.max_model_len))
    bs = config.block_size
    blocks = -(-tokens // bs) + 1
    family = family_of(mcfg)
    groups = family.kv_group_names(mcfg)
    cache = family.new_kv_cache(mcfg, {g: blocks for g in groups}, bs, 1, model.dtype, device)
    table = {g: list(range(blocks)) for g in groups}
    seqs = [SeqMeta(0, tokens, 0, table, 0, is_new=True, prompt_len=tokens)]
    ids = torch.randint(0, mcfg.vocab_size, (tokens,), device=device)
    batch = ForwardBatch(ids, torch.arange(tokens, device=device), seqs)
    # the family's compiled prefill executor, as ModelRunner builds it: the path the engine takes
    prefill = family.prefill_executor(model, cache) if family.prefill_executor is not None else None
    meta = prefill.prepare(batch) if prefill is not None else None
    last = torch.full((1,), tokens - 1, dtype=torch.long, device=device)
    streams = prefill.forward(batch, meta, last) if meta is not None else model(batch, cache)[last]
    rows = streams.expand(config.max_num_seqs, *streams.shape[1:]).contiguous()
    return torch.log_softmax(model.compute_logits(rows), dim=-1)
