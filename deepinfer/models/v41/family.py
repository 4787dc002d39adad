"""The DeepSeek-V4.1 family (`model_type: deepseek_v41`, text-only `deepseek_v41_text`):
what the registry hands the engine for a V4.1 checkpoint. Config: config.py; model:
model.py (+ block / attention / layers / engram, dspark.py for the DSpark stages); KV
cache: kv_cache.py (swa / dec / src groups); SWA bounded replay of the decoder layers
(models/bounded_replay.py). Compiled executors: the shared decode executor
(models/compiled.py) with V4.1's decode program, and V4.1's own prefill / mixed executor
(compiled.py: fast/prefill.py, bounded replay included); a step kind they do not cover
returns None there and runs on the reference path."""

from __future__ import annotations

from ..compiled import decode_executor
from ..paged_batch import check_block_size
from ..registry import ModelFamily, register_family
from .compiled import decode_program, dspark_stages_hidden, prefill_executor
from .config import DeepseekV41Config
from .dspark import draft_pass
from .kv_cache import WINDOW_GROUPS, KVCacheV41, block_bytes_v41, group_names_v41, slot_bytes_v41
from .model import DeepseekV41Model

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
    prefill_executor=prefill_executor,
    decode_program=decode_program,
    dspark_stages_hidden=dspark_stages_hidden,
))
