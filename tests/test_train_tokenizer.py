"""The tiny model's BPE tokenizer and token shards, trained here on a small real corpus subset.

What must hold for the engine: V4's special tokens are single ids with V4's spellings and
flags, deepinfer's Tokenizer and LLM.chat's recipe path load the directory unchanged, any
text round-trips, training is reproducible, and the shard loader returns what was written.
"""

from __future__ import annotations

import json
import lzma
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as RawTokenizer

from deepinfer.chat.render import render_prompt
from deepinfer.chat.requests import normalise_chat_inputs
from deepinfer.tokenizer import bundled_tokenizer_dir, load_tokenizer
from deepinfer.train.bpe import train_tokenizer, write_tokenizer_dir
from deepinfer.train.bpe_specials import RECIPE_TOKENS, special_tokens
from deepinfer.train.corpus import BuildOptions, build_corpus, read_corpus
from deepinfer.train.data import build_token_shards, load_token_sources, load_tokens, read_meta

SOURCES = ("python_reference", "chat_math", "chat_json", "chat_facts", "chat_tools")
VOCAB = 1024


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_train")
    build_corpus(BuildOptions(root / "corpus", root / "dl", limit=40, sources=SOURCES))
    tok = train_tokenizer((t for *_, t in read_corpus(root / "corpus", split="train")), VOCAB)
    write_tokenizer_dir(tok, root / "tokenizer")
    build_token_shards(root / "corpus", root / "tokenizer", root / "tokens", xz_preset=1)
    return {"root": root, "corpus": root / "corpus", "tokenizer": root / "tokenizer", "tokens": root / "tokens"}


def test_special_tokens_are_v4_spellings_at_fixed_single_ids(built):
    tok = load_tokenizer(built["tokenizer"])
    v4 = RawTokenizer.from_file(str(bundled_tokenizer_dir() / "tokenizer.json"))
    v4_special = {t.content: t.special for t in v4.get_added_tokens_decoder().values()}
    specs = special_tokens()
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (0, 1, VOCAB)
    assert tok.token_to_id("<｜▁pad▁｜>") == 2
    for i, spec in enumerate(specs):
        assert tok.backend.encode(spec.content, add_special_tokens=False).ids == [i], spec.content
        if spec.content in v4_special:  # same spelling and same decode behaviour as V4
            assert spec.special == v4_special[spec.content], spec.content
    assert set(RECIPE_TOKENS) <= {s.content for s in specs}
    assert set(tok.all_special_ids) == {i for i, s in enumerate(specs) if s.special}
    # decode keeps chat structure (the recipe parses it) and drops BOS/EOS
    ids = tok.encode("<think>two</think>4<｜end▁of▁sentence｜>")
    assert ids[0] == 0 and ids[-1] == 1
    assert tok.decode(ids) == "<think>two</think>4"


def _random_text(rng: random.Random) -> str:
    alphabets = ["abcXYZ  \t\n", "0123456789+-*/=.", "éüßøñç", "日本語の文字", "😀🚀👍🏽", "\r\x00\x7f\u200b",
                 "def f(x):\n    return x", "<｜User｜>", "</think>", "｜DSML｜", "<｜end▁of▁sentence｜>"]
    return "".join(rng.choice(rng.choice(alphabets)) if rng.random() < 0.8 else rng.choice(alphabets)
                   for _ in range(rng.randint(0, 80)))


def test_any_text_round_trips(built):
    tok = load_tokenizer(built["tokenizer"])
    rng = random.Random(1234)
    for _ in range(300):
        text = _random_text(rng)
        ids = tok.encode(text, add_bos=False)
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert max(ids, default=0) < VOCAB
    held_out = [t for *_, split, t in read_corpus(built["corpus"]) if split == "val"]
    assert held_out and all(tok.decode(tok.encode(t, add_bos=False), skip_special_tokens=False) == t
                            for t in held_out)


def test_llm_chat_path_encodes_with_the_recipe_and_single_role_ids(built):
    tok = load_tokenizer(built["tokenizer"])
    tools = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]}}}]
    conversations = [
        [{"role": "user", "content": "What is 2 + 3?"}],
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Add 1."}],
         "tools": tools, "thinking": {"type": "disabled"}},
    ]
    role_ids = {tok.token_to_id(t) for t in ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜")}
    assert None not in role_ids
    for conv in conversations:
        request = normalise_chat_inputs(conv if isinstance(conv, list) else [conv], "deepseek_v4")[0]
        prompt = render_prompt(request.converted, tok)
        assert prompt.encoded_by == "recipe"
        assert prompt.token_ids == tok.encode(prompt.prompt)
        assert prompt.token_ids[0] == tok.bos_token_id and prompt.token_ids.count(tok.bos_token_id) == 1
        assert tok.decode(prompt.token_ids, skip_special_tokens=False) == prompt.prompt
        n_user = prompt.prompt.count("<｜User｜>")
        assert n_user >= 1 and prompt.token_ids.count(tok.token_to_id("<｜User｜>")) == n_user
        assert prompt.token_ids[-1] in role_ids and prompt.token_ids[-2] == tok.token_to_id("<｜Assistant｜>")


def test_training_is_reproducible_and_vocab_size_is_checked(built):
    texts = [t for *_, t in read_corpus(built["corpus"], split="train")][:60]
    assert train_tokenizer(iter(texts), 600).to_str() == train_tokenizer(iter(texts), 600).to_str()
    with pytest.raises(ValueError, match=r"vocab_size must be in \(323, 65536\]"):
        train_tokenizer(iter(texts), 300)


def test_shards_hold_every_document_as_bos_ids_eos(built):
    tok = load_tokenizer(built["tokenizer"])
    meta = read_meta(built["tokens"])
    assert meta["vocab_size"] == VOCAB and meta["tokenizer_sha256"] != meta["corpus_sha256"]
    for split in ("train", "val"):
        expected = []
        for source in SOURCES:
            for *_, doc_split, text in read_corpus(built["corpus"], sources=[source]):
                if doc_split == split:
                    ids = tok.encode(text, add_bos=True)
                    expected += ids if ids[-1] == tok.eos_token_id else ids + [tok.eos_token_id]
        got = load_tokens(built["tokens"], split)
        assert got.dtype == np.uint16 and got.tolist() == expected
        docs = sum(a["docs"] for a in meta["arrays"] if a["split"] == split)
        starts = np.flatnonzero(got == tok.bos_token_id)
        assert len(starts) == docs and starts[0] == 0 and got[-1] == tok.eos_token_id
        assert (got[starts[1:] - 1] == tok.eos_token_id).all()  # every document ends with EOS
        assert meta["tokens"][split] == got.size
    per_source = load_token_sources(built["tokens"], "val", ["chat_math"])
    assert list(per_source) == ["chat_math"] and per_source["chat_math"][0] == tok.bos_token_id


def test_shard_loader_rejects_bad_requests_and_corrupt_files(built, tmp_path):
    with pytest.raises(ValueError, match="split must be one of"):
        load_tokens(built["tokens"], "test")
    with pytest.raises(ValueError, match=r"sources \['nope'\] are not in"):
        load_tokens(built["tokens"], "train", ["nope"])
    copy = tmp_path / "tokens"
    copy.mkdir()
    (copy / "meta.json").write_text((built["tokens"] / "meta.json").read_text())
    (copy / "train").mkdir()
    (copy / "val").mkdir()
    for row in json.loads((copy / "meta.json").read_text())["arrays"]:
        raw = lzma.decompress((built["tokens"] / row["file"]).read_bytes())
        if row["file"] == "train/chat_math.u16.xz":
            raw = raw[:-2] + bytes([raw[-2] ^ 1, raw[-1]])  # one id changed
        (copy / row["file"]).write_bytes(lzma.compress(raw))
    assert load_tokens(copy, "val").size > 0
    with pytest.raises(ValueError, match="train/chat_math.u16.xz does not match meta.json"):
        load_tokens(copy, "train")


def test_the_loader_needs_only_numpy():
    """The GPU training job imports load_tokens; it must not drag in the corpus builder's dependencies."""
    code = ("import sys, deepinfer.train.data as d; "
            "bad = [m for m in ('deepseek_recipe', 'tokenizers', 'torch', 'deepinfer.train.corpus') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
