"""The special token ids the training recipe needs from a tokenizer directory."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer

from deepinfer.tokenizer import DEFAULT_BOS_TOKEN, DEFAULT_EOS_TOKEN, DEFAULT_PAD_TOKEN


def _token_text(value: object, fallback: str) -> str:
    if isinstance(value, dict):
        return str(value.get("content", fallback))
    return str(value) if value else fallback


def special_ids(tokenizer_dir: str) -> dict[str, int]:
    """vocab_size, bos, eos and the DSpark noise id (the pad token: it never occurs in text)."""
    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    conf_file = os.path.join(tokenizer_dir, "tokenizer_config.json")
    conf = json.load(open(conf_file)) if os.path.exists(conf_file) else {}
    out = {"vocab_size": tok.get_vocab_size()}
    for key, name, fallback in (("bos", "bos_token", DEFAULT_BOS_TOKEN), ("eos", "eos_token", DEFAULT_EOS_TOKEN)):
        text = _token_text(conf.get(name), fallback)
        tid = tok.token_to_id(text)
        if tid is None:
            raise ValueError(f"tokenizer in {tokenizer_dir} has no {name} {text!r}")
        out[key] = tid
    noise = tok.token_to_id(DEFAULT_PAD_TOKEN)
    if noise is None:
        raise ValueError(f"tokenizer in {tokenizer_dir} has no {DEFAULT_PAD_TOKEN!r} for DSpark's noise rows")
    out["noise"] = noise
    return out
