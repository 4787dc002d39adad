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
