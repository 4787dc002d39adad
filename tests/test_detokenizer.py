"""Tests for deepinfer.detokenizer against the real DeepSeek-V4 vocabulary."""

from __future__ import annotations

import random

import pytest

from deepinfer.detokenizer import IncrementalDetokenizer
from deepinfer.tokenizer import load_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 3:45pm — time for tea?",
    "深度求索（DeepSeek）发布了新的大语言模型，支持一百万个词元的上下文。",
    "Emoji time 😀👍🏽🇨🇳👨‍👩‍👧‍👦✨ and rare ideographs 𠀀𪚥𰻞 mixed with text.",
    "def fib(n):\n\tif n < 2:\n\t\treturn n\n    return fib(n - 1) + fib(n - 2)  # 🐍\r\n\n",
    "Ünïcödé ñ ß Ωμέγα Привет мир عربى हिन्दी 한국어 ไทย",
    "日本語：カタカナとひらがな、そして漢字。",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def stream(tok, prompt_ids, out_ids, chunks=None, **kw):
    """Feed out_ids (one at a time, or in the given chunk sizes); return (detok, deltas)."""
    d = IncrementalDetokenizer(tok, prompt_ids, **kw)
    deltas = []
    i = 0
    sizes = iter(chunks) if chunks is not None else None
    while i < len(out_ids) and not d.finished:
        n = next(sizes) if sizes is not None else 1
        deltas.append(d.update(out_ids[i : i + n]))
        i += n
    deltas.append(d.finish())
    return d, deltas


def reference(tok, out_ids, stop=(), include=False, skip=True):
    """Full decode, cut at the stop string that completes first."""
    text = tok.decode(out_ids, skip_special_tokens=skip)
    best = None
    for s in stop:
        p = text.find(s)
        if p >= 0 and (best is None or (p + len(s), p) < best[:2]):
            best = (p + len(s), p, s)
    if best is None:
        return text, None
    end, start, s = best
    return text[: end if include else start], s


# ------------------------------------------------------------ incremental
@pytest.mark.parametrize("text", CORPUS)
def test_token_by_token_equals_full_decode(tok, text):
    prompt = tok.encode("Answer: ")
    out = tok.encode(text, add_bos=False)
    d, deltas = stream(tok, prompt, out)
    assert "".join(deltas) == d.text == tok.decode(out) == text
    # no delta ever carries a broken character
    assert all("\ufffd" not in x for x in deltas)
    # multi-token characters really are exercised by the corpus
    if text is CORPUS[2]:
        assert any(tok.decode([i]) == "\ufffd" for i in out)


def test_random_slices_of_real_text(tok):
    rng = random.Random(1234)
    ids = tok.encode("\n".join(CORPUS) * 2, add_bos=False)
    for _ in range(150):
        a = rng.randrange(len(ids))
        b = rng.randrange(a, min(len(ids), a + 40) + 1)
        c = rng.randrange(b, min(len(ids), b + 60) + 1)
        prompt, out = ids[a:b], ids[b:c]  # boundaries may split a character
        chunks = [rng.randint(1, 4) for _ in range(len(out))]
        d, deltas = stream(tok, prompt, out, chunks=chunks if rng.random() < 0.5 else None)
        assert "".join(deltas) == d.text == tok.decode(out), (a, b, c)


@pytest.mark.parametrize("skip", [True, False])
def test_random_vocab_ids_match_full_decode(tok, skip):
    # arbitrary ids (invalid UTF-8 runs, special tokens in the middle)
    rng = random.Random(99 + skip)
    special = tok.all_special_ids[:50]
    for _ in range(60):
        out = [
            rng.choice(special) if rng.random() < 0.05 else rng.randrange(tok.vocab_size)
            for _ in range(rng.randint(1, 30))
        ]
        d, deltas = stream(tok, tok.encode("x"), out, skip_special_tokens=skip)
        assert "".join(deltas) == d.text == tok.decode(out, skip_special_tokens=skip)


def test_partial_character_is_held_until_complete(tok):
    out = tok.encode("😀", add_bos=False)
    assert len(out) >= 2
    d = IncrementalDetokenizer(tok, [0])
    assert [d.update(i) for i in out[:-1]] == [""] * (len(out) - 1)
    assert d.update(out[-1]) == "😀"


def test_unfinished_character_flushed_as_replacement(tok):
    out = tok.encode("a😀", add_bos=False)[:-1]  # cut inside the emoji
    d, deltas = stream(tok, [0], out)
    assert "".join(deltas) == tok.decode(out) == d.text
    assert d.text.startswith("a") and d.text.endswith("\ufffd")


def test_special_tokens_skipped_or_kept(tok):
    out = tok.encode("Hi there", add_bos=False) + [tok.eos_token_id]
    d, deltas = stream(tok, [0], out)
    assert "".join(deltas) == "Hi there"
    d, deltas = stream(tok, [0], out, skip_special_tokens=False)
    assert "".join(deltas) == "Hi there" + tok.eos_token


def test_accepts_raw_tokenizers_backend(tok):
    out = tok.encode("raw backend 中文😀", add_bos=False)
    d, deltas = stream(tok.backend, [0], out)
    assert "".join(deltas) == "raw backend 中文😀"


# ------------------------------------------------------------ stop strings
def test_stop_string_across_token_boundaries(tok):
    text = "Hello world. The end is near. More text after."
    out = tok.encode(text, add_bos=False)
    stop = "world. The end"
    # the stop string really spans several tokens
    assert not any(stop in tok.decode([i]) for i in out)
    d, deltas = stream(tok, [0], out, stop=[stop])
    assert d.stopped_by == stop
    assert d.text == "Hello " == "".join(deltas)
    assert d.finished


def test_include_stop_str_in_output(tok):
    out = tok.encode("Hello world. The end is near.", add_bos=False)
    d, deltas = stream(tok, [0], out, stop=["The end"], include_stop_str_in_output=True)
    assert d.stopped_by == "The end"
    assert d.text == "Hello world. The end" == "".join(deltas)


def test_stop_string_inside_multibyte_text(tok):
    text = "我们今天去公园散步，然后回家吃饭😀好吗"
    out = tok.encode(text, add_bos=False)
    d, deltas = stream(tok, [0], out, stop=["回家", "nope"])
    assert (d.text, d.stopped_by) == ("我们今天去公园散步，然后", "回家")
    assert "".join(deltas) == d.text
    d, deltas = stream(tok, [0], out, stop=["😀"], include_stop_str_in_output=True)
    assert "".join(deltas) == d.text == "我们今天去公园散步，然后回家吃饭😀"


def test_partial_stop_string_is_never_streamed(tok):
    out = tok.encode("a#b##c###d", add_bos=False)
    d = IncrementalDetokenizer(tok, [0], stop=["###"])
    streamed = ""
    for i in out:
        streamed += d.update(i)
        # what was streamed never ends in a possible start of the stop string
        assert not streamed.endswith("#") or d.finished
        assert d.text.startswith(streamed)
    assert (streamed, d.text, d.stopped_by) == ("a#b##c", "a#b##c", "###")


def test_hold_back_released_when_no_stop(tok):
    out = tok.encode("value: 1 ##", add_bos=False)
    d = IncrementalDetokenizer(tok, [0], stop=["###"])
    streamed = "".join(d.update(i) for i in out)
    assert streamed == "value: 1 " and d.pending_text == "##"
    assert d.finish() == "##"
    assert d.stopped_by is None and d.text == "value: 1 ##"
    assert d.finish() == ""  # idempotent
    assert d.update(5) == ""  # ignored after finish


def test_first_completed_stop_wins(tok):
    out = tok.encode("xx abcd yy", add_bos=False)
    for chunks in (None, [len(out)]):
        d, deltas = stream(tok, [0], out, chunks=chunks, stop=["abcd", "bc"])
        assert (d.text, d.stopped_by) == ("xx a", "bc")
        d, deltas = stream(tok, [0], out, chunks=chunks, stop=["bcd", "abcd"])
        assert (d.text, d.stopped_by) == ("xx ", "abcd")


def test_updates_after_stop_are_ignored(tok):
    out = tok.encode("one two three four", add_bos=False)
    d = IncrementalDetokenizer(tok, [0], stop=[" two"])
    got = "".join(d.update(i) for i in out)
    assert got == "one" and d.text == "one" and d.stopped_by == " two"
    assert d.update(out) == "" and d.finish() == ""


def test_random_stops_match_reference(tok):
    rng = random.Random(7)
    for _ in range(150):
        text = rng.choice(CORPUS)
        out = tok.encode(text, add_bos=False)
        stops = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(text))
            stops.append(text[a : a + rng.randint(1, 6)])
        if rng.random() < 0.3:
            stops.append("not in the text at all")
        include = rng.random() < 0.5
        chunks = [rng.randint(1, 3) for _ in range(len(out))] if rng.random() < 0.5 else None
        d, deltas = stream(tok, [0], out, chunks=chunks, stop=stops, include_stop_str_in_output=include)
        ref_text, ref_stop = reference(tok, out, stops, include)
        assert "".join(deltas) == d.text == ref_text, (text, stops, include)
        assert d.stopped_by == ref_stop


def test_rejects_empty_stop(tok):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, [0], stop=[""])
    d = IncrementalDetokenizer(tok, [0], stop=None)
    assert d.stop == []
