"""The model registry: a checkpoint's ``model_type`` -> its `ModelFamily` (config parser,
model class, KV-cache class and layout, bounded-replay support, DSpark drafting, executor
factories). Engine code asks the family of a config (`family_of`) instead of checking
which family it is; everything that differs between DeepSeek-V4 and V4.1 is an attribute
or a function of the family.

A family registers itself (`register_family`) in its own module: v4/family.py
(``deepseek_v4``) and v41/family.py (``deepseek_v41``, alias ``deepseek_v41_text``). This
module imports no family: it names the built-in ones by module path and imports one the
first time its model_type is looked up (vLLM's lazy registry), so the families may import
anything in the engine without an import cycle through here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .config_common import ModelConfigError, read_config_json

if TYPE_CHECKING:
    import torch

__all__ = ["ModelFamily", "register_family", "family_for_model_type", "family_of", "known_model_types",
           "config_from_dict", "read_model_config", "build_model", "new_kv_cache"]

#: model_type -> the module that registers its family (imported on first lookup).
BUILTIN_FAMILY_MODULES = {
    "deepseek_v4": "deepinfer.models.v4.family",
    "deepseek_v41": "deepinfer.models.v41.family",
    "deepseek_v41_text": "deepinfer.models.v41.family",
}
#: model_type a config.json without one is read as (the official V4 flat configs).
DEFAULT_MODEL_TYPE = "deepseek_v4"


@dataclass(frozen=True)
class ModelFamily:
    """One model family: what the engine needs to parse, build, cache and run it."""

    #: canonical model_type (the config's ``model_type``), e.g. "deepseek_v41"
    name: str
    #: for messages, e.g. "DeepSeek-V4.1"
    display_name: str
    #: the config dataclass; ``config_class.from_dict(raw)`` parses a config.json dict
    config_class: type
    #: ``model_class(cfg, dtype)`` builds the reference model
    model_class: type
    #: ``kv_cache_class(cfg, num_blocks, block_size, num_slots, dtype, device)``
    kv_cache_class: type
    #: KV block-pool groups the config needs, in order (cfg -> names)
    kv_group_names: Callable[[Any], list[str]]
    #: bytes of one physical block of each group (cfg, block_size, dtype -> {group: bytes})
    kv_block_bytes: Callable[[Any, int, "torch.dtype"], dict[str, int]]
    #: bytes of one request's compressor state slot (cfg, dtype -> bytes)
    kv_slot_bytes: Callable[[Any, "torch.dtype"], int]
    #: raises ValueError when a block size does not fit the layout (cfg, block_size)
    check_block_size: Callable[[Any, int], None]
    #: groups whose blocks hold sliding-window rows (freed once out of the window)
    window_groups: tuple[str, ...]
    #: first layer of the SWA bounded-replay region, None when the config has none
    replay_start_layer: Callable[[Any], int | None]
    #: the DSpark stages' reference pass over draft blocks (deepinfer/spec/dspark_drafter.py):
    #: (stages, streams, ids, positions, block, ctx_kvs, ctx_pos, rotary) -> hidden before the output norm
    dspark_draft_pass: Callable[..., "torch.Tensor"]
    #: the DSpark stages may run on the GPU fast path's fused mHC / MoE kernels
    dspark_fused_stages: bool
    #: without DSpark, the checkpoint's mtp.* stages are plain MTP (next-n) stages
    plain_mtp_stages: bool
    #: other model_type spellings of this family
    aliases: tuple[str, ...] = ()
    #: compiled executors, (model, cache) -> executor or None (None: the reference path only)
    decode_executor: Callable[[Any, Any], Any] | None = None
    prefill_executor: Callable[[Any, Any], Any] | None = None
    #: () -> the family's batched decode forward (fast/runner.py DecodeProgram), loaded lazily
    decode_program: Callable[[], Any] | None = None
    #: () -> the DSpark stages' pass over draft blocks on the compiled executor's kernels, loaded
    #: lazily: (model, stages, ops, ids, positions, gamma, ctx_kvs, ctx_pos, rotary) -> the normed
    #: hidden [R * gamma, D] (deepinfer/spec/dspark_drafter.py's graphed and fused drafting);
    #: None: the family's DSpark drafter stays on its reference pass
    dspark_stages_hidden: Callable[[], Callable[..., "torch.Tensor"]] | None = None
    #: () -> the compiled attention sublayer of a plain MTP stage over decode-like rows
    #: ((attn, x, ctx) -> out; spec/mtp_graphs.py), loaded lazily; None: MTP drafts eagerly
    mtp_stage_attention: Callable[[], Callable[..., "torch.Tensor"]] | None = None

    @property
    def model_types(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def default_fp8_block(self) -> tuple[int, int]:
        """FP8 block shape a checkpoint of this family is quantized with when none is named."""
        return tuple(self.config_class.DEFAULT_FP8_BLOCK)

    def parse_config(self, raw: dict[str, Any]) -> Any:
        return self.config_class.from_dict(raw)

    def build_model(self, cfg: Any, dtype: "torch.dtype | None" = None) -> Any:
        return self.model_class(cfg) if dtype is None else self.model_class(cfg, dtype)

    def new_kv_cache(self, cfg: Any, num_blocks: dict[str, int], block_size: int, num_slots: int,
                     dtype: "torch.dtype", device: Any = "cpu") -> Any:
        return self.kv_cache_class(cfg, num_blocks, block_size, num_slots, dtype, device)

    def kv_group_windows(self, cfg: Any) -> list[tuple[str, int | None]]:
        """(group, sliding window in tokens or None = full context) of each KV group."""
        return [(g, cfg.sliding_window if g in self.window_groups else None) for g in self.kv_group_names(cfg)]


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Make `family` the one for each of its model types (re-registering the same object is a no-op)."""
    for t in family.model_types:
        held = _FAMILIES.get(t)
        if held is not None and held is not family:
            raise ValueError(f"model_type {t!r} is already registered to the {held.display_name} family")
    for t in family.model_types:
        _FAMILIES[t] = family
    return family


def known_model_types() -> list[str]:
    return sorted(set(_FAMILIES) | set(BUILTIN_FAMILY_MODULES))


def family_for_model_type(name: str) -> ModelFamily:
    """The family of a model_type; ModelConfigError (field ``model_type``) naming the known ones."""
    family = _FAMILIES.get(name) if isinstance(name, str) else None
    if family is None and isinstance(name, str) and name in BUILTIN_FAMILY_MODULES:
        importlib.import_module(BUILTIN_FAMILY_MODULES[name])
        family = _FAMILIES.get(name)
    if family is None:
        raise ModelConfigError(f"config.json model_type={name!r} is not supported; known model types: "
                               f"{known_model_types()}", field="model_type")
    return family


def family_of(cfg: Any) -> ModelFamily:
    """The family of a parsed config (by its ``model_type``)."""
    name = getattr(cfg, "model_type", None)
    if name is None:
        raise ModelConfigError(f"{type(cfg).__name__} has no model_type: not a model config", field="model_type")
    return family_for_model_type(name)


def config_from_dict(raw: dict[str, Any]) -> Any:
    """The family config for a config.json dict, chosen by its ``model_type``."""
    return family_for_model_type(raw.get("model_type", DEFAULT_MODEL_TYPE)).parse_config(raw)


def read_model_config(path: str) -> Any:
    """Read `config.json` from a checkpoint directory (or the file itself), any model type."""
    return config_from_dict(read_config_json(path))


def build_model(cfg: Any, dtype: "torch.dtype | None" = None) -> Any:
    """The reference model of the config's family (random-initialised; the loader fills it)."""
    return family_of(cfg).build_model(cfg, dtype)


def new_kv_cache(cfg: Any, num_blocks: dict[str, int], block_size: int, num_slots: int, dtype: "torch.dtype",
                 device: Any = "cpu") -> Any:
    """The KV cache of the config's family."""
    return family_of(cfg).new_kv_cache(cfg, num_blocks, block_size, num_slots, dtype, device)
