"""Which official tensors are stored in which format.

Official V4 checkpoints keep attention / shared-expert / MTP projections in FP8 e4m3
with E8M0 block scales, routed experts in FP4 (packed e2m1, one E8M0 scale per 32
inputs), and everything else (embedding, head, norms, router, compressors, indexer
weights_proj, mHC parameters, sinks) unquantized.
"""

from __future__ import annotations

import re

_FP8 = re.compile(
    r"(^|\.)(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]|e_proj|h_proj|main_proj|engram\.(wkv|embed))\.weight$"
)
_FP4 = re.compile(r"(^|\.)ffn\.experts\.\d+\.w[123]\.weight$")


def storage_format(name: str, expert_dtype: str | None) -> str:
    """'fp8', 'fp4' or 'dense' for an official tensor name of a quantized checkpoint."""
    if _FP4.search(name):
        return "fp4" if expert_dtype in (None, "fp4") else ("fp8" if expert_dtype == "fp8" else "dense")
    if _FP8.search(name):
        return "fp8"
    return "dense"


def strip_prefix(name: str) -> str:
    """Accept transformers-style `model.` prefixed names too."""
    return name[len("model."):] if name.startswith("model.") else name


# What transformers (5.17 / 5.18) `save_pretrained` writes for DeepseekV4ForCausalLM, by
# official name (checked by saving a tiny random model): `model.`-prefixed official leaf
# names except these. Its reverse rename of the attention's `kv_norm` is lossy: it comes
# out as `attn.norm` (no V4 / V4.1 attention has a norm of that name, so the map is safe).
# `head.weight` is written without a prefix; no MTP stage is written at all.
_TRANSFORMERS_NAMES = [
    (re.compile(r"^embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
    (re.compile(r"^layers\.(\d+)\.attn\.norm\.weight$"), r"layers.\1.attn.kv_norm.weight"),
]


def official_name(name: str) -> str:
    """The official checkpoint name of a tensor stored under its official name, its
    `model.`-prefixed form, or the name transformers' `save_pretrained` gives it."""
    name = strip_prefix(name)
    for pattern, repl in _TRANSFORMERS_NAMES:
        if pattern.match(name):
            return pattern.sub(repl, name)
    return name
