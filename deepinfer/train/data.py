"""Token shards for training: ``python -m deepinfer.train.data --corpus build/corpus --tokenizer build/tokenizer --out build/tokens``.

Every document becomes ``BOS ids... EOS`` (BOS once, as the engine's prompts start; chat
documents already end with the template's EOS, which is not doubled), documents are
concatenated per (split, source) into little-endian uint16 arrays, and each array is stored
xz-compressed as ``<split>/<source>.u16.xz``. ``meta.json`` records the vocabulary size,
BOS/EOS ids, the tokenizer's and corpus's sha256, and per array its documents, characters,
tokens, compressed bytes and the sha256 of the raw ids, which :func:`load_tokens` checks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SPLITS", "build_token_shards", "load_tokens", "load_token_sources", "read_meta", "main"]

FORMAT = "deepinfer-tiny-tokens/1"
SPLITS = ("train", "val")
_DTYPE = np.dtype("<u2")


def _encode_docs(tok: Any, texts: list[str]) -> np.ndarray:
    eos = tok.eos_token_id
    out = []
    for ids in tok.encode_batch(texts, add_bos=True):
        if not ids or ids[-1] != eos:
            ids.append(eos)
        out.append(np.asarray(ids, dtype=_DTYPE))
    return np.concatenate(out) if out else np.zeros(0, dtype=_DTYPE)


def build_token_shards(corpus: Path, tokenizer: Path, out: Path, xz_preset: int = 6) -> dict[str, Any]:
    """Tokenize every document of ``corpus``; writes the shards and meta.json, returns meta."""
    # Imported here so that load_tokens (what the GPU training job calls) needs only numpy:
    # the corpus module pulls in deepseek-recipe and the chat generators.
    from deepinfer.tokenizer import load_tokenizer
    from deepinfer.train.corpus import read_corpus

    tok = load_tokenizer(tokenizer)
    if tok.vocab_size > 65536 or tok.bos_token_id is None or tok.eos_token_id is None:
        raise ValueError(f"{tokenizer}: uint16 shards need <= 65536 ids and BOS/EOS tokens, got vocab "
                         f"{tok.vocab_size}, bos {tok.bos_token_id}, eos {tok.eos_token_id}")
    manifest = json.loads((corpus / "manifest.json").read_text(encoding="utf-8"))
    grouped: dict[tuple[str, str], list[str]] = {}
    for source, _, split, text in read_corpus(corpus):
        grouped.setdefault((split, source), []).append(text)
    arrays = []
    for split in SPLITS:
        (out / split).mkdir(parents=True, exist_ok=True)
        for entry in manifest["sources"]:
            texts = grouped.get((split, entry["name"]), [])
            ids = _encode_docs(tok, texts)
            raw = ids.tobytes()
            path = out / split / f"{entry['name']}.u16.xz"
            path.write_bytes(lzma.compress(raw, format=lzma.FORMAT_XZ, preset=xz_preset))
            arrays.append({"split": split, "source": entry["name"], "kind": entry["kind"],
                           "file": f"{split}/{path.name}", "docs": len(texts),
                           "chars": sum(len(t) for t in texts), "tokens": int(ids.size),
                           "xz_bytes": path.stat().st_size, "ids_sha256": hashlib.sha256(raw).hexdigest()})
    tok_hash = hashlib.sha256(Path(tok.source).read_bytes()).hexdigest()
    meta = {"format": FORMAT, "dtype": "uint16 little-endian", "vocab_size": tok.vocab_size,
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "tokenizer_sha256": tok_hash, "corpus_sha256": manifest["corpus_sha256"],
            "tokens": {s: sum(a["tokens"] for a in arrays if a["split"] == s) for s in SPLITS},
            "xz_bytes": sum(a["xz_bytes"] for a in arrays), "arrays": arrays}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def read_meta(tokens_dir: str | Path) -> dict[str, Any]:
    """The shards' meta.json."""
    path = Path(tokens_dir) / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"no meta.json in {tokens_dir}: build the shards with python -m deepinfer.train.data")
    return json.loads(path.read_text(encoding="utf-8"))


def load_token_sources(tokens_dir: str | Path, split: str, sources: list[str] | None = None) -> dict[str, np.ndarray]:
    """{source: uint16 ids} of one split, in meta.json order, each checked against its recorded sha256.

    Raises:
        ValueError: ``split`` is not train/val, a source is unknown, or an array does not match meta.json.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    meta = read_meta(tokens_dir)
    rows = [a for a in meta["arrays"] if a["split"] == split]
    known = [a["source"] for a in rows]
    if sources is not None and (unknown := sorted(set(sources) - set(known))):
        raise ValueError(f"sources {unknown} are not in {tokens_dir}; it holds {known}")
    out = {}
    for row in rows:
        if sources is not None and row["source"] not in sources:
            continue
        raw = lzma.decompress((Path(tokens_dir) / row["file"]).read_bytes())
        if hashlib.sha256(raw).hexdigest() != row["ids_sha256"] or len(raw) != 2 * row["tokens"]:
            raise ValueError(f"{row['file']} does not match meta.json (sha256 / token count): rebuild the shards")
        out[row["source"]] = np.frombuffer(raw, dtype=_DTYPE).astype(np.uint16)
    return out


def load_tokens(tokens_dir: str | Path, split: str, sources: list[str] | None = None) -> np.ndarray:
    """All token ids of ``split`` ("train" or "val") as one uint16 array (sources in meta.json order)."""
    parts = list(load_token_sources(tokens_dir, split, sources).values())
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deepinfer.train.data", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, default=Path("build/corpus"))
    p.add_argument("--tokenizer", type=Path, default=Path("build/tokenizer"))
    p.add_argument("--out", type=Path, default=Path("build/tokens"))
    p.add_argument("--xz-preset", type=int, default=6, choices=range(10), metavar="0-9")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    meta = build_token_shards(a.corpus, a.tokenizer, a.out, a.xz_preset)
    print(f"{'split/source':<24}{'docs':>7}{'chars':>12}{'tokens':>11}{'chars/tok':>10}{'xz bytes':>12}")
    for r in meta["arrays"]:
        cpt = r["chars"] / r["tokens"] if r["tokens"] else 0.0
        print(f"{r['file'].removesuffix('.u16.xz'):<24}{r['docs']:>7}{r['chars']:>12,}{r['tokens']:>11,}"
              f"{cpt:>10.3f}{r['xz_bytes']:>12,}")
    print(f"tokens {meta['tokens']}; {meta['xz_bytes']:,} bytes compressed; {time.perf_counter() - t0:.1f} s -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
