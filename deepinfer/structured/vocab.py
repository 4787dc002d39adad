"""xgrammar's view of the vocabulary, built from deepinfer's tokenizer (no transformers).

Each token id maps to the exact bytes the detokenizer produces for it, so a string
the matcher accepted decodes to the same text:

* ordinary byte-level BPE tokens: the GPT-2 byte-to-unicode mapping, inverted;
* added tokens that are not special (``<think>``, ``<｜User｜>``): their text,
  because the tokenizer decodes them verbatim;
* special tokens (BOS, pad, placeholders, ...) and ids past the tokenizer's
  vocabulary but inside the model's logits: empty, which xgrammar treats as
  special and never allows (``skip_special_tokens`` would drop them from the text,
  so allowing them would let the text and the matcher disagree);
* EOS: the grammar's only stop token.

The table is passed as ``VocabType.RAW`` bytes, so xgrammar applies no decoding
of its own; ``vocab_size`` is the model's logits width, which the bitmask covers.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar

    from deepinfer.tokenizer import Tokenizer

__all__ = ["byte_decoder", "token_bytes", "build_tokenizer_info"]


def byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode``: printable stand-in char -> byte."""
    kept = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, shifted = list(kept), 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(kept, chars)}


def _check_byte_level(tokenizer: Tokenizer) -> None:
    """Refuse tokenizers whose token strings are not byte-level BPE (the mapping would be wrong)."""
    spec = json.loads(tokenizer.backend.to_str())
    decoder = spec.get("decoder") or {}
    kinds = [d.get("type") for d in decoder.get("decoders", [])] if decoder.get("type") == "Sequence" \
        else [decoder.get("type")]
    if "ByteLevel" not in kinds or spec.get("model", {}).get("byte_fallback"):
        raise NotImplementedError(
            f"structured output needs a byte-level BPE tokenizer; this one's decoder is {kinds} "
            f"(source {tokenizer.source})")


def token_bytes(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """Bytes of every id in ``[0, vocab_size)`` as the detokenizer emits them (b"" = never allowed)."""
    _check_byte_level(tokenizer)
    decode = byte_decoder()
    added = tokenizer.backend.get_added_tokens_decoder()
    table = [b""] * vocab_size
    for token, i in tokenizer.get_vocab().items():
        if i >= vocab_size:
            continue  # the model can never emit it
        if i in added:
            table[i] = b"" if added[i].special else added[i].content.encode("utf-8")
        else:
            try:
                table[i] = bytes(decode[c] for c in token)
            except KeyError:  # not a byte-level string: never allow rather than guess
                table[i] = b""
    return table


def build_tokenizer_info(tokenizer: Tokenizer, vocab_size: int, eos_token_id: int,
                         table: list[bytes] | None = None) -> xgrammar.TokenizerInfo:
    """TokenizerInfo whose vocab_size equals the model's logits width (``table``: the
    ``token_bytes`` of the tokenizer, when the caller has it already)."""
    import xgrammar as xgr

    if not 0 <= eos_token_id < vocab_size:
        raise ValueError(f"eos_token_id {eos_token_id} is outside the model vocabulary [0, {vocab_size})")
    return xgr.TokenizerInfo(table if table is not None else token_bytes(tokenizer, vocab_size), xgr.VocabType.RAW,
                             vocab_size=vocab_size, stop_token_ids=[eos_token_id])
