"""How many KV blocks fit: from gpu_memory_utilization on a GPU, from a byte budget on
CPU, or an explicit override; never more than the longest possible load needs."""

from __future__ import annotations

import torch

from deepinfer.config import EngineConfig
from deepinfer.errors import ConfigError
from deepinfer.models.config_common import DeepseekConfigBase
from deepinfer.models.registry import family_of
from deepinfer.platform import platform_for_device


def device_kv_budget(total: int, free: int, gpu_memory_utilization: float, step_peak_bytes: int | None) -> int:
    """Bytes of a device's memory the KV cache may take: ``gpu_memory_utilization`` of it,
    less what is already allocated (weights, other processes), less the profiled bytes of a
    worst-case step and the decode CUDA graphs (``MemoryProfile.total``,
    deepinfer/engine/memory_profile.py). Without a measurement (a platform with no
    allocator statistics): 10% of what is left, at least 1 GiB, as headroom."""
    budget = int(total * gpu_memory_utilization) - (total - free)
    if step_peak_bytes is None:
        return max(0, budget - max(1 << 30, budget // 10))
    return max(0, budget - step_peak_bytes)


def kv_budget_bytes(config: EngineConfig, device: torch.device, weights_bytes: int,
                    step_peak_bytes: int | None = None) -> int:
    if device.type in ("cuda", "npu"):
        free, total = platform_for_device(device).mem_get_info(device)
        return device_kv_budget(total, free, config.gpu_memory_utilization, step_peak_bytes)
    return int(config.kv_cache_memory_bytes)


def num_kv_blocks(config: EngineConfig, model_cfg: DeepseekConfigBase, dtype: torch.dtype, device: torch.device,
                  max_model_len: int, weights_bytes: int = 0, step_peak_bytes: int | None = None) -> dict[str, int]:
    """Blocks per group (every group gets the same count: each logical token block of a
    request takes one block in every group it is held in). ``step_peak_bytes``: the
    profiled bytes of a worst-case step and the decode graphs (device budgets only)."""
    family = family_of(model_cfg)
    groups = family.kv_group_names(model_cfg)
    if config.num_kv_blocks is not None:
        return {g: config.num_kv_blocks for g in groups}
    per_block = sum(family.kv_block_bytes(model_cfg, config.block_size, dtype).values())
    budget = (kv_budget_bytes(config, device, weights_bytes, step_peak_bytes)
              - config.max_num_seqs * family.kv_slot_bytes(model_cfg, dtype))
    blocks = budget // per_block
    needed = config.max_num_seqs * (-(-max_model_len // config.block_size))
    blocks = min(blocks, needed)
    min_blocks = -(-max_model_len // config.block_size)
    if blocks < min_blocks:
        raise ConfigError(
            f"KV cache budget of {max(budget, 0)} bytes holds {max(blocks, 0)} blocks of {per_block} bytes, "
            f"fewer than one max_model_len={max_model_len} request needs ({min_blocks}); raise "
            "kv_cache_memory_bytes / gpu_memory_utilization or lower max_model_len", field="kv_cache_memory_bytes")
    return {g: int(blocks) for g in groups}
