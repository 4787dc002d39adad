"""DeepSeek-V4.1 model configuration (`model_type: deepseek_v41`).

The released config.json nests the text model under `text_config` (next to
`vision_config`, `image_token_id` and the top-level `quantization_config`); a flat
text-only config is accepted too. `DeepseekV41Config` is its own dataclass on the fields
both families share (config_common.DeepseekConfigBase: widths, MoE, rope, quantization,
DSpark), parsed and checked by the same helpers as V4's; it has no V4 notions (CSA / HCA
ratios, hash-routed layers). What V4.1 adds is the layer-role schedule:

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

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..config_common import (DeepseekConfigBase, ModelConfigError, check_positive_ints, common_official_json,
                             copy_plain_fields, dspark_official_json, fail, parse_quantization, parse_rope,
                             validate_common)
from ..config_common import int_list, int_value

__all__ = ["DeepseekV41Config", "ModelConfigError", "V41_MODEL_TYPES"]

V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")

# The released 40-layer schedule (transformers' DeepseekV41TextConfig defaults).
RELEASED_RATIOS = [0, 0] + [2] * 18 + [1] * 20
RELEASED_KV_SOURCES = [2, 8, 14, 20]
RELEASED_INDEX_SOURCES = [2, 8, 14, 20, 24, 28, 32, 36]
ENGRAM_TOKEN_MAPS = ("tokenizer", "modulo")


@dataclass
class DeepseekV41Config(DeepseekConfigBase):
    """Architecture hyper-parameters of one DeepSeek-V4.1 checkpoint (defaults = V4.1-Flash)."""

    DEFAULT_FP8_BLOCK: ClassVar[tuple[int, int]] = (32, 32)  # V4.1 ships 32x32 FP8 blocks

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
            fail(f"model_type={top_type!r} is not a DeepSeek-V4.1 config (expected one of {V41_MODEL_TYPES})",
                 field="model_type")
        if text.get("num_hash_layers") not in (None, 0):
            fail(f"num_hash_layers must be 0 for deepseek_v41 (no hash routing), got {text['num_hash_layers']!r}",
                 field="num_hash_layers")
        cfg = cls()
        copy_plain_fields(cfg, text, skip={"compress_ratios", "mtp_compress_ratios", "rope_scaling", "fp8_block",
                                           "expert_dtype", "model_type", "kv_source_layer_ids",
                                           "index_source_layer_ids", "candidate_source_layer_id",
                                           "engram_num_embeddings", "dspark_target_layer_ids", "vision_config",
                                           "image_token_id"})
        if "engram_pad_token_id" in text and "engram_pad_id" not in text:
            cfg.engram_pad_id = int_value(text["engram_pad_token_id"], "engram_pad_token_id")
        if text.get("torch_dtype") is None and raw.get("torch_dtype") is not None:
            cfg.torch_dtype = raw["torch_dtype"]  # the nested file keeps it at the top level
        cfg.vision_config = (raw.get("vision_config") or None) if "text_config" in raw else None  # {} = none
        cfg.image_token_id = int_value(raw.get("image_token_id", text.get("image_token_id", cfg.image_token_id)),
                                       "image_token_id")
        n, n_mtp = int(cfg.num_hidden_layers), int(cfg.num_nextn_predict_layers or 0)
        ratios = text.get("compress_ratios")
        if ratios is None:
            if n == len(RELEASED_RATIOS):
                ratios = list(RELEASED_RATIOS)
            else:  # transformers' scaling of the released pattern to n layers
                n_slide = min(2, n)
                n_enc = max(0, (n - n_slide + 1) // 2)
                ratios = [0] * n_slide + [2] * n_enc + [1] * max(0, n - n_slide - n_enc)
        ratios = int_list(ratios, "compress_ratios")
        if len(ratios) < n:
            fail(f"compress_ratios has {len(ratios)} entries but num_hidden_layers={n}", field="compress_ratios")
        cfg.compress_ratios = ratios[:n]
        cfg.mtp_compress_ratios = (ratios[n:n + n_mtp] + [0] * n_mtp)[:n_mtp]
        kv = text.get("kv_source_layer_ids")
        if kv is None:
            if cfg.compress_ratios == RELEASED_RATIOS[:n] and n == len(RELEASED_RATIOS):
                kv = list(RELEASED_KV_SOURCES)
            else:  # first layer of each same-ratio run of compressed layers
                kv = [i for i, r in enumerate(cfg.compress_ratios)
                      if r > 0 and (i == 0 or cfg.compress_ratios[i - 1] != r)]
        cfg.kv_source_layer_ids = sorted(int_list(kv, "kv_source_layer_ids"))
        idx = text.get("index_source_layer_ids")
        if idx is None:
            idx = list(RELEASED_INDEX_SOURCES) if cfg.kv_source_layer_ids == RELEASED_KV_SOURCES \
                else list(cfg.kv_source_layer_ids)
        cfg.index_source_layer_ids = sorted(int_list(idx, "index_source_layer_ids"))
        cand = text.get("candidate_source_layer_id")
        cfg.candidate_source_layer_id = int_value(cand, "candidate_source_layer_id") if cand is not None else (
            cfg.kv_source_layer_ids[-1] if cfg.kv_source_layer_ids else -1)
        if cfg.candidate_source_layer_id < 0:
            cfg.candidate_source_layer_id = -1
        cfg.engram_layer_ids = int_list(text.get("engram_layer_ids") or [], "engram_layer_ids")
        emb = text.get("engram_num_embeddings")
        cfg.engram_num_embeddings = int_list(emb, "engram_num_embeddings") if emb is not None else []
        targets = text.get("dspark_target_layer_ids")
        if targets is None:
            targets = sorted(i for i in range(n) if i not in cfg.kv_source_layer_ids)[-3:]
        cfg.dspark_target_layer_ids = int_list(targets, "dspark_target_layer_ids")
        if cfg.dspark_block_size and not n_mtp:
            cfg.dspark_block_size = 0  # no draft stages in this checkpoint
        parse_rope(cfg, text)
        parse_quantization(cfg, raw, text)
        if not cfg.engram_num_embeddings and cfg.engram_layer_ids:
            from .engram import engram_table_rows  # the rows the hash layout addresses

            cfg.engram_num_embeddings = engram_table_rows(cfg)
        cfg.validate()
        return cfg

    # ---- validation -------------------------------------------------------------------
    def validate(self) -> None:
        n = self.num_hidden_layers
        validate_common(self, extra_ints=("candidate_topk_blocks", "candidate_block_size"),
                        extra_floats=("gate_temp",), dspark_checks=self._validate_dspark)
        if len(self.compress_ratios) != n:
            fail(f"compress_ratios needs num_hidden_layers={n} backbone entries, got {len(self.compress_ratios)}")
        for i, r in enumerate(self.compress_ratios):
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                fail(f"compress_ratios[{i}]={r!r} must be 0 (sliding only), 1 (per-token) or a pooling ratio > 1")
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
            check_positive_ints(self, ("engram_n_heads", "engram_head_dim", "engram_compressed_vocab_size",
                                       "engram_vocab_size"))
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

    def _validate_dspark(self) -> None:
        if not 1 <= self.dspark_num_experts_per_tok <= self.dspark_n_routed_experts:
            fail("dspark_num_experts_per_tok must be in [1, dspark_n_routed_experts]",
                 field="dspark_num_experts_per_tok")

    # ---- writing ----------------------------------------------------------------------
    def to_official_json(self) -> dict[str, Any]:
        """The nested config.json V4.1 checkpoints ship (text_config + vision_config)."""
        text = {
            "model_type": "deepseek_v41_text", **common_official_json(self),
            "kv_source_layer_ids": list(self.kv_source_layer_ids),
            "index_source_layer_ids": list(self.index_source_layer_ids),
            "candidate_source_layer_id": self.candidate_source_layer_id,
            "candidate_topk_blocks": self.candidate_topk_blocks, "candidate_block_size": self.candidate_block_size,
            "gate_temp": self.gate_temp, "topk_method": "noaux_tc",
            "engram_layer_ids": list(self.engram_layer_ids), "engram_vocab_size": self.engram_vocab_size,
            "engram_num_embeddings": list(self.engram_num_embeddings),
            "engram_max_ngram_size": self.engram_max_ngram_size, "engram_n_heads": self.engram_n_heads,
            "engram_head_dim": self.engram_head_dim, "engram_pad_id": self.engram_pad_id,
            "engram_compressed_vocab_size": self.engram_compressed_vocab_size,
            "engram_token_map": self.engram_token_map, "simulate_kv_quant": self.simulate_kv_quant,
        }
        if self.expert_dtype is not None and self.fp8_block is None:
            text["expert_dtype"] = self.expert_dtype
        if self.num_nextn_predict_layers:
            text.update(dspark_official_json(self), dspark_n_routed_experts=self.dspark_n_routed_experts,
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
