"""The generation JSONL: crash-tolerant reading and durable appends.

One JSON object per line, one line per benchmark item. A crash can leave at most a
partial last line (records are appended, flushed and fsynced one at a time); reading
drops such a tail and rewrites the file atomically (temp file + ``os.replace``), so the
next append starts on a clean line and no record is duplicated or lost.

One writer per file: :func:`exclusive` holds an advisory ``flock`` on ``<out>.lock`` for
a whole run, so a second run on the same ``--out`` fails at once instead of writing the
same items again (the lock is a side file because repairs replace the JSONL itself).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from collections.abc import Iterator
from typing import IO, Any

__all__ = ["read_records", "append_record", "git_commit", "jsonable", "exclusive", "OutputLockedError"]


class OutputLockedError(ValueError):
    """Another run holds the output file's lock."""


@contextlib.contextmanager
def exclusive(path: str | Path) -> Iterator[None]:
    """Hold the advisory lock of the generation file ``path`` (``<path>.lock``) while the
    block runs; OutputLockedError at once when another process holds it."""
    lock = Path(str(path) + ".lock")
    with open(lock, "a", encoding="utf-8") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputLockedError(f"{path} is being written by another run (it holds {lock}); wait for it to "
                                    f"finish or write to another file") from None
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)

logger = logging.getLogger(__name__)


def jsonable(value: Any) -> Any:
    """``value`` round-tripped through JSON (paths, dtypes and such become strings)."""
    return json.loads(json.dumps(value, default=str))


@lru_cache(maxsize=1)
def git_commit() -> str:
    """HEAD of the repository this package lives in, or "unknown" (not a checkout, no git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _atomic_write(path: Path, lines: list[str]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_records(path: str | Path, repair: bool = True) -> list[dict[str, Any]]:
    """All records of ``path`` ([] when it does not exist), first record per id kept.

    Args:
        repair: rewrite the file without a truncated last line or duplicate ids.

    Raises:
        ValueError: a line other than the last is not valid JSON (real corruption, which
            is reported rather than silently dropped).
    """
    path = Path(path)
    if not path.exists():
        return []
    raw = path.read_text(encoding="utf-8")
    lines = raw.split("\n")
    complete, tail = lines[:-1], lines[-1]  # text after the last newline was never finished
    records: list[dict[str, Any]] = []
    kept: list[str] = []
    seen: set[str] = set()
    dirty = bool(tail.strip())
    for n, line in enumerate(complete, 1):
        if not line.strip():
            dirty = True
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if n == len(complete) and not tail.strip():  # a torn final line that ends in "\n"
                dirty = True
                continue
            raise ValueError(f"{path}:{n} is not valid JSON; the file is corrupt beyond a torn last line")
        if not isinstance(rec, dict) or "id" not in rec:
            raise ValueError(f"{path}:{n} is not a generation record (no 'id')")
        if str(rec["id"]) in seen:
            dirty = True
            continue
        seen.add(str(rec["id"]))
        records.append(rec)
        kept.append(line)
    if dirty and tail.strip():  # the tail could be a complete record that only lacks "\n"
        try:
            rec = json.loads(tail)
            if isinstance(rec, dict) and "id" in rec and str(rec["id"]) not in seen:
                records.append(rec)
                kept.append(tail)
        except json.JSONDecodeError:
            logger.warning("%s: dropping a truncated last line (%d chars) left by an interrupted run",
                           path, len(tail))
    if dirty and repair:
        _atomic_write(path, kept)
    return records


def append_record(f: IO[str], record: dict[str, Any]) -> None:
    """Append one record and make it durable before the next item starts."""
    f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
    f.flush()
    os.fsync(f.fileno())
