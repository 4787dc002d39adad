"""The model registry (deepinfer/models/registry.py): model_type -> family, the families'
answers, no family checks outside the families, and the shared config parsing (YaRN's
attention factor pinned for both families)."""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from deepinfer.errors import ConfigError
from deepinfer.models.config_common import DeepseekConfigBase, ModelConfigError
from deepinfer.models.registry import (build_model, config_from_dict, family_for_model_type, family_of,
                                       known_model_types, new_kv_cache, read_model_config)
from deepinfer.models.rope import Rotary
from deepinfer.models.tiny import tiny_config, tiny_v41_config
from deepinfer.models.v4.config import DeepseekV4Config
from deepinfer.models.v4.kv_cache import KVCache
from deepinfer.models.v4.model import DeepseekV4Model
from deepinfer.models.v41.config import DeepseekV41Config
from deepinfer.models.v41.kv_cache import KVCacheV41
from deepinfer.models.v41.model import DeepseekV41Model

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "deepinfer"
#: the modules allowed to know which family is which: the registry and the family modules
FAMILY_MODULES = {"models/registry.py", "models/v4/family.py", "models/v41/family.py"}
#: is_v41 checks another engineer is removing in a rewrite of these files (issue 23): delete
#: the entry with the check (the family's decode_executor / prefill_executor choose the path)
PENDING: set[str] = set()

V4 = tiny_config(vocab_size=256)
V41 = tiny_v41_config(vocab_size=256)
YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}


@pytest.mark.parametrize("cfg,name,config_class,aliases", [
    (V4, "deepseek_v4", DeepseekV4Config, ()),
    (V41, "deepseek_v41", DeepseekV41Config, ("deepseek_v41_text",)),
])
def test_family_resolves_from_model_type_and_loaded_config(tmp_path, cfg, name, config_class, aliases):
    family = family_for_model_type(name)
    assert family.name == name and family.config_class is config_class and family.aliases == aliases
    assert all(family_for_model_type(a) is family for a in aliases)
    assert set(family.model_types) <= set(known_model_types())
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_official_json()))
    loaded = read_model_config(str(tmp_path))
    assert type(loaded) is config_class and loaded == cfg
    assert family_of(loaded) is family and family_of(cfg) is family


def test_unknown_model_type_is_a_config_error_naming_field_and_known_types(tmp_path):
    with pytest.raises(ConfigError) as err:
        family_for_model_type("llama")
    assert isinstance(err.value, ModelConfigError) and err.value.field == "model_type"
    message = str(err.value)
    assert "model_type='llama' is not supported" in message
    for name in ("deepseek_v4", "deepseek_v41", "deepseek_v41_text"):
        assert repr(name) in message
    (tmp_path / "config.json").write_text(json.dumps({**V4.to_official_json(), "model_type": "qwen3"}))
    with pytest.raises(ModelConfigError, match=r"model_type='qwen3' is not supported; known model types: \["):
        read_model_config(str(tmp_path))


def test_no_family_checks_outside_the_registry_and_the_families():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in FAMILY_MODULES or rel in PENDING:
            continue
        if re.search(r"\bis_v41\b", path.read_text()):
            offenders.append(rel)
    assert not offenders, f"is_v41 checks outside the model families (ask family_of(cfg) instead): {offenders}"


def test_families_answer_what_the_engine_asked_is_v41_for():
    v4, v41 = family_of(V4), family_of(V41)
    assert v4.default_fp8_block == (128, 128) and v41.default_fp8_block == (32, 32)
    assert v4.kv_group_names(V4) == ["swa", "csa", "hca"] and v41.kv_group_names(V41) == ["swa", "dec", "src"]
    assert v4.kv_group_windows(V4) == [("swa", 128), ("csa", None), ("hca", None)]
    assert v41.kv_group_windows(V41) == [("swa", 128), ("dec", 128), ("src", None)]
    assert v4.replay_start_layer(V4) is None and v41.replay_start_layer(V41) == max(V41.kv_source_layer_ids)
    assert v4.plain_mtp_stages and not v41.plain_mtp_stages
    assert v4.dspark_fused_stages and not v41.dspark_fused_stages
    for family, cfg in ((v4, V4), (v41, V41)):
        assert set(family.kv_block_bytes(cfg, 128, torch.bfloat16)) == set(family.kv_group_names(cfg))
        assert family.kv_slot_bytes(cfg, torch.bfloat16) > 0
        family.check_block_size(cfg, 128)
        with pytest.raises(ValueError, match="multiple of every compress ratio"):
            family.check_block_size(cfg, 130 if family is v4 else 129)


@pytest.mark.parametrize("cfg,model_class,cache_class", [(V4, DeepseekV4Model, KVCache),
                                                         (V41, DeepseekV41Model, KVCacheV41)])
def test_registry_builds_the_family_model_and_cache(cfg, model_class, cache_class):
    model = build_model(cfg, torch.float32)
    assert type(model) is model_class
    groups = family_of(cfg).kv_group_names(cfg)
    cache = new_kv_cache(cfg, dict.fromkeys(groups, 2), 128, 1, torch.float32)
    assert type(cache) is cache_class and set(cache.num_blocks) == set(groups)
    assert all(isinstance(rings, dict) for rings in cache.compressor_rings())


def test_v41_config_is_its_own_dataclass():
    assert not issubclass(DeepseekV41Config, DeepseekV4Config)
    assert issubclass(DeepseekV41Config, DeepseekConfigBase) and issubclass(DeepseekV4Config, DeepseekConfigBase)
    v41_fields = {f.name for f in fields(DeepseekV41Config)}
    assert not v41_fields & {"csa_ratio", "hca_ratio", "num_hash_layers"}  # V4 notions
    with pytest.raises(ModelConfigError, match="num_hash_layers must be 0"):
        DeepseekV41Config.from_dict({**V41.to_official_json(),
                                     "text_config": {**V41.to_official_json()["text_config"], "num_hash_layers": 2}})


# ---- YaRN's attention factor: 1.0 in both families ------------------------------------------
def _with_rope(cfg, **rope) -> dict:
    """cfg's official config.json with its rope keys replaced (V4.1: inside text_config)."""
    raw = cfg.to_official_json()
    text = raw.get("text_config", raw)
    text.pop("rope_scaling", None)
    text.update(rope)
    return raw


def _transformers_rope_parameters() -> dict:
    transformers = pytest.importorskip("transformers")
    return transformers.DeepseekV4Config(**V4.to_official_json()).to_dict()["rope_parameters"]


@pytest.mark.parametrize("cfg", [V4, V41], ids=["v4", "v41"])
def test_yarn_attention_factor_is_one_for_both_families(cfg):
    params = _transformers_rope_parameters()  # transformers writes compress.attention_factor = 1.0
    assert params["compress"]["rope_type"] == "yarn" and params["compress"]["attention_factor"] == 1.0
    flat = config_from_dict(_with_rope(cfg, rope_scaling=dict(YARN)))
    nested = config_from_dict(_with_rope(cfg, rope_parameters=params))
    with_one = config_from_dict(_with_rope(cfg, rope_scaling={**YARN, "attention_factor": 1.0}))
    # the parsed scaling holds the frequency keys only, the same whichever spelling the file used
    for parsed in (flat, nested, with_one):
        assert "attention_factor" not in parsed.rope_scaling
        assert {k: v for k, v in parsed.rope_scaling.items() if k != "rope_type"} == YARN
        assert parsed.compress_rope_theta == 160000.0 and parsed.rope_theta == 10000.0
    for bad in ({"rope_scaling": {**YARN, "attention_factor": 1.277}},
                {"rope_parameters": {**params, "compress": {**params["compress"], "attention_factor": 1.277}}}):
        with pytest.raises(ModelConfigError, match=r"attention_factor must be 1.0.*got 1.277") as err:
            config_from_dict(_with_rope(cfg, **bad))
        assert err.value.field.endswith("attention_factor")


def test_yarn_frequencies_match_transformers_with_unit_attention_scaling():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    rope = DeepseekV4RotaryEmbedding(transformers.DeepseekV4Config(**V4.to_official_json()))
    assert rope.compress_attention_scaling == 1.0 and rope.main_attention_scaling == 1.0
    for cfg in (V4, V41.__class__.from_dict(_with_rope(V41, rope_scaling=dict(YARN)))):
        assert cfg.qk_rope_head_dim == V4.qk_rope_head_dim
        ours = Rotary(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)
        torch.testing.assert_close(ours.inv_freq, rope.compress_inv_freq.float(), rtol=1e-6, atol=0)
