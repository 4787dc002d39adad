"""The files of a checkpoint directory, opened as untrusted input.

A checkpoint may come from anywhere, so before anything is read:

* every file must be a regular file (a FIFO would block the loader forever, a symlink to
  ``/dev/zero`` would be read without end); symlinks are followed (the Hugging Face cache
  links snapshot files to its blob store) but must land on a regular file;
* JSON side files (config.json, the shard index) have a size cap;
* shard names from ``model.safetensors.index.json`` must stay inside the checkpoint
  directory: no absolute paths, no ``..`` components;
* every error names the file: a truncated or empty shard, an index that is not JSON or
  has no ``weight_map``.

:func:`shard_headers` reads only the safetensors headers (names, dtypes, shapes), so a
config can be checked against the tensors before any model memory is allocated.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from safetensors import safe_open

__all__ = ["CheckpointError", "regular_file", "read_json", "confined_shard", "shard_files", "shard_headers"]

#: JSON side files larger than this are refused (a real config.json / index is a few MB)
MAX_JSON_BYTES = 64 * 2**20


class CheckpointError(ValueError):
    """The checkpoint does not match the architecture its config describes, or one of its
    files is unusable (the message names the file)."""


def regular_file(path: str, what: str, max_bytes: int | None = None) -> os.stat_result:
    """``os.stat(path)`` of a regular file; CheckpointError naming it otherwise."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise CheckpointError(f"{what} {path}: cannot stat it ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
                or stat.S_ISBLK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else "not a plain file")
        raise CheckpointError(f"{what} {path} is {kind}{' (via a symlink)' if os.path.islink(path) else ''}; "
                              f"checkpoint files must be regular files")
    if max_bytes is not None and st.st_size > max_bytes:
        raise CheckpointError(f"{what} {path} has {st.st_size} bytes, more than the {max_bytes} any such file needs")
    return st


def read_json(path: str, what: str) -> Any:
    """The JSON value in ``path`` (a regular file below MAX_JSON_BYTES)."""
    regular_file(path, what, MAX_JSON_BYTES)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{what} {path} is not valid JSON: {exc}") from None


def confined_shard(directory: str, name: Any, index: str) -> str:
    """``directory/name`` for a shard name from the index, which must be a relative path
    inside the directory (lexically: the name itself may not escape)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointError(f"{index}: weight_map values must be shard file names, got {name!r}")
    norm = os.path.normpath(name)
    if os.path.isabs(name) or norm == os.pardir or norm.startswith(os.pardir + os.sep):
        raise CheckpointError(f"{index}: shard {name!r} lies outside the checkpoint directory {directory}; "
                              f"shards must be named relative to it")
    return os.path.join(directory, norm)


def shard_files(path: str) -> list[str]:
    """The checkpoint's shard files (from the index, else model.safetensors, else every
    *.safetensors in the directory), each checked to be a regular file inside ``path``."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.lexists(index):
        raw = read_json(index, "shard index")
        if not isinstance(raw, dict) or not isinstance(raw.get("weight_map"), dict):
            raise CheckpointError(f"shard index {index} must be a JSON object with a 'weight_map' object "
                                  f"(tensor name -> shard file)")
        files = sorted({confined_shard(path, f, index) for f in raw["weight_map"].values()})
        missing = [os.path.relpath(f, path) for f in files if not os.path.lexists(f)]
        if missing:
            raise CheckpointError(f"checkpoint shards listed in {index} are missing: {missing}")
    elif os.path.lexists(os.path.join(path, "model.safetensors")):
        files = [os.path.join(path, "model.safetensors")]
    else:
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors files in {path!r}")
    for f in files:
        regular_file(f, "checkpoint shard")
    return files


def open_shard(file: str) -> Any:
    """``safe_open`` of one shard; a truncated / empty / non-safetensors file is a
    CheckpointError naming it."""
    try:
        return safe_open(file, framework="pt")
    except Exception as exc:  # SafetensorError, OSError ...: none of them names the file
        raise CheckpointError(f"checkpoint shard {file} is not a readable safetensors file "
                              f"(truncated or empty?): {exc}") from None


def shard_headers(files: list[str]) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """Stored tensor name -> (dtype, shape, file) from the shards' headers only."""
    out: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for file in files:
        with open_shard(file) as f:
            try:
                for name in f.keys():
                    s = f.get_slice(name)
                    out[name] = (str(s.get_dtype()), tuple(int(d) for d in s.get_shape()), file)
            except Exception as exc:  # noqa: BLE001 - a malformed header entry
                raise CheckpointError(f"checkpoint shard {file} has a malformed header: {exc}") from None
    return out
