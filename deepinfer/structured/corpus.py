"""A pinned corpus of real-world JSON schemas (JSONSchemaBench) for the structured-output benchmark.

Source: JSONSchemaBench (epfl-dlab, arXiv 2501.10868; MIT licence per its dataset card),
as the JSON files of its GitHub copy ``guidance-ai/jsonschemabench`` (``data/<category>/*.json``)
at the pinned commit ``CORPUS_COMMIT``. The content is pinned, not the transport: every
file enters ``manifest_digest``, which
must equal ``CORPUS_DIGEST``, however the files arrived (the digest is a sha256 over each
file's path and git blob id, a hash of its bytes, so it covers files a partial clone lacks):

* ``fetch_corpus(dest)`` downloads the commit's tarball over HTTPS and extracts ``data/``;
* ``fetch_corpus(dest, git_dir=...)`` reads the commit from a local clone (offline machines).

``sample(corpus, per_category, seed)`` is a deterministic pick per category; the small
committed sample used by CI lives in ``tests/data/jsonschemabench_sample`` (with its own
per-file pins in ``SAMPLE.json``).
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import subprocess
import tarfile
import urllib.request
from pathlib import Path

__all__ = ["CORPUS_REPO", "CORPUS_COMMIT", "CORPUS_DIGEST", "CORPUS_FILES", "blob_id", "fetch_corpus",
           "load_corpus", "manifest_digest", "sample", "schema_of"]

CORPUS_REPO = "guidance-ai/jsonschemabench"
CORPUS_COMMIT = "ba103c73756198dd9b149ddc7db7867da7a077f6"
#: manifest_digest of the 9558 files under data/ at CORPUS_COMMIT.
CORPUS_DIGEST = "df79c374c868dbd54d92cca2799d405dd74c327f60daf92e2f56fcbdf7032b08"
CORPUS_FILES = 9558
_TARBALL = "https://codeload.github.com/{repo}/tar.gz/{commit}"


def blob_id(data: bytes) -> str:
    """git's object id of a file's bytes (so a listing of ids pins every file's content)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def manifest_digest(ids: dict[str, str]) -> str:
    """sha256 over the sorted lines ``<path> <git blob id>``."""
    return hashlib.sha256("".join(f"{p} {i}\n" for p, i in sorted(ids.items())).encode()).hexdigest()


def _git(git_dir: str | Path, *args: str, data: bytes | None = None) -> bytes:
    return subprocess.run(["git", "--git-dir", str(git_dir), *args], check=True, capture_output=True,
                          input=data).stdout


def _from_git(git_dir: str | Path) -> tuple[dict[str, str], dict[str, bytes]]:
    """(the pinned listing path -> blob id, the contents present in the clone)."""
    ids = {}
    for line in _git(git_dir, "ls-tree", "-r", CORPUS_COMMIT, "data/").decode().splitlines():
        meta, path = line.split("\t", 1)
        if path.endswith(".json"):
            ids[path] = meta.split()[2]
    # one cat-file process for every blob; a partial clone may lack its largest blobs
    out = _git(git_dir, "cat-file", "--batch", data="".join(f"{i}\n" for i in ids.values()).encode())
    files, pos, by_id = {}, 0, {}
    for path, oid in ids.items():
        end = out.index(b"\n", pos)
        header = out[pos:end].decode().split()
        pos = end + 1
        if header[-1] == "missing":
            continue
        size = int(header[2])
        by_id[oid] = out[pos:pos + size]
        pos += size + 1
    for path, oid in ids.items():
        if oid in by_id:
            files[path] = by_id[oid]
    return ids, files


def _from_tarball() -> tuple[dict[str, str], dict[str, bytes]]:
    with urllib.request.urlopen(_TARBALL.format(repo=CORPUS_REPO, commit=CORPUS_COMMIT), timeout=120) as r:
        blob = r.read()
    files = {}
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        for member in tar.getmembers():
            path = member.name.split("/", 1)[-1]  # drop the "<repo>-<commit>/" prefix
            if member.isfile() and path.startswith("data/") and path.endswith(".json"):
                files[path] = tar.extractfile(member).read()  # type: ignore[union-attr]
    return {p: blob_id(b) for p, b in files.items()}, files


def fetch_corpus(dest: str | Path, git_dir: str | Path | None = None) -> dict[str, int]:
    """Write the pinned corpus under ``dest/data/<category>/<name>.json``; raise unless the
    listing matches ``CORPUS_DIGEST`` and every written file its pinned blob id. Files a
    partial clone lacks are skipped and counted. Returns ``{"written": n, "missing": m}``."""
    ids, files = _from_git(git_dir) if git_dir is not None else _from_tarball()
    digest = manifest_digest(ids)
    if digest != CORPUS_DIGEST or len(ids) != CORPUS_FILES:
        raise RuntimeError(f"corpus listing does not match the pin: {len(ids)} files, digest {digest} "
                           f"(pinned {CORPUS_FILES} files, {CORPUS_DIGEST})")
    dest = Path(dest)
    for path, data in files.items():
        if blob_id(data) != ids[path]:
            raise RuntimeError(f"{path}: content does not match its pinned blob id {ids[path]}")
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_bytes(data)
    return {"written": len(files), "missing": len(ids) - len(files)}


def load_corpus(root: str | Path) -> dict[str, dict[str, str]]:
    """``{category: {name: schema JSON text}}`` from ``root/data/<category>/*.json``."""
    out: dict[str, dict[str, str]] = {}
    for path in sorted(Path(root, "data").glob("*/*.json")):
        out.setdefault(path.parent.name, {})[path.stem] = path.read_text(encoding="utf-8")
    return out


def sample(corpus: dict[str, dict[str, str]], per_category: int, seed: int = 0,
           exclude: set[str] | None = None) -> list[tuple[str, str, str]]:
    """``per_category`` schemas of each category, chosen by ``seed``: [(category, name, text)]."""
    rng, out = random.Random(seed), []
    for category in sorted(corpus):
        names = sorted(n for n in corpus[category] if f"{category}/{n}" not in (exclude or set()))
        for name in sorted(rng.sample(names, min(per_category, len(names)))):
            out.append((category, name, corpus[category][name]))
    return out


def schema_of(text: str) -> dict:
    """The schema dict of a corpus file (every file is one JSON object)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"a corpus schema must be a JSON object, got {type(value).__name__}")
    return value
