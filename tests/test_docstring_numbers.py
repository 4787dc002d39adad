"""Measured numbers and commit hashes live in results and notes, not in docstrings or
comments: a docstring that quotes "1.8x faster" or "at 61c6cdb" is stale the day the code
changes. This guard scans every docstring and comment of the engine, the kernels, the
benchmarks and the profiling scripts for the shapes such claims take (throughput, bandwidth, speedups,
before -> after timings, "took N us", commit hashes) and names each hit. Keep the *why* in
the code and point to the result file or docs/measurements.md.

A hash inside a result file's name (``fastpath_bench_h200_044b4fc.json``) is a pointer, not a
claim, and passes. Targets and thresholds ("target >= 0.9x", "<= 5 ms") are not measured
numbers and no pattern matches them.

A second check needs no pattern for hashes: every standalone hex word in deepinfer/'s and
benchmarks/' docstrings and comments that ``git cat-file -e <word>^{commit}`` resolves to a
commit of this repository fails it, whatever its length.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("deepinfer", "deepinfer_kernels", "benchmarks", "profiling")
_NUM = r"(?<![\w.])~?\d(?:[\d.,]*\d)?"  # a number on its own: not the 16 of bf16
PATTERNS: dict[str, re.Pattern[str]] = {
    "throughput": re.compile(rf"{_NUM}\s*k?\s*tok(?:en)?s?\s*/\s*s\b", re.I),
    "bandwidth / compute": re.compile(rf"{_NUM}\s*(?:[KMGT]i?B|T?FLOP)\s*/\s*s\b", re.I),
    "speedup": re.compile(rf"{_NUM}\s*x\s+(?:faster|slower|speed-?up|cuBLAS|bf16|the weight-only)\b"
                          rf"|{_NUM}-{_NUM}\s*x\b|\b{_NUM}\s*x\s+(?:at|vs)\b", re.I),
    "before -> after": re.compile(rf"{_NUM}\s*(?:us|µs|ms|s|MB|GB)?\s*->\s*{_NUM}\s*(?:us|µs|ms|s|MB|GB)\b"),
    "timing": re.compile(rf"\b(?:took|cost|costs|measured|beat)\b[^.;\n]{{0,40}}?{_NUM}\s*(?:us|µs|ms)\b"
                         rf"|{_NUM}\s*(?:us|µs|ms)\s+(?:in cuBLAS|here|slower|faster)\b"
                         rf"|{_NUM}\s*vs\.?\s*{_NUM}\s*(?:us|µs|ms)\b", re.I),
    "commit hash": re.compile(r"(?<![\w./-])(?=[0-9a-f]{7,12}(?![\w-]))(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}"),
}
#: (path, pattern name) pairs let through, each with its reason. Keep it short.
ALLOWED: dict[tuple[str, str], str] = {}


def _texts(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every docstring and comment of ``path``."""
    src = path.read_text()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                yield first.lineno, first.value.value
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def claims(path: Path, root: Path = REPO) -> list[str]:
    """Each measured-number or commit-hash hit in ``path``'s docstrings and comments."""
    rel = path.relative_to(root).as_posix()
    hits = []
    for line, text in _texts(path):
        for name, pat in PATTERNS.items():
            if (rel, name) in ALLOWED:
                continue
            for m in pat.finditer(text):
                at = line + text.count("\n", 0, m.start())
                hits.append(f"{rel}:{at}: {name}: ...{text[max(0, m.start() - 40):m.end() + 20]!r}")
    return hits


def test_no_measured_numbers_or_commit_hashes_in_docstrings() -> None:
    files = sorted(p for root in ROOTS for p in (REPO / root).rglob("*.py"))
    assert len(files) > 100  # the scan really covers the tree
    hits = [h for p in files for h in claims(p)]
    assert not hits, "move these to results / docs/measurements.md (keep the why):\n" + "\n".join(hits)


#: a hex word of 7-40 characters with a digit and a letter, standing alone: ``_61c6cdb.json`` (a
#: result file's name) is not one, ``(61c6cdb)`` is
_HEX_WORD = re.compile(r"(?<![\w-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")


def _is_commit(token: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{token}^{{commit}}"], cwd=REPO,
                          capture_output=True).returncode == 0


def commit_hashes(paths: list[Path], root: Path = REPO) -> list[str]:
    """Each hex word of the docstrings and comments of ``paths`` that git resolves to a commit of
    this repository: the regex finds candidates, git decides, so a hex constant, a sha256 or an
    identifier that happens to look like a hash never fails the check."""
    hits = []
    for path in paths:
        for line, text in _texts(path):
            for m in _HEX_WORD.finditer(text):
                if _is_commit(m.group()):
                    at = line + text.count("\n", 0, m.start())
                    hits.append(f"{path.relative_to(root).as_posix()}:{at}: {text[max(0, m.start() - 40):m.end() + 20]!r}")
    return hits


def test_no_commit_of_this_repo_named_in_engine_docstrings_or_comments() -> None:
    """A commit named in deepinfer/ or benchmarks/ says "as of then" about code that has moved on;
    the result file that records the run carries the commit instead."""
    if subprocess.run(["git", "rev-parse", "--git-dir"], cwd=REPO, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: no commits to confirm hashes against")
    files = sorted(p for root in ("deepinfer", "benchmarks") for p in (REPO / root).rglob("*.py"))
    hits = commit_hashes(files)
    assert not hits, "point to the result file instead of naming the commit:\n" + "\n".join(hits)


def test_the_commit_check_confirms_with_git(tmp_path) -> None:
    if subprocess.run(["git", "rev-parse", "--git-dir"], cwd=REPO, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    full = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    # the shortest prefix of 9+ characters with a letter: a hash of digits only reads as a number
    head = next((full[:n] for n in range(9, 41) if re.search("[a-f]", full[:n])), None)
    if head is None:
        pytest.skip("HEAD's hash has no letter")
    f = tmp_path / "m.py"
    f.write_text(f'"""fixed at {head}; see results/run_{head}.json"""\n# 0xdeadbeef, abc1234def5 is no commit\nx = 1\n')
    hits = commit_hashes([f], tmp_path)
    assert len(hits) == 1 and f"fixed at {head}" in hits[0], hits


@pytest.mark.parametrize("text, name", [
    ('"""fp8 1.4-1.5x faster than bf16"""', "speedup"),
    ('"""decode reached 2,345 tok/s on the H200"""', "throughput"),
    ("# streams the heads at 4.1 TB/s", "bandwidth / compute"),
    ('"""the host step 168 -> 93 us"""', "before -> after"),
    ("# 8 calls took 82 us in cuBLAS", "timing"),
    ('"""slice assignments: 442 vs 212 us"""', "timing"),
    ('"""the MISS at 61c6cdb"""', "commit hash"),
])
def test_the_guard_catches_each_shape(tmp_path, text: str, name: str) -> None:
    f = tmp_path / "m.py"
    f.write_text(text + "\nx = 1\n")
    hits = claims(f, tmp_path)
    assert any(f": {name}: " in h for h in hits), hits


@pytest.mark.parametrize("text", [
    '"""results in profiling/results/fastpath_bench_h200_044b4fc.json"""',
    '"""target >= 0.9x the offline throughput; <= 5 ms TTFT"""',
    "# sha256 of the file, 0xdeadbeef sentinel, 2 x vocab x width parameters",
])
def test_the_guard_lets_pointers_and_targets_through(tmp_path, text: str) -> None:
    f = tmp_path / "m.py"
    f.write_text(text + "\nx = 1\n")
    assert claims(f, tmp_path) == []
