"""Train the tiny model's byte-level BPE: ``python -m deepinfer.train.bpe --corpus build/corpus --out build/tokenizer``.

Writes a checkpoint-style tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``,
what :func:`deepinfer.tokenizer.load_tokenizer` and the chat recipe read) and
``report.json`` (vocabulary size, tokenizer sha256, chars per token per source and split).

Choices, and why:
* byte-level (the 256 byte symbols are in the vocabulary before any merge) and no
  normaliser, so every string encodes and decodes back to itself;
* DeepSeek-V4's special tokens with V4's exact spellings and ``special`` flags at ids 0..66
  (BOS 0, EOS 1, pad 2 as in V4; see :mod:`deepinfer.train.bpe_specials`); their spellings
  are cut out of the training text so no merge is spent on pieces of them;
* digits split one by one (V4 groups up to three): the synthetic arithmetic then shows each
  digit as its own token, which small models learn column arithmetic from more easily;
* 8,192 ids by default: embedding + output head cost 2 x vocab x width parameters; at the
  trained default's width 256 (deepinfer/train/recipe.py) in bf16 that is 8.4 MB of the 32 MB
  checkpoint; 16,384 ids would take 16.8 MB for little more compression, 4,096 ids compress
  clearly worse (validation chars per token of the three sizes: docs/measurements.md).
  ``report.json`` records the compression.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from deepinfer.train.bpe_specials import SpecialTokenSpec, special_tokens
from deepinfer.train.corpus import read_corpus

__all__ = ["PRE_TOKENIZER_PATTERN", "train_tokenizer", "write_tokenizer_dir", "compression_report", "main"]

# A word with at most one leading non-letter (space, "_", "("...), single digits (the first
# one of a number may carry its leading space), runs of
# punctuation with their trailing newlines, newline runs, and whitespace runs that leave
# their last space to the next word (so " x" and "    x" share the word piece).
PRE_TOKENIZER_PATTERN = (r"[^\r\n\p{L}\p{N}]?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _empty_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _plain_pieces(texts: Iterator[str], specials: list[SpecialTokenSpec]) -> Iterator[str]:
    """The training texts with special-token spellings cut out (each piece trains on its own)."""
    cut = re.compile("|".join(re.escape(s.content) for s in sorted(specials, key=lambda s: -len(s.content))))
    for text in texts:
        yield from (piece for piece in cut.split(text) if piece)


def train_tokenizer(texts: Iterator[str], vocab_size: int = 8192, min_frequency: int = 2) -> Tokenizer:
    """Byte-level BPE over ``texts`` with the V4 special tokens at ids 0..len(specials)-1."""
    specials = special_tokens()
    floor = len(specials) + 256
    if not floor < vocab_size <= 65536:
        raise ValueError(f"vocab_size must be in ({floor}, 65536] (the specials + 256 bytes, and uint16 token "
                         f"shards), got {vocab_size}")
    tok = _empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(s.content, special=s.special, normalized=False) for s in specials])
    tok.train_from_iterator(_plain_pieces(texts, specials), trainer=trainer)
    # The trainer registers every reserved token as special; restore V4's flags (decode must keep
    # <think>, <｜User｜>, ...), and check that the ids came out in V4's order.
    spec = json.loads(tok.to_str())
    flags = {s.content: s.special for s in specials}
    for i, entry in enumerate(spec["added_tokens"]):
        if entry["id"] != i or entry["content"] != specials[i].content:
            raise RuntimeError(f"added token {i} came out as {entry['content']!r} at id {entry['id']}")
        entry["special"] = flags[entry["content"]]
    return Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))


def write_tokenizer_dir(tok: Tokenizer, out: Path) -> str:
    """Write tokenizer.json + tokenizer_config.json (V4's keys); returns tokenizer.json's sha256."""
    out.mkdir(parents=True, exist_ok=True)
    specials = special_tokens()
    text = json.dumps(json.loads(tok.to_str()), ensure_ascii=False, indent=1) + "\n"
    (out / "tokenizer.json").write_text(text, encoding="utf-8", newline="\n")

    def added(content: str) -> dict[str, Any]:
        return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False,
                "rstrip": False, "single_word": False}

    config = {"add_bos_token": False, "add_eos_token": False, "bos_token": added(specials[0].content),
              "eos_token": added(specials[1].content), "pad_token": added(specials[1].content),  # as V4: pad = EOS
              "clean_up_tokenization_spaces": False, "model_max_length": 1048576, "unk_token": None,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8", newline="\n")
    return hashlib.sha256(text.encode()).hexdigest()


def compression_report(tok: Tokenizer, corpus: Path, max_chars_per_source: int = 2_000_000) -> dict[str, Any]:
    """Characters per token for each source and split (up to ``max_chars_per_source`` per cell)."""
    cells: dict[tuple[str, str], list[int]] = {}
    batch: dict[tuple[str, str], list[str]] = {}
    for source, _, split, text in read_corpus(corpus):
        cell = cells.setdefault((source, split), [0, 0])
        if cell[0] < max_chars_per_source:
            cell[0] += len(text)
            batch.setdefault((source, split), []).append(text)
    for key, texts in batch.items():
        cells[key][1] = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    return {f"{s}/{sp}": {"chars": c, "tokens": t, "chars_per_token": round(c / t, 3)}
            for (s, sp), (c, t) in sorted(cells.items())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deepinfer.train.bpe", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, default=Path("build/corpus"))
    p.add_argument("--out", type=Path, default=Path("build/tokenizer"))
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--min-frequency", type=int, default=2)
    a = p.parse_args(argv)
    manifest = json.loads((a.corpus / "manifest.json").read_text(encoding="utf-8"))
    t0 = time.perf_counter()
    tok = train_tokenizer((text for *_, text in read_corpus(a.corpus, split="train")), a.vocab_size, a.min_frequency)
    train_s = time.perf_counter() - t0
    digest = write_tokenizer_dir(tok, a.out)
    report = {"vocab_size": tok.get_vocab_size(with_added_tokens=True), "special_tokens": len(special_tokens()),
              "tokenizer_sha256": digest, "corpus_sha256": manifest["corpus_sha256"],
              "pre_tokenizer_pattern": PRE_TOKENIZER_PATTERN, "min_frequency": a.min_frequency,
              "trained_on": "train split of every source", "compression": compression_report(tok, a.corpus)}
    (a.out / "report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{'source/split':<24}{'chars':>12}{'tokens':>11}{'chars/token':>13}")
    for key, row in report["compression"].items():
        print(f"{key:<24}{row['chars']:>12,}{row['tokens']:>11,}{row['chars_per_token']:>13}")
    print(f"vocab {report['vocab_size']} trained in {train_s:.1f} s; tokenizer.json sha256 {digest[:16]}... -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
