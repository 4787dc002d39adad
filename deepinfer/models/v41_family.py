"""The DeepSeek-V4.1 family (`model_type: deepseek_v41`, text-only `deepseek_v41_text`):
what the registry hands the engine for a V4.1 checkpoint. Config: config_v41.py; model:
deepseek_v41.py (+ v41_block / v41_attention / v41_layers / engram, v41_dspark.py for
the DSpark stages); KV cache: kv_cache_v41.py (swa / dec / src groups); SWA bounded
replay of the decoder layers (bounded_replay.py). Compiled executors (models/compiled.py):
V4's decode executor with V4.1's decode program, and V4.1's own prefill / mixed executor
(fast/v41_prefill.py, bounded replay included); a step kind they do not cover returns None
there and runs on the reference path."""

from __future__ import annotations

from .compiled import decode_executor, v41_decode_program, v41_prefill_executor
from .config_v41 import DeepseekV41Config
from .deepseek_v41 import DeepseekV41Model
from .kv_cache import check_block_size
from .kv_cache_v41 import WINDOW_GROUPS, KVCacheV41, block_bytes_v41, group_names_v41, slot_bytes_v41
from .registry import ModelFamily, register_family
from .v41_dspark import draft_pass

FAMILY = register_family(ModelFamily(
    name="deepseek_v41",
    aliases=("deepseek_v41_text",),
    display_name="DeepSeek-V4.1",
    config_class=DeepseekV41Config,
    model_class=DeepseekV41Model,
    kv_cache_class=KVCacheV41,
    kv_group_names=group_names_v41,
    kv_block_bytes=block_bytes_v41,
    kv_slot_bytes=slot_bytes_v41,
    check_block_size=check_block_size,
    window_groups=WINDOW_GROUPS,
    replay_start_layer=lambda cfg: cfg.replay_start_layer,  # the last KV source
    dspark_draft_pass=draft_pass,
    dspark_fused_stages=False,  # shifted hyper-connections: the fused mHC kernels do not apply
    plain_mtp_stages=False,  # mtp.* are DSpark stages, without the e_proj / h_proj of an MTP stage
    decode_executor=decode_executor,
    prefill_executor=v41_prefill_executor,
    decode_program=v41_decode_program,
))
