"""profiling/results_index.py: every script in benchmarks/ is a listed benchmark, every script
in profiling/ a listed study or GPU check, and each benchmark's current result is a file that
exists."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PROFILING = Path(__file__).resolve().parents[1] / "profiling"


def _index():
    spec = importlib.util.spec_from_file_location("results_index", PROFILING / "results_index.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _scripts(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.suffix in (".py", ".sh")}


def test_every_script_is_classified_once_by_its_folder() -> None:
    idx = _index()
    bench = [b.script for b in idx.BENCHMARKS]
    others = list(idx.STUDIES) + list(idx.CHECKS)
    listed = bench + others
    assert len(listed) == len(set(listed)), "a script is in two classes"
    assert idx.BENCH_DIR == PROFILING.parent / "benchmarks" and idx.HERE == PROFILING
    for folder, names, what in [(idx.BENCH_DIR, set(bench), "BENCHMARKS"), (PROFILING, set(others), "STUDIES or CHECKS")]:
        scripts = _scripts(folder)
        assert scripts - names == set(), f"add these to {what} in profiling/results_index.py: {sorted(scripts - names)}"
        assert names - scripts == set(), f"listed in {what} but not in {folder.name}/: {sorted(names - scripts)}"


def test_current_results_exist_and_the_index_names_them() -> None:
    idx = _index()
    text = idx.render()
    for b in idx.BENCHMARKS:
        path, n, _ = idx.current(b)
        if path is None:
            assert n == 0 and f"`{b.script}`" in text
            continue
        assert path.exists() and path.parent == idx.RESULTS and f"`results/{path.name}`" in text
        assert f"| `benchmarks/{b.script}` |" in text


def test_newest_goes_by_commit_date_and_skips_runs_keep_refuses(tmp_path) -> None:
    """The newest result is the one whose commit is newest in git history, not the last file
    name in sort order; ``keep`` drops runs lacking what a reader needs (notebook 03 asks for
    the newest compiled-engine run that recorded a kernel profile)."""
    import json
    import subprocess

    idx = _index()
    def rev(*args: str) -> str:
        return subprocess.run(["git", "rev-list", *args], cwd=PROFILING, capture_output=True, text=True,
                              check=True).stdout.split()[0][:10]

    newer, older = rev("-1", "HEAD"), rev("--max-parents=0", "HEAD")  # HEAD and the first commit
    a, b = tmp_path / f"run_{newer}.json", tmp_path / f"run_{older}zz.json"  # b sorts last by name
    a.write_text(json.dumps({"commit": newer, "profile": None}))
    b.write_text(json.dumps({"commit": older, "profile": [1]}))
    assert idx.newest([a, b]) == a
    assert idx.newest([a, b], keep=lambda r: bool(r.get("profile"))) == b
    assert idx.newest([a], keep=lambda r: bool(r.get("profile"))) is None
