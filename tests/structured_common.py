"""Shared by the structured-output tests that need a small vocabulary: a byte-level BPE
tokenizer (399 tokens, trained here on JSON-like text) for tiny random checkpoints with a
448-wide head (ids 399..447 exist in the logits but not in the tokenizer, so a grammar must
never allow them)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from deepinfer.tokenizer import DEFAULT_BOS_TOKEN, DEFAULT_EOS_TOKEN, DEFAULT_PAD_TOKEN

VOCAB, TOKENIZER_VOCAB = 448, 399


def train_small_tokenizer(path: Path | str) -> None:
    """Write ``tokenizer.json`` (BOS 0, EOS 1, PAD 2) into the checkpoint directory ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = ["name", "value", "true", "false", "null", "tags", "id", "com", "org", "mail", "the", "and"]
    corpus = []
    for _ in range(400):
        obj = {rng.choice(words): rng.choice([rng.randrange(1000), rng.choice(words), [1, 2], True, None])
               for _ in range(rng.randrange(1, 4))}
        corpus.append(json.dumps(obj) + f" {rng.choice(words)}@{rng.choice(words)}.com ({rng.randrange(99)}+1)*2")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, show_progress=False,
                                  special_tokens=[DEFAULT_BOS_TOKEN, DEFAULT_EOS_TOKEN, DEFAULT_PAD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() == TOKENIZER_VOCAB and tok.token_to_id(DEFAULT_EOS_TOKEN) == 1
    tok.save(str(Path(path) / "tokenizer.json"))


# ------------------------------------------------ random walks on a byte vocabulary
BYTE_EOS = 256


def byte_pool(mode: str | None = None):  # type: ignore[no-untyped-def]
    """A GrammarCompilerPool over a byte-level vocabulary (ids 0..255 = bytes, 256 = EOS,
    257..259 special) with both backends, as the engine builds it."""
    import xgrammar as xgr

    from deepinfer.structured.compiler import GrammarCompilerPool
    from deepinfer.structured.llg_backend import build_llg_tokenizer

    table = [bytes([i]) for i in range(256)] + [b"", b"", b"", b""]
    info = xgr.TokenizerInfo(table, xgr.VocabType.RAW, vocab_size=len(table), stop_token_ids=[BYTE_EOS])
    return GrammarCompilerPool(info, max_workers=1, mode=mode,
                               llg_tokenizer=lambda: build_llg_tokenizer(table, BYTE_EOS, lambda s: list(s.encode())))


def allowed_ids(bitmask, row: int = 0, vocab: int = 260) -> list[int]:  # type: ignore[no-untyped-def]
    import torch

    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


def random_walks(compiled, walks: int, seed: int, max_bytes: int = 120) -> list[str | None]:  # type: ignore
    """Walk a compiled grammar (either backend) with uniformly random allowed printable bytes,
    ending with EOS at random once allowed; each completed walk's text (None: not completed)."""
    import random

    import torch

    from deepinfer.structured.matcher import RequestGrammar

    rng, out = random.Random(seed), []
    bitmask = torch.full((1, 9), -1, dtype=torch.int32)
    for _ in range(walks):
        g, text = RequestGrammar(compiled), bytearray()
        while len(text) < max_bytes and not g.is_terminated:
            g.fill(bitmask, 0)
            allowed = allowed_ids(bitmask)
            assert all(t <= BYTE_EOS for t in allowed), f"special ids allowed: {allowed}"
            printable = [t for t in allowed if 32 <= t < 127] or [t for t in allowed if t < 256]
            t = BYTE_EOS if BYTE_EOS in allowed and (rng.random() < 0.3 or not printable) else rng.choice(printable)
            g.accept(t)
            if t != BYTE_EOS:
                text.append(t)
        out.append(text.decode("utf-8") if g.is_terminated else None)
    return out
