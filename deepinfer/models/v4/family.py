"""The DeepSeek-V4 family (`model_type: deepseek_v4`): what the registry hands the engine
for a V4 checkpoint. Config: config.py; model: model.py (+ dspark.py for the
DSpark stages); KV cache: kv_cache.py (swa / csa / hca groups). Compiled executors: the
shared decode executor (models/compiled.py: FastPath) with V4's decode program, and V4's
own prefill / mixed executor (compiled.py: fast/prefill.py's PrefillPath); V4's pieces of
the GPU fast path are in v4/fast/, the machinery both families share in models/fast/."""

from __future__ import annotations

from ..compiled import decode_executor
from ..paged_batch import check_block_size
from ..registry import ModelFamily, register_family
from .compiled import decode_program, dspark_stages_hidden, mtp_stage_attention, prefill_executor
from .config import DeepseekV4Config
from .dspark import draft_pass
from .kv_cache import WINDOW_GROUPS_V4, KVCache, block_bytes_v4, group_names_v4, slot_bytes_v4
from .model import DeepseekV4Model

FAMILY = register_family(ModelFamily(
    name="deepseek_v4",
    display_name="DeepSeek-V4",
    config_class=DeepseekV4Config,
    model_class=DeepseekV4Model,
    kv_cache_class=KVCache,
    kv_group_names=group_names_v4,
    kv_block_bytes=block_bytes_v4,
    kv_slot_bytes=slot_bytes_v4,
    check_block_size=check_block_size,
    window_groups=WINDOW_GROUPS_V4,
    replay_start_layer=lambda cfg: None,  # no KV-source schedule: nothing to replay boundedly
    dspark_draft_pass=draft_pass,
    dspark_fused_stages=True,
    plain_mtp_stages=True,
    decode_executor=decode_executor,
    prefill_executor=prefill_executor,
    decode_program=decode_program,
    dspark_stages_hidden=dspark_stages_hidden,
    mtp_stage_attention=mtp_stage_attention,
))
