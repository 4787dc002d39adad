"""DeepSeek-V4 model configuration (`model_type: deepseek_v4`), read from a checkpoint's config.json.

Accepts both spellings seen in the wild: the official flat config with legacy keys
(`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`) and
transformers' folded form (`layer_types`, `mlp_layer_types`, `partial_rotary_factor`,
`rope_parameters`). What V4 and V4.1 parse alike (common fields, legacy aliases, rope /
YaRN, quantization_config, common checks) lives in config_common.py; this module adds
V4's layer schedule (CSA / HCA ratios, hash-routed layers). Every value is validated up
front so a bad checkpoint fails with the field named, not deep inside a forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config_common import (DeepseekConfigBase, ModelConfigError, common_official_json, copy_plain_fields,
                             dspark_official_json, fail, parse_quantization, parse_rope, read_config_json,
                             validate_common)
from ..config_common import int_list, int_value, str_list

__all__ = ["DeepseekV4Config", "ModelConfigError", "SUPPORTED_MODEL_TYPES", "LAYER_TYPE_TO_RATIO"]

SUPPORTED_MODEL_TYPES = ("deepseek_v4",)

# transformers' layer-type names <-> the official per-layer compress ratio.
LAYER_TYPE_TO_RATIO = {
    "sliding_attention": 0,
    "compressed_sparse_attention": 4,
    "heavily_compressed_attention": 128,
}


@dataclass
class DeepseekV4Config(DeepseekConfigBase):
    """Architecture hyper-parameters of one DeepSeek-V4 checkpoint (defaults = V4-Flash).

    compress_ratios[i]: 0 = sliding only, csa_ratio = CSA, hca_ratio = HCA."""

    csa_ratio: int = 4
    hca_ratio: int = 128
    num_hash_layers: int = 3

    # ---- derived views -------------------------------------------------------------
    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    @property
    def csa_layers(self) -> list[int]:
        return [i for i, r in enumerate(self.compress_ratios) if r == self.csa_ratio]

    @property
    def hca_layers(self) -> list[int]:
        return [i for i, r in enumerate(self.compress_ratios) if r == self.hca_ratio]

    # ---- parsing -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DeepseekV4Config":
        """Build from a config.json dict in either the official or transformers spelling."""
        raw = dict(raw)
        model_type = raw.get("model_type", "deepseek_v4")
        if model_type not in SUPPORTED_MODEL_TYPES:
            fail(f"model_type={model_type!r} is not supported by DeepseekV4Config; expected one of "
                 f"{SUPPORTED_MODEL_TYPES}", field="model_type")
        cfg = cls()
        copy_plain_fields(cfg, raw, skip={"compress_ratios", "mtp_compress_ratios", "rope_scaling", "fp8_block",
                                          "expert_dtype", "model_type"},
                          aliases={"n_hash_layers": "num_hash_layers"})
        rates = raw.get("compress_rates") or {}
        if not isinstance(rates, dict):
            fail(f"compress_rates must be an object, got {rates!r}", field="compress_rates")
        cfg.csa_ratio = int_value(raw.get("compress_rate_csa", rates.get("compressed_sparse_attention",
                                                                          cfg.csa_ratio)), "compress_rate_csa")
        cfg.hca_ratio = int_value(raw.get("compress_rate_hca", rates.get("heavily_compressed_attention",
                                                                          cfg.hca_ratio)), "compress_rate_hca")
        n = int(cfg.num_hidden_layers)
        n_mtp = int(cfg.num_nextn_predict_layers or 0)
        if raw.get("compress_ratios") is not None:
            ratios = int_list(raw["compress_ratios"], "compress_ratios")
            if len(ratios) < n:
                fail(f"compress_ratios has {len(ratios)} entries but num_hidden_layers={n}", field="compress_ratios")
            cfg.compress_ratios, cfg.mtp_compress_ratios = ratios[:n], ratios[n:]
        elif raw.get("layer_types") is not None:
            bad = [t for t in str_list(raw["layer_types"], "layer_types") if t not in LAYER_TYPE_TO_RATIO]
            if bad:
                fail(f"layer_types has unknown entries {bad}; allowed {list(LAYER_TYPE_TO_RATIO)}", field="layer_types")
            mapping = {"sliding_attention": 0, "compressed_sparse_attention": cfg.csa_ratio,
                       "heavily_compressed_attention": cfg.hca_ratio}
            cfg.compress_ratios = [mapping[t] for t in raw["layer_types"]][:n]
        else:  # transformers' default schedule: 2x HCA then CSA/HCA interleaved
            cfg.compress_ratios = [cfg.hca_ratio] * min(n, 2) + [
                cfg.csa_ratio if i % 2 else cfg.hca_ratio for i in range(max(n - 2, 0))
            ]
        if not cfg.mtp_compress_ratios:
            cfg.mtp_compress_ratios = [0] * n_mtp
        cfg.mtp_compress_ratios = cfg.mtp_compress_ratios[:n_mtp]
        if raw.get("mlp_layer_types") is not None and "num_hash_layers" not in raw:
            types = str_list(raw["mlp_layer_types"], "mlp_layer_types")
            cfg.num_hash_layers = sum(1 for t in types if t == "hash_moe")
            if types != ["hash_moe"] * cfg.num_hash_layers + ["moe"] * (len(types) - cfg.num_hash_layers):
                fail("mlp_layer_types must be hash_moe layers first, then moe", field="mlp_layer_types")
        parse_rope(cfg, raw)
        parse_quantization(cfg, raw, raw)
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str) -> "DeepseekV4Config":
        """Read `config.json` from a checkpoint directory (or the file itself)."""
        return cls.from_dict(read_config_json(path))

    # ---- validation ----------------------------------------------------------------
    def validate(self) -> None:
        validate_common(self, extra_ints=("csa_ratio", "hca_ratio"))
        allowed = {0, self.csa_ratio, self.hca_ratio}
        for i, r in enumerate(self.compress_ratios + self.mtp_compress_ratios):
            if r not in allowed:
                fail(f"compress_ratios[{i}]={r} is not one of {sorted(allowed)}", field="compress_ratios")
        if not 0 <= self.num_hash_layers <= self.num_hidden_layers:
            fail(f"num_hash_layers must be in [0, {self.num_hidden_layers}], got {self.num_hash_layers}",
                 field="num_hash_layers")

    def to_official_json(self) -> dict[str, Any]:
        """The flat, legacy-key config.json that official checkpoints ship."""
        out = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": self.model_type,
               **common_official_json(self), "num_hash_layers": self.num_hash_layers,
               "torch_dtype": self.torch_dtype}
        if (self.csa_ratio, self.hca_ratio) != (4, 128):
            out["compress_rate_csa"], out["compress_rate_hca"] = self.csa_ratio, self.hca_ratio
        if self.fp8_block is not None:
            out["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                          "weight_block_size": list(self.fp8_block)}
        if self.expert_dtype is not None:
            out["expert_dtype"] = self.expert_dtype
        if self.has_dspark:
            out.update(dspark_official_json(self))
        return out
