"""Memory profiling before the KV cache is sized: the peak device memory one worst-case
step allocates on top of the weights.

The step is the largest the scheduler can issue: one fresh request of
``min(max_num_batched_tokens, max_model_len)`` prompt tokens through the prefill path the
engine will use (the fast path on NVIDIA), over a throwaway cache just big enough for
it, then the float32 logits and log-softmax of ``max_num_seqs`` rows (the sampler's
widest temporaries). ``torch.cuda.max_memory_allocated`` above the level before the step
is the activation peak (it includes the throwaway cache, so it errs on the safe side); :func:`deepinfer.engine.kv_sizing.kv_budget_bytes` subtracts it
(plus :data:`GRAPH_RESERVE_BYTES` for the decode CUDA graphs' pool) from
``gpu_memory_utilization`` of the device before handing the rest to the KV cache.

Hosts without a device allocator to ask (CPU) return None: there the cache is sized from
``kv_cache_memory_bytes`` (tests run :func:`worst_case_step` itself on CPU).
"""

from __future__ import annotations

import torch

from deepinfer.config import EngineConfig
from deepinfer.models.kv_cache import ForwardBatch, SeqMeta
from deepinfer.models.registry import family_of

#: Kept free for the decode CUDA graphs' memory pool (captured after the cache exists) and
#: allocator fragmentation. Not measured: a margin over the largest graph's logits
#: (256 rows x 129,280 float32 = 132 MB) plus its activations.
GRAPH_RESERVE_BYTES = 512 << 20


@torch.no_grad()
def profile_step_peak_bytes(model: torch.nn.Module, config: EngineConfig, device: torch.device) -> int | None:
    """Peak bytes a worst-case step allocates beyond what is allocated now (CUDA), or None."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    worst_case_step(model, config, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    return int(peak)


@torch.no_grad()
def worst_case_step(model: torch.nn.Module, config: EngineConfig, device: torch.device) -> torch.Tensor:
    """Run the profiled step (see the module doc) over a throwaway cache on ``device``;
    returns its log-probs [max_num_seqs, vocab]. Nothing it allocates outlives it."""
    from deepinfer.models.fast.prefill import PrefillPath

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
    prefill = PrefillPath.create(model, cache)  # the path the engine takes for this step
    meta = prefill.prepare(batch) if prefill is not None else None
    last = torch.full((1,), tokens - 1, dtype=torch.long, device=device)
    streams = prefill.forward(batch, meta, last) if meta is not None else model(batch, cache)[last]
    rows = streams.expand(config.max_num_seqs, *streams.shape[1:]).contiguous()
    return torch.log_softmax(model.compute_logits(rows), dim=-1)
