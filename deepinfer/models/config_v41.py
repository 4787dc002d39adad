"""DeepSeek-V4.1 model configuration (`model_type: deepseek_v41`).

The released config.json nests the text model under `text_config` (next to
`vision_config`, `image_token_id` and the top-level `quantization_config`); a flat
text-only config is accepted too. `DeepseekV41Config` subclasses the V4 config so the
engine code that reads widths (hidden_size, head_dim, sliding_window, vocab_size, ...)
works unchanged; what V4.1 adds is the layer-role schedule:

  compress_ratios[i]   0 = sliding window only, 1 = per-token shared KV ("decoder"),
                       r > 1 = r tokens pooled into one shared entry ("encoder")
  kv_source_layer_ids  layers that own a compressor and publish the shared compressed
                       KV + index keys read by every later layer up to the next source
  index_source_layer_ids  layers that run the indexer and publish a top-k reused by the
                       layers up to the next index source
  candidate_source_layer_id  the index source whose top blocks (of candidate_block_size
                       entries) pre-filter every later index source (-1 disables)
  engram_layer_ids     layers with an n-gram hash memory injected before attention

Every assumption and its public source is listed in docs/v41_assumptions.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from .config import DeepseekV4Config, ModelConfigError

V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")

# The released 40-layer schedule (transformers' DeepseekV41TextConfig defaults).
RELEASED_RATIOS = [0, 0] + [2] * 18 + [1] * 20
RELEASED_KV_SOURCES = [2, 8, 14, 20]
RELEASED_INDEX_SOURCES = [2, 8, 14, 20, 24, 28, 32, 36]
ENGRAM_TOKEN_MAPS = ("tokenizer", "modulo")


@dataclass
class DeepseekV41Config(DeepseekV4Config):
    """Architecture hyper-parameters of one DeepSeek-V4.1 checkpoint (defaults = V4.1-Flash)."""

    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 32
    index_topk: int = 512
    n_routed_experts: int = 384
    moe_intermediate_size: int = 2304
    num_hash_layers: int = 0  # V4.1 has no hash-routed layers
    rms_norm_eps: float = 1e-20
    num_nextn_predict_layers: int = 3
    model_type: str = "deepseek_v41"
    dspark_block_size: int = 5
    # ---- V4.1 additions ---------------------------------------------------------------
    kv_source_layer_ids: list[int] = field(default_factory=list)
    index_source_layer_ids: list[int] = field(default_factory=list)
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    gate_temp: float = 1.0
    engram_layer_ids: list[int] = field(default_factory=list)
    engram_vocab_size: int = 16000000
    engram_num_embeddings: list[int] = field(default_factory=list)
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # deepinfer extension: "tokenizer" = the normalised-token map derived from the V4
    # tokenizer (released checkpoints); "modulo" = token_id % compressed_vocab_size
    # (random tiny checkpoints whose vocabulary is not the V4 tokenizer's).
    engram_token_map: str = "tokenizer"
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # deepinfer extension: apply the checkpoint's KV-cache quantisation to the values the
    # reference path stores (window KV FP8/32, shared KV FP4/16 e4m3, index q/k FP4/32),
    # as the official reference and transformers do ("QAT semantics").
    simulate_kv_quant: bool = True
    image_token_id: int = 129264
    vision_config: dict | None = None

    # ---- roles ------------------------------------------------------------------------
    @property
    def is_v41(self) -> bool:
        return True

    def is_hash_layer(self, layer: int) -> bool:
        return False

    @property
    def csa_layers(self) -> list[int]:  # V4 notions: none in V4.1
        return []

    @property
    def hca_layers(self) -> list[int]:
        return []

    def kv_source_of(self, layer: int) -> int | None:
        """The KV source whose shared cache `layer` reads (None for sliding-only layers)."""
        if self.compress_ratios[layer] == 0:
            return None
        before = [s for s in self.kv_source_layer_ids if s <= layer]
        return max(before) if before else None

    def index_source_of(self, layer: int) -> int | None:
        """The index source whose top-k `layer` uses (itself when it is one)."""
        if self.compress_ratios[layer] == 0:
            return None
        before = [s for s in self.index_source_layer_ids if s <= layer]
        return max(before) if before else None

    @property
    def replay_start_layer(self) -> int | None:
        """First layer of the bounded-replay region: the last KV source. It and every
        later layer own only window KV and feed nothing but each other, so once the
        last source published its shared KV for every row they may run on a suffix."""
        return max(self.kv_source_layer_ids) if self.kv_source_layer_ids else None

    def is_decoder_layer(self, layer: int) -> bool:
        start = self.replay_start_layer
        return start is not None and layer >= start

    @property
    def decoder_layers(self) -> list[int]:
        start = self.replay_start_layer
        return [] if start is None else list(range(start, self.num_hidden_layers))

    # ---- parsing ----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DeepseekV41Config":
        """Build from a V4.1 config.json dict: nested (`text_config`) or flat."""
        raw = dict(raw)
        top_type = raw.get("model_type", "deepseek_v41")
        text = dict(raw["text_config"]) if isinstance(raw.get("text_config"), dict) else dict(raw)
        text_type = text.get("model_type", "deepseek_v41_text")
        if top_type not in V41_MODEL_TYPES or text_type not in V41_MODEL_TYPES:
            raise ModelConfigError(f"config.json model_type={top_type!r} is not a DeepSeek-V4.1 config "
                                   f"(expected one of {V41_MODEL_TYPES})")
        cfg = cls()
        special = {"compress_ratios", "mtp_compress_ratios", "rope_scaling", "fp8_block", "expert_dtype",
                   "model_type", "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id",
                   "engram_num_embeddings", "dspark_target_layer_ids", "vision_config", "image_token_id"}
        for key in set(cls.__dataclass_fields__) - special:
            if key in text and text[key] is not None:
                setattr(cfg, key, text[key])
        if "engram_pad_token_id" in text and "engram_pad_id" not in text:
            cfg.engram_pad_id = int(text["engram_pad_token_id"])
        if isinstance(cfg.eos_token_id, list):
            cfg.eos_token_id = cfg.eos_token_id[0]
        if cfg.bos_token_id is None:
            cfg.bos_token_id = 0
        cfg.vision_config = raw.get("vision_config") if "text_config" in raw else None
        cfg.image_token_id = int(raw.get("image_token_id", text.get("image_token_id", cfg.image_token_id)))
        n, n_mtp = int(cfg.num_hidden_layers), int(cfg.num_nextn_predict_layers or 0)
        ratios = text.get("compress_ratios")
        if ratios is None:
            if n == len(RELEASED_RATIOS):
                ratios = list(RELEASED_RATIOS)
            else:  # transformers' scaling of the released pattern to n layers
                n_slide = min(2, n)
                n_enc = max(0, (n - n_slide + 1) // 2)
                ratios = [0] * n_slide + [2] * n_enc + [1] * max(0, n - n_slide - n_enc)
        ratios = [int(r) for r in ratios]
        if len(ratios) < n:
            raise ModelConfigError(f"config.json compress_ratios has {len(ratios)} entries but num_hidden_layers={n}")
        cfg.compress_ratios = ratios[:n]
        cfg.mtp_compress_ratios = (ratios[n:n + n_mtp] + [0] * n_mtp)[:n_mtp]
        kv = text.get("kv_source_layer_ids")
        if kv is None:
            if cfg.compress_ratios == RELEASED_RATIOS[:n] and n == len(RELEASED_RATIOS):
                kv = list(RELEASED_KV_SOURCES)
            else:  # first layer of each same-ratio run of compressed layers
                kv = [i for i, r in enumerate(cfg.compress_ratios)
                      if r > 0 and (i == 0 or cfg.compress_ratios[i - 1] != r)]
        cfg.kv_source_layer_ids = sorted(int(i) for i in kv)
        idx = text.get("index_source_layer_ids")
        if idx is None:
            idx = list(RELEASED_INDEX_SOURCES) if cfg.kv_source_layer_ids == RELEASED_KV_SOURCES \
                else list(cfg.kv_source_layer_ids)
        cfg.index_source_layer_ids = sorted(int(i) for i in idx)
        cand = text.get("candidate_source_layer_id")
        cfg.candidate_source_layer_id = int(cand) if cand is not None else (
            cfg.kv_source_layer_ids[-1] if cfg.kv_source_layer_ids else -1)
        if cfg.candidate_source_layer_id < 0:
            cfg.candidate_source_layer_id = -1
        cfg.engram_layer_ids = [int(i) for i in (text.get("engram_layer_ids") or [])]
        emb = text.get("engram_num_embeddings")
        cfg.engram_num_embeddings = [int(e) for e in emb] if emb is not None else []
        targets = text.get("dspark_target_layer_ids")
        if targets is None:
            targets = sorted(i for i in range(n) if i not in cfg.kv_source_layer_ids)[-3:]
        cfg.dspark_target_layer_ids = [int(i) for i in targets]
        if cfg.dspark_block_size and not n_mtp:
            cfg.dspark_block_size = 0  # no draft stages in this checkpoint
        # rope: the flat legacy `rope_scaling`, or transformers' per-type `rope_parameters`
        cfg.rope_scaling = text.get("rope_scaling")
        params = text.get("rope_parameters")
        if cfg.rope_scaling is None and isinstance(params, dict):
            comp = params.get("compress") if isinstance(params.get("compress"), dict) else None
            if comp is not None:
                cfg.compress_rope_theta = comp.get("rope_theta", cfg.compress_rope_theta)
                if comp.get("rope_type", comp.get("type")) == "yarn":
                    cfg.rope_scaling = {k: v for k, v in comp.items()
                                        if k not in ("rope_theta", "partial_rotary_factor", "attention_factor")}
            main = params.get("main") if isinstance(params.get("main"), dict) else None
            if main is not None:
                cfg.rope_theta = main.get("rope_theta", cfg.rope_theta)
        quant = raw.get("quantization_config") or text.get("quantization_config")
        if quant:
            block = quant.get("weight_block_size") or [32, 32]
            cfg.fp8_block = (int(block[0]), int(block[1]))
            cfg.expert_dtype = quant.get("expert_dtype", text.get("expert_dtype", raw.get("expert_dtype")))
        else:
            cfg.fp8_block = None
            cfg.expert_dtype = text.get("expert_dtype", raw.get("expert_dtype"))
        if not cfg.engram_num_embeddings and cfg.engram_layer_ids:
            from .engram import engram_table_rows  # the rows the hash layout addresses

            cfg.engram_num_embeddings = engram_table_rows(cfg)
        cfg.validate()
        return cfg

    # ---- validation -------------------------------------------------------------------
    def validate(self) -> None:
        def fail(msg: str) -> None:
            raise ModelConfigError(f"config.json {msg}")

        def positive(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(f"{name} must be a positive integer, got {value!r}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads",
                     "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters", "candidate_topk_blocks",
                     "candidate_block_size"):
            positive(name)
        n = self.num_hidden_layers
        if self.num_attention_heads % self.o_groups:
            fail(f"num_attention_heads ({self.num_attention_heads}) must be divisible by o_groups ({self.o_groups})")
        if not (0 < self.qk_rope_head_dim <= min(self.head_dim, self.index_head_dim)) or self.qk_rope_head_dim % 2:
            fail(f"qk_rope_head_dim must be even and <= head_dim and index_head_dim, got {self.qk_rope_head_dim}")
        if len(self.compress_ratios) != n:
            fail(f"compress_ratios needs num_hidden_layers={n} backbone entries, got {len(self.compress_ratios)}")
        for i, r in enumerate(self.compress_ratios):
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                fail(f"compress_ratios[{i}]={r!r} must be 0 (sliding only), 1 (per-token) or a pooling ratio > 1")
        if any(r != 0 for r in self.mtp_compress_ratios):
            fail("compress_ratios: DSpark / MTP stages must be sliding-only (ratio 0)")
        if self.num_hash_layers:
            fail(f"num_hash_layers must be 0 for deepseek_v41 (no hash routing), got {self.num_hash_layers}")
        kv, idx = self.kv_source_layer_ids, self.index_source_layer_ids
        for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", idx)):
            bad = [i for i in ids if not 0 <= i < n or self.compress_ratios[i] == 0]
            if bad:
                fail(f"{name} {ids}: entries {bad} are out of [0, {n}) or have compress_ratios == 0")
        missing = [s for s in kv if s not in idx]
        if missing:
            fail(f"kv_source_layer_ids {missing} must also be index sources (they own the index keys "
                 f"`attn.indexer.wk`); index_source_layer_ids={idx}")
        for i, r in enumerate(self.compress_ratios):
            if r == 0:
                continue
            src, isrc = self.kv_source_of(i), self.index_source_of(i)
            if src is None:
                fail(f"layer {i} has compress_ratios={r} but no kv_source_layer_ids entry at or before it ({kv})")
            if self.compress_ratios[src] != r:
                fail(f"layer {i} has compress_ratios={r} but reads KV source {src} with ratio "
                     f"{self.compress_ratios[src]}")
            if isrc is None or self.kv_source_of(isrc) != src:
                fail(f"layer {i} reuses the top-k of index source {isrc}, which reads a different KV source "
                     f"than layer {i}'s ({src}); index_source_layer_ids={idx}")
        c = self.candidate_source_layer_id
        if c != -1 and c not in idx:
            fail(f"candidate_source_layer_id ({c}) must be -1 or one of index_source_layer_ids {idx}")
        if c != -1:
            other = [i for i in idx if i > c and self.kv_source_of(i) != self.kv_source_of(c)]
            if other:
                fail(f"index sources {other} come after candidate_source_layer_id {c} but read another KV source: "
                     f"the candidate blocks are positions of KV source {self.kv_source_of(c)}")
        if self.engram_layer_ids:
            bad = [i for i in self.engram_layer_ids if not 0 <= i < n]
            if bad or len(set(self.engram_layer_ids)) != len(self.engram_layer_ids):
                fail(f"engram_layer_ids {self.engram_layer_ids} must be distinct layer ids in [0, {n})")
            for name in ("engram_n_heads", "engram_head_dim", "engram_compressed_vocab_size", "engram_vocab_size"):
                positive(name)
            if self.engram_max_ngram_size < 2:
                fail(f"engram_max_ngram_size must be >= 2, got {self.engram_max_ngram_size}")
            if not 0 <= self.engram_pad_id < self.vocab_size:
                fail(f"engram_pad_id must be a token id, got {self.engram_pad_id}")
            if self.engram_token_map not in ENGRAM_TOKEN_MAPS:
                fail(f"engram_token_map must be one of {ENGRAM_TOKEN_MAPS}, got {self.engram_token_map!r}")
            from .engram import engram_table_rows

            need = engram_table_rows(self)
            if len(self.engram_num_embeddings) != len(self.engram_layer_ids) or any(
                    have < want for have, want in zip(self.engram_num_embeddings, need)):
                fail(f"engram_num_embeddings {self.engram_num_embeddings} must give each engram layer at least "
                     f"the rows its hash layout addresses {need}")
        for name in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "swiglu_limit",
                     "routed_scaling_factor", "gate_temp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                fail(f"{name} must be a positive number, got {value!r}")
        if self.num_experts_per_tok > self.n_routed_experts:
            fail(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            fail(f"scoring_func must be one of sqrtsoftplus/sigmoid/softmax, got {self.scoring_func!r}")
        if self.n_shared_experts not in (0, 1):
            fail(f"n_shared_experts must be 0 or 1, got {self.n_shared_experts}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("type", self.rope_scaling.get("rope_type"))
            if kind not in ("yarn", "default", None):
                fail(f"rope_scaling type must be 'yarn', got {kind!r}")
        if not 0 <= self.eos_token_id < self.vocab_size or not 0 <= self.bos_token_id < self.vocab_size:
            fail(f"bos/eos token ids must be in [0, vocab_size={self.vocab_size})")
        if self.fp8_block is not None and tuple(self.fp8_block) not in ((32, 32), (128, 128)):
            fail(f"quantization_config.weight_block_size must be [32,32] or [128,128], got {list(self.fp8_block)}")
        if self.expert_dtype not in (None, "fp4", "fp8", "bf16"):
            fail(f"expert_dtype must be fp4, fp8 or bf16, got {self.expert_dtype!r}")
        if self.has_dspark:
            n_all = n + len(self.mtp_compress_ratios)
            if not self.mtp_compress_ratios:
                fail("a DSpark checkpoint needs num_nextn_predict_layers >= 1")
            if not self.dspark_target_layer_ids or any(not 0 <= i < n_all for i in self.dspark_target_layer_ids):
                fail(f"dspark_target_layer_ids must be layer ids in [0, {n_all}), got {self.dspark_target_layer_ids}")
            if not 1 <= self.dspark_num_experts_per_tok <= self.dspark_n_routed_experts:
                fail("dspark_num_experts_per_tok must be in [1, dspark_n_routed_experts]")
            if not 0 <= self.dspark_noise_token_id < self.vocab_size or self.dspark_markov_rank < 1:
                fail("dspark_noise_token_id must be a token id and dspark_markov_rank >= 1")

    # ---- writing ----------------------------------------------------------------------
    def to_official_json(self) -> dict[str, Any]:
        """The nested config.json V4.1 checkpoints ship (text_config + vision_config)."""
        text = {
            "model_type": "deepseek_v41_text",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1, "head_dim": self.head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
            "q_lora_rank": self.q_lora_rank, "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window,
            "compress_ratios": list(self.compress_ratios) + list(self.mtp_compress_ratios),
            "kv_source_layer_ids": list(self.kv_source_layer_ids),
            "index_source_layer_ids": list(self.index_source_layer_ids),
            "candidate_source_layer_id": self.candidate_source_layer_id,
            "candidate_topk_blocks": self.candidate_topk_blocks, "candidate_block_size": self.candidate_block_size,
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk, "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size, "scoring_func": self.scoring_func,
            "gate_temp": self.gate_temp, "topk_method": "noaux_tc",
            "norm_topk_prob": self.norm_topk_prob, "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit, "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps,
            "engram_layer_ids": list(self.engram_layer_ids), "engram_vocab_size": self.engram_vocab_size,
            "engram_num_embeddings": list(self.engram_num_embeddings),
            "engram_max_ngram_size": self.engram_max_ngram_size, "engram_n_heads": self.engram_n_heads,
            "engram_head_dim": self.engram_head_dim, "engram_pad_id": self.engram_pad_id,
            "engram_compressed_vocab_size": self.engram_compressed_vocab_size,
            "engram_token_map": self.engram_token_map, "simulate_kv_quant": self.simulate_kv_quant,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": False,
        }
        if self.rope_scaling is not None:
            text["rope_scaling"] = dict(self.rope_scaling)
        if self.expert_dtype is not None and self.fp8_block is None:
            text["expert_dtype"] = self.expert_dtype
        if self.num_nextn_predict_layers:
            text.update(dspark_block_size=self.dspark_block_size, dspark_noise_token_id=self.dspark_noise_token_id,
                        dspark_target_layer_ids=list(self.dspark_target_layer_ids),
                        dspark_markov_rank=self.dspark_markov_rank,
                        dspark_n_routed_experts=self.dspark_n_routed_experts,
                        dspark_num_experts_per_tok=self.dspark_num_experts_per_tok)
        out: dict[str, Any] = {
            "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
            "text_config": text, "vision_config": dict(self.vision_config or {}),
            "image_token_id": self.image_token_id, "torch_dtype": self.torch_dtype,
            "tie_word_embeddings": False,
        }
        if self.fp8_block is not None:
            out["quantization_config"] = {"quant_method": "fp8", "scale_fmt": "ue8m0",
                                          "weight_block_size": list(self.fp8_block),
                                          "expert_dtype": self.expert_dtype or "fp4"}
        return out


def is_v41(cfg: object) -> bool:
    return bool(getattr(cfg, "is_v41", False))


def config_from_dict(raw: dict[str, Any]) -> DeepseekV4Config:
    """DeepseekV4Config or DeepseekV41Config, by the dict's model_type."""
    if raw.get("model_type") in V41_MODEL_TYPES:
        return DeepseekV41Config.from_dict(raw)
    return DeepseekV4Config.from_dict(raw)


def read_model_config(path: str) -> DeepseekV4Config:
    """Read `config.json` from a checkpoint directory (or the file itself), any model type."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise FileNotFoundError(f"no config.json at {file}")
    with open(file) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{file} is not valid JSON: {exc}") from exc
    return config_from_dict(raw)
