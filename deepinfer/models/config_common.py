"""What DeepSeek-V4 and V4.1 configs share: the common fields, the config.json reading,
and the parsing / validation steps both families run (flat legacy keys vs transformers'
keys, rope_scaling / YaRN, quantization_config). Each family's config (v4/config.py,
v41/config.py) is its own dataclass on top of `DeepseekConfigBase` and calls these helpers
for the parts they share; only the layer schedule is parsed by the family itself.

YaRN (both families): it applies to the compressed branches only and changes only the
frequencies; the attention factor (the cos/sin scale transformers calls
``attention_factor`` / ``attention_scaling``) is 1.0. transformers' DeepseekV4Config writes
``attention_factor: 1.0`` into ``rope_parameters.compress``; the parsed ``rope_scaling``
keeps the frequency keys only, and any other attention factor is rejected (the engine's
rope would silently ignore it).
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, ClassVar

from deepinfer.errors import ConfigError

#: The attention factor both families' YaRN uses (REFERENCE.md section 6; transformers forces it).
YARN_ATTENTION_FACTOR = 1.0
#: Keys of a rope_parameters sub-dict that are not YaRN frequency parameters.
_NON_SCALING_ROPE_KEYS = ("rope_theta", "partial_rotary_factor", "attention_factor")
#: Flat legacy spellings (the official reference's ModelArgs names) -> field names.
LEGACY_ALIASES = {"num_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "dim": "hidden_size",
                  "window_size": "sliding_window", "moe_inter_dim": "moe_intermediate_size",
                  "n_activated_experts": "num_experts_per_tok"}


#: a real config.json is a few KB; anything past this is refused unread
MAX_CONFIG_BYTES = 16 * 2**20


class ModelConfigError(ConfigError):
    """A config.json value is missing, malformed or out of range (``field``: the key, when one)."""


def fail(msg: str, field: str | None = None) -> None:
    raise ModelConfigError(f"config.json {msg}", field=field)


@dataclass
class DeepseekConfigBase:
    """Fields every DeepSeek-V4-family config has (defaults: V4-Flash; families override)."""

    #: FP8 block shape a quantized checkpoint uses when quantization_config names none.
    DEFAULT_FP8_BLOCK: ClassVar[tuple[int, int]] = (128, 128)

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
    # Per backbone layer (meaning per family); MTP / DSpark stages get their own (all 0).
    compress_ratios: list[int] = field(default_factory=list)
    mtp_compress_ratios: list[int] = field(default_factory=list)
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
    # DSpark drafter; dspark_block_size 0 = no DSpark (V4: plain MTP stages, if any).
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- parsing steps ---------------------------------------------------------------------
def read_config_json(path: str) -> dict[str, Any]:
    """The dict in `config.json` of a checkpoint directory (or the file itself)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.lexists(file):
        raise FileNotFoundError(f"no config.json at {file}")
    st = os.stat(file)  # never open a FIFO (blocks) or a device such as /dev/zero (endless)
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_CONFIG_BYTES:
        raise ModelConfigError(f"{file} must be a regular file of at most {MAX_CONFIG_BYTES} bytes (not a FIFO, "
                               f"device or directory, also behind a symlink)", field="config.json")
    with open(file, encoding="utf-8") as f:
        try:
            raw = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelConfigError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    return raw


def copy_plain_fields(cfg: Any, text: dict[str, Any], skip: set[str],
                      aliases: dict[str, str] | None = None) -> None:
    """Copy every dataclass field of `cfg` present (and not null) in `text`, except `skip`;
    then the flat legacy spellings (`LEGACY_ALIASES` + `aliases`) where the new key is
    absent; an eos list keeps its first id."""
    for f in fields(cfg):
        if f.name not in skip and text.get(f.name) is not None:
            setattr(cfg, f.name, _typed(f.name, getattr(cfg, f.name), text[f.name]))
    for old, new in {**LEGACY_ALIASES, **(aliases or {})}.items():
        if text.get(old) is not None and new not in text:
            setattr(cfg, new, _typed(old, getattr(cfg, new), text[old]))
    if isinstance(cfg.eos_token_id, list):
        cfg.eos_token_id = cfg.eos_token_id[0]
    if "qk_rope_head_dim" not in text and text.get("partial_rotary_factor") is not None:
        factor = text["partial_rotary_factor"]
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            fail(f"partial_rotary_factor must be a number in (0, 1], got {factor!r}", field="partial_rotary_factor")
        cfg.qk_rope_head_dim = int(cfg.head_dim * float(factor))


def _typed(name: str, default: Any, value: Any) -> Any:
    """``value`` if it has the JSON type of the field's default (an int field takes an int,
    a float field a number, a bool field a bool, str a str, list a list); else fail naming
    the key, before any later ``int(...)`` or shape computation trips over it."""
    if isinstance(default, bool):
        ok, kind = isinstance(value, bool), "true or false"
    elif isinstance(default, int):
        ok, kind = isinstance(value, int) and not isinstance(value, bool), "an integer"
        if name == "eos_token_id" and isinstance(value, list):  # an eos list keeps its first id
            ok = bool(value) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            kind = "an integer or a non-empty list of integers"
    elif isinstance(default, float):
        if name in COMMON_POSITIVE_FLOATS:
            return value  # validate_common checks these, with their range
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        kind = "a finite number"
    elif isinstance(default, str):
        ok, kind = isinstance(value, str), "a string"
    elif isinstance(default, list):
        ok, kind = isinstance(value, list), "a list"
    else:
        return value
    if not ok:
        fail(f"{name} must be {kind}, got {value!r} ({type(value).__name__})", field=name)
    return value


def int_value(value: Any, name: str) -> int:
    """``value`` as an int if it is a JSON integer (``4``, or ``4.0``); else fail naming ``name``
    (``int("4")`` would take a string, ``int(3.7)`` truncate, ``int(None)`` raise a bare TypeError)."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        fail(f"{name} must be an integer, got {value!r} ({type(value).__name__})", field=name.split("[")[0])
    return value


def int_list(value: Any, name: str) -> list[int]:
    """``value`` as a list of ints (a JSON array of integers); else fail naming ``name`` and, for
    a bad element, its index (a string such as ``"0,4"`` is not a list of ratios)."""
    if not isinstance(value, (list, tuple)):
        fail(f"{name} must be a list of integers, got {value!r} ({type(value).__name__})", field=name)
    return [int_value(v, f"{name}[{i}]") for i, v in enumerate(value)]


def str_list(value: Any, name: str) -> list[str]:
    """``value`` as a list of strings; else fail naming ``name``."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        fail(f"{name} must be a list of strings, got {value!r}", field=name)
    return list(value)


def _yarn_scaling(params: dict[str, Any], where: str) -> dict[str, Any]:
    """The frequency parameters of a YaRN dict; its attention factor must be 1.0."""
    factor = params.get("attention_factor")
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                               or float(factor) != YARN_ATTENTION_FACTOR):
        fail(f"{where}.attention_factor must be {YARN_ATTENTION_FACTOR} (DeepSeek-V4 / V4.1 YaRN scales "
             f"frequencies only, never cos/sin), got {factor!r}", field=f"{where}.attention_factor")
    return {k: v for k, v in params.items() if k not in _NON_SCALING_ROPE_KEYS}


def parse_rope(cfg: Any, text: dict[str, Any]) -> None:
    """rope_scaling / rope_theta / compress_rope_theta from the flat legacy `rope_scaling`
    or transformers' per-type `rope_parameters` ({"main": ..., "compress": ...})."""
    scaling = text.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        fail(f"rope_scaling must be an object or null, got {scaling!r}", field="rope_scaling")
    cfg.rope_scaling = _yarn_scaling(dict(scaling), "rope_scaling") if isinstance(scaling, dict) else scaling
    params = text.get("rope_parameters")
    if cfg.rope_scaling is None and isinstance(params, dict):
        comp = params.get("compress") if isinstance(params.get("compress"), dict) else None
        if comp is not None:
            cfg.compress_rope_theta = comp.get("rope_theta", cfg.compress_rope_theta)
            if comp.get("rope_type", comp.get("type")) == "yarn":
                cfg.rope_scaling = _yarn_scaling(comp, "rope_parameters.compress")
        main = params.get("main") if isinstance(params.get("main"), dict) else None
        if main is not None:
            cfg.rope_theta = main.get("rope_theta", cfg.rope_theta)


def parse_quantization(cfg: Any, raw: dict[str, Any], text: dict[str, Any]) -> None:
    """fp8_block / expert_dtype from `quantization_config` (top level, or inside the text
    config), the block defaulting to the family's `DEFAULT_FP8_BLOCK`."""
    quant = raw.get("quantization_config") or text.get("quantization_config")
    loose = text.get("expert_dtype", raw.get("expert_dtype"))
    if quant and not isinstance(quant, dict):
        fail(f"quantization_config must be an object, got {quant!r}", field="quantization_config")
    if quant:
        block = int_list(quant.get("weight_block_size") or list(type(cfg).DEFAULT_FP8_BLOCK),
                         "quantization_config.weight_block_size")
        if len(block) != 2:
            fail(f"quantization_config.weight_block_size must have 2 entries, got {block}",
                 field="quantization_config.weight_block_size")
        cfg.fp8_block = (block[0], block[1])
        cfg.expert_dtype = quant.get("expert_dtype", loose)
    else:
        cfg.fp8_block = None
        cfg.expert_dtype = loose


# ---- validation steps ------------------------------------------------------------------
COMMON_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                        "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads",
                        "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok",
                        "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters")
COMMON_POSITIVE_FLOATS = ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "swiglu_limit",
                          "routed_scaling_factor")


def check_positive_ints(cfg: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            fail(f"{name} must be a positive integer, got {value!r}", field=name)


def check_positive_floats(cfg: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            fail(f"{name} must be a positive finite number, got {value!r}", field=name)


def validate_common(cfg: DeepseekConfigBase, extra_ints: tuple[str, ...] = (),
                    extra_floats: tuple[str, ...] = (), dspark_checks: Callable[[], None] | None = None) -> None:
    """The checks every family's config runs (its layer schedule is checked by the family)."""
    check_positive_ints(cfg, COMMON_POSITIVE_INTS + extra_ints)
    check_positive_floats(cfg, COMMON_POSITIVE_FLOATS + extra_floats)
    if cfg.num_attention_heads % cfg.o_groups:
        fail(f"num_attention_heads ({cfg.num_attention_heads}) must be divisible by o_groups ({cfg.o_groups})")
    q = cfg.qk_rope_head_dim
    if isinstance(q, bool) or not isinstance(q, int) or not 0 < q <= cfg.head_dim or q % 2:
        fail(f"qk_rope_head_dim must be even and in [2, head_dim={cfg.head_dim}], got {q}", field="qk_rope_head_dim")
    if cfg.index_head_dim < q:
        fail(f"index_head_dim ({cfg.index_head_dim}) must be >= qk_rope_head_dim ({q})", field="index_head_dim")
    if any(r != 0 for r in cfg.mtp_compress_ratios):
        fail("compress_ratios: MTP / DSpark stages must be sliding-only (ratio 0)", field="compress_ratios")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        fail(f"num_experts_per_tok ({cfg.num_experts_per_tok}) exceeds n_routed_experts ({cfg.n_routed_experts})")
    if cfg.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
        fail(f"scoring_func must be one of sqrtsoftplus/sigmoid/softmax, got {cfg.scoring_func!r}",
             field="scoring_func")
    if cfg.n_shared_experts not in (0, 1):
        fail(f"n_shared_experts must be 0 or 1, got {cfg.n_shared_experts}", field="n_shared_experts")
    if cfg.rope_scaling is not None:
        kind = cfg.rope_scaling.get("type", cfg.rope_scaling.get("rope_type"))
        if kind not in ("yarn", "default", None):
            fail(f"rope_scaling type must be 'yarn', got {kind!r}", field="rope_scaling")
        _yarn_scaling(cfg.rope_scaling, "rope_scaling")
    if not 0 <= cfg.bos_token_id < cfg.vocab_size or not 0 <= cfg.eos_token_id < cfg.vocab_size:
        fail(f"bos/eos token ids must be in [0, vocab_size={cfg.vocab_size})")
    if cfg.fp8_block is not None and tuple(cfg.fp8_block) not in ((128, 128), (32, 32)):
        fail(f"quantization_config.weight_block_size must be [128,128] or [32,32], got {list(cfg.fp8_block)}",
             field="quantization_config.weight_block_size")
    if cfg.expert_dtype not in (None, "fp4", "fp8", "bf16"):
        fail(f"expert_dtype must be fp4, fp8 or bf16, got {cfg.expert_dtype!r}", field="expert_dtype")
    if cfg.has_dspark:
        n_all = cfg.num_hidden_layers + len(cfg.mtp_compress_ratios)
        if not cfg.mtp_compress_ratios:
            fail("a DSpark checkpoint needs num_nextn_predict_layers >= 1", field="num_nextn_predict_layers")
        if not cfg.dspark_target_layer_ids or any(not 0 <= i < n_all for i in cfg.dspark_target_layer_ids):
            fail(f"dspark_target_layer_ids must be non-empty layer ids in [0, {n_all}), "
                 f"got {cfg.dspark_target_layer_ids}", field="dspark_target_layer_ids")
        if not 0 <= cfg.dspark_noise_token_id < cfg.vocab_size or cfg.dspark_markov_rank < 1:
            fail("dspark_noise_token_id must be a token id and dspark_markov_rank >= 1")
        temps = cfg.dspark_confidence_temperatures
        if temps and (len(temps) != cfg.dspark_block_size
                      or not all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in temps)):
            fail(f"dspark_confidence_temperatures must hold dspark_block_size={cfg.dspark_block_size} "
                 f"positive finite numbers, got {temps!r}", field="dspark_confidence_temperatures")
        if dspark_checks is not None:
            dspark_checks()


def common_official_json(cfg: DeepseekConfigBase) -> dict[str, Any]:
    """The config.json keys both families write the same way (flat legacy spelling)."""
    out: dict[str, Any] = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": 1, "head_dim": cfg.head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups, "o_lora_rank": cfg.o_lora_rank,
        "sliding_window": cfg.sliding_window,
        "compress_ratios": list(cfg.compress_ratios) + list(cfg.mtp_compress_ratios),
        "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk, "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size, "scoring_func": cfg.scoring_func,
        "norm_topk_prob": cfg.norm_topk_prob, "routed_scaling_factor": cfg.routed_scaling_factor,
        "swiglu_limit": cfg.swiglu_limit,
        "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "compress_rope_theta": cfg.compress_rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "tie_word_embeddings": False,
    }
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    return out


def dspark_official_json(cfg: DeepseekConfigBase) -> dict[str, Any]:
    out: dict[str, Any] = {"dspark_block_size": cfg.dspark_block_size,
                           "dspark_noise_token_id": cfg.dspark_noise_token_id,
                           "dspark_target_layer_ids": list(cfg.dspark_target_layer_ids),
                           "dspark_markov_rank": cfg.dspark_markov_rank}
    if cfg.dspark_confidence_temperatures:
        out["dspark_confidence_temperatures"] = [float(t) for t in cfg.dspark_confidence_temperatures]
    return out
