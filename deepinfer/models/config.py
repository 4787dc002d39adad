"""DeepSeek-V4 model configuration, read from a checkpoint's config.json.

Accepts both spellings seen in the wild: the official flat config with legacy keys
(`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`) and
transformers' folded form (`layer_types`, `mlp_layer_types`, `partial_rotary_factor`,
`rope_parameters`). Every value is validated up front so a bad checkpoint fails with
the field named, not deep inside a forward pass.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v4",)

# transformers' layer-type names <-> the official per-layer compress ratio.
LAYER_TYPE_TO_RATIO = {
    "sliding_attention": 0,
    "compressed_sparse_attention": 4,
    "heavily_compressed_attention": 128,
}


class ModelConfigError(ValueError):
    """A config.json value is missing, malformed or out of range."""


@dataclass
class DeepseekV4Config:
    """Architecture hyper-parameters of one DeepSeek-V4 checkpoint."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    # Per layer: 0 = sliding only, csa_ratio = CSA, hca_ratio = HCA. MTP stages get their own.
    compress_ratios: list[int] = field(default_factory=list)
    mtp_compress_ratios: list[int] = field(default_factory=list)
    csa_ratio: int = 4
    hca_ratio: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    num_hash_layers: int = 3
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 1
    torch_dtype: str = "bfloat16"
    # FP8 block shape of quantized linears, None for an unquantized checkpoint.
    fp8_block: tuple[int, int] | None = None
    expert_dtype: str | None = None
    model_type: str = "deepseek_v4"
    # DSpark drafter (0731 release); dspark_block_size 0 = the checkpoint has plain MTP stages.
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: list[int] = field(default_factory=list)
    dspark_markov_rank: int = 256
    # Per-position temperatures T_k of the confidence head, sigmoid(z_k / T_k), fitted so the
    # cumulative products are calibrated (empty = 1.0 everywhere). deepinfer's own key.
    dspark_confidence_temperatures: list[float] = field(default_factory=list)

    @property
    def has_dspark(self) -> bool:
        return self.dspark_block_size > 0

    # ---- derived views -------------------------------------------------------------
    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    @property
    def csa_layers(self) -> list[int]:
        return [i for i, r in enumerate(self.compress_ratios) if r == self.csa_ratio]

    @property
    def hca_layers(self) -> list[int]:
        return [i for i, r in enumerate(self.compress_ratios) if r == self.hca_ratio]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ---- parsing -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DeepseekV4Config":
        """Build from a config.json dict in either the official or transformers spelling."""
        raw = dict(raw)
        model_type = raw.get("model_type", "deepseek_v4")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"config.json model_type={model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        cfg = cls()
        simple = {f for f in cls.__dataclass_fields__} - {
            "compress_ratios", "mtp_compress_ratios", "rope_scaling", "fp8_block", "expert_dtype"
        }
        for key in simple:
            if key in raw and raw[key] is not None:
                setattr(cfg, key, raw[key])
        aliases = {"num_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "dim": "hidden_size",
                   "window_size": "sliding_window", "n_hash_layers": "num_hash_layers",
                   "moe_inter_dim": "moe_intermediate_size", "n_activated_experts": "num_experts_per_tok"}
        for old, new in aliases.items():
            if old in raw and new not in raw:
                setattr(cfg, new, raw[old])
        if isinstance(cfg.eos_token_id, list):
            cfg.eos_token_id = cfg.eos_token_id[0]
        rates = raw.get("compress_rates") or {}
        cfg.csa_ratio = int(raw.get("compress_rate_csa", rates.get("compressed_sparse_attention", cfg.csa_ratio)))
        cfg.hca_ratio = int(raw.get("compress_rate_hca", rates.get("heavily_compressed_attention", cfg.hca_ratio)))
        n = int(cfg.num_hidden_layers)
        n_mtp = int(cfg.num_nextn_predict_layers or 0)
        if raw.get("compress_ratios") is not None:
            ratios = [int(r) for r in raw["compress_ratios"]]
            if len(ratios) < n:
                raise ModelConfigError(
                    f"config.json compress_ratios has {len(ratios)} entries but num_hidden_layers={n}"
                )
            cfg.compress_ratios, cfg.mtp_compress_ratios = ratios[:n], ratios[n:]
        elif raw.get("layer_types") is not None:
            bad = [t for t in raw["layer_types"] if t not in LAYER_TYPE_TO_RATIO]
            if bad:
                raise ModelConfigError(f"config.json layer_types has unknown entries {bad}; allowed {list(LAYER_TYPE_TO_RATIO)}")
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
            types = list(raw["mlp_layer_types"])
            cfg.num_hash_layers = sum(1 for t in types if t == "hash_moe")
            if types != ["hash_moe"] * cfg.num_hash_layers + ["moe"] * (len(types) - cfg.num_hash_layers):
                raise ModelConfigError("config.json mlp_layer_types must be hash_moe layers first, then moe")
        if "qk_rope_head_dim" not in raw and raw.get("partial_rotary_factor") is not None:
            cfg.qk_rope_head_dim = int(cfg.head_dim * float(raw["partial_rotary_factor"]))
        cfg.rope_scaling = raw.get("rope_scaling")
        params = raw.get("rope_parameters")
        if cfg.rope_scaling is None and isinstance(params, dict):
            comp = params.get("compress") if isinstance(params.get("compress"), dict) else None
            if comp is not None:
                cfg.compress_rope_theta = comp.get("rope_theta", cfg.compress_rope_theta)
                if comp.get("rope_type", comp.get("type")) == "yarn":
                    cfg.rope_scaling = {k: v for k, v in comp.items() if k not in ("rope_theta", "partial_rotary_factor")}
            main = params.get("main") if isinstance(params.get("main"), dict) else None
            if main is not None:
                cfg.rope_theta = main.get("rope_theta", cfg.rope_theta)
        quant = raw.get("quantization_config")
        if quant:
            block = quant.get("weight_block_size") or [128, 128]
            cfg.fp8_block = (int(block[0]), int(block[1]))
            cfg.expert_dtype = quant.get("expert_dtype", raw.get("expert_dtype"))
        else:
            cfg.expert_dtype = raw.get("expert_dtype")
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str) -> "DeepseekV4Config":
        """Read `config.json` from a checkpoint directory (or the file itself)."""
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise FileNotFoundError(f"no config.json at {file}")
        with open(file) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as exc:
                raise ModelConfigError(f"{file} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)

    # ---- validation ----------------------------------------------------------------
    def validate(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelConfigError(f"config.json {name} must be a positive integer, got {value!r}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads",
                     "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters", "csa_ratio", "hca_ratio"):
            positive(name)
        if self.num_attention_heads % self.o_groups:
            raise ModelConfigError(
                f"config.json num_attention_heads ({self.num_attention_heads}) must be divisible by o_groups ({self.o_groups})"
            )
        if not (0 < self.qk_rope_head_dim <= self.head_dim) or self.qk_rope_head_dim % 2:
            raise ModelConfigError(
                f"config.json qk_rope_head_dim must be even and in [2, head_dim={self.head_dim}], got {self.qk_rope_head_dim}"
            )
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ModelConfigError(
                f"config.json index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim ({self.qk_rope_head_dim})"
            )
        allowed = {0, self.csa_ratio, self.hca_ratio}
        for i, r in enumerate(self.compress_ratios + self.mtp_compress_ratios):
            if r not in allowed:
                raise ModelConfigError(f"config.json compress_ratios[{i}]={r} is not one of {sorted(allowed)}")
        if any(r != 0 for r in self.mtp_compress_ratios):
            raise ModelConfigError("config.json compress_ratios: MTP stages must be sliding-only (ratio 0)")
        if not 0 <= self.num_hash_layers <= self.num_hidden_layers:
            raise ModelConfigError(
                f"config.json num_hash_layers must be in [0, {self.num_hidden_layers}], got {self.num_hash_layers}"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ModelConfigError(
                f"config.json num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})"
            )
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ModelConfigError(
                f"config.json scoring_func must be one of sqrtsoftplus/sigmoid/softmax, got {self.scoring_func!r}"
            )
        if self.n_shared_experts not in (0, 1):
            raise ModelConfigError(f"config.json n_shared_experts must be 0 or 1, got {self.n_shared_experts}")
        for name in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "swiglu_limit",
                     "routed_scaling_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ModelConfigError(f"config.json {name} must be a positive finite number, got {value!r}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("type", self.rope_scaling.get("rope_type"))
            if kind not in ("yarn", "default", None):
                raise ModelConfigError(f"config.json rope_scaling type must be 'yarn', got {kind!r}")
        if not 0 <= self.bos_token_id < self.vocab_size or not 0 <= self.eos_token_id < self.vocab_size:
            raise ModelConfigError(f"config.json bos/eos token ids must be in [0, vocab_size={self.vocab_size})")
        if self.fp8_block is not None and self.fp8_block not in ((128, 128), (32, 32)):
            raise ModelConfigError(f"quantization_config.weight_block_size must be [128,128] or [32,32], got {list(self.fp8_block)}")
        if self.has_dspark:
            n_all = self.num_hidden_layers + len(self.mtp_compress_ratios)
            if not self.dspark_target_layer_ids or any(not 0 <= i < n_all for i in self.dspark_target_layer_ids):
                raise ModelConfigError(
                    f"config.json dspark_target_layer_ids must be non-empty layer ids in [0, {n_all}), "
                    f"got {self.dspark_target_layer_ids}")
            if not self.mtp_compress_ratios:
                raise ModelConfigError("config.json: a DSpark checkpoint needs num_nextn_predict_layers >= 1")
            if not 0 <= self.dspark_noise_token_id < self.vocab_size or self.dspark_markov_rank < 1:
                raise ModelConfigError("config.json dspark_noise_token_id must be a token id and "
                                       "dspark_markov_rank >= 1")
            temps = self.dspark_confidence_temperatures
            if temps and (len(temps) != self.dspark_block_size
                          or not all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in temps)):
                raise ModelConfigError(
                    f"config.json dspark_confidence_temperatures must hold dspark_block_size={self.dspark_block_size} "
                    f"positive finite numbers, got {temps!r}")
        if self.expert_dtype not in (None, "fp4", "fp8", "bf16"):
            raise ModelConfigError(f"config.json expert_dtype must be fp4, fp8 or bf16, got {self.expert_dtype!r}")

    def to_official_json(self) -> dict[str, Any]:
        """The flat, legacy-key config.json that official checkpoints ship."""
        out = {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1, "head_dim": self.head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
            "q_lora_rank": self.q_lora_rank, "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window,
            "compress_ratios": list(self.compress_ratios) + list(self.mtp_compress_ratios),
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk, "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size, "scoring_func": self.scoring_func,
            "norm_topk_prob": self.norm_topk_prob, "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit, "num_hash_layers": self.num_hash_layers,
            "hc_mult": self.hc_mult, "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "torch_dtype": self.torch_dtype, "tie_word_embeddings": False,
        }
        if (self.csa_ratio, self.hca_ratio) != (4, 128):
            out["compress_rate_csa"], out["compress_rate_hca"] = self.csa_ratio, self.hca_ratio
        if self.rope_scaling is not None:
            out["rope_scaling"] = dict(self.rope_scaling)
        if self.fp8_block is not None:
            out["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                          "weight_block_size": list(self.fp8_block)}
        if self.expert_dtype is not None:
            out["expert_dtype"] = self.expert_dtype
        if self.has_dspark:
            out.update(dspark_block_size=self.dspark_block_size, dspark_noise_token_id=self.dspark_noise_token_id,
                       dspark_target_layer_ids=list(self.dspark_target_layer_ids),
                       dspark_markov_rank=self.dspark_markov_rank)
            if self.dspark_confidence_temperatures:
                out["dspark_confidence_temperatures"] = [float(t) for t in self.dspark_confidence_temperatures]
        return out
