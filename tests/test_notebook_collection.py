"""Every notebook's cells run exactly once in the whole suite: the notebooks that
tests/browser runs (Run All, failing on any error output) are left out of nbval's
collection in a session that runs the browser tests too, and every other notebook stays
under nbval (notebooks/conftest.py)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]


def _conftest():
    spec = importlib.util.spec_from_file_location("notebooks_conftest_under_test", REPO / "notebooks" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _collected(*args: str) -> tuple[set[str], set[str]]:
    """(notebooks nbval collects, browser test modules collected) of ``pytest --collect-only args``."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-p", "no:xdist", "--nbval-lax", "--nbval-current-env", *args],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 5), out.stdout[-3000:] + out.stderr[-3000:]  # 5: nothing left to nbval
    nbval = set(re.findall(r"^notebooks/(\w+)\.ipynb::Cell \d+$", out.stdout, re.M))
    browser = set(re.findall(r"^tests/browser/(test_\w+)\.py::", out.stdout, re.M))
    return nbval, browser


def test_the_suites_notebooks_run_once_each() -> None:
    every = {p.stem for p in (REPO / "notebooks").glob("*.ipynb")}
    nbval, modules = _collected("notebooks/", "tests/browser")
    assert modules == {p.stem for p in (REPO / "tests" / "browser").glob("test_*.py")}  # every browser module runs
    if shutil.which("chromium") or shutil.which("chromium-browser"):
        browser = _conftest().browser_notebooks()
        assert browser and nbval.isdisjoint(browser), nbval & browser
        assert nbval | browser == every, every - (nbval | browser)
    else:  # the browser tests skip without chromium: nbval must run everything
        assert nbval == every


def test_which_sessions_leave_notebooks_to_the_browser(monkeypatch) -> None:
    c = _conftest()
    monkeypatch.setattr(c.shutil, "which", lambda name: "/usr/bin/chromium" if name == "chromium" else None)
    runs = lambda args, ignored=(): c.session_runs_browser_tests(list(args), list(ignored), REPO)  # noqa: E731
    assert runs(["tests", "notebooks/"]) and runs(["."]) and runs(["tests/browser/test_jupyterlab.py"])
    assert not runs(["notebooks/"]) and not runs(["tests/test_workbench.py", "notebooks/"])
    assert not runs(["tests/browser/test_jupyterlab.py::test_notebook_runs_and_responds_in_jupyterlab[01_quickstart]"])
    assert not runs(["tests", "notebooks/"], ignored=["tests/browser"]) and not runs(["."], ignored=["tests"])
    assert runs(["tests", "notebooks/"], ignored=["tests/test_sweep.py"])
    monkeypatch.setattr(c.shutil, "which", lambda name: None)
    assert not runs(["tests", "notebooks/"])  # no chromium: the browser tests skip


def test_the_browser_modules_name_their_notebooks() -> None:
    names = _conftest().browser_notebooks()
    assert names and names <= {p.stem for p in (REPO / "notebooks").glob("*.ipynb")}


def _config(*args: str, keyword: str = "", markexpr: str = "", deselect: list[str] | None = None) -> SimpleNamespace:
    opts = {"nbval_lax": True, "ignore": [], "deselect": deselect}
    return SimpleNamespace(args=list(args), option=SimpleNamespace(keyword=keyword, markexpr=markexpr),
                           getoption=lambda name, default=None: opts.get(name, default),
                           invocation_params=SimpleNamespace(dir=REPO))


def test_a_selective_session_keeps_every_notebook_under_nbval(monkeypatch) -> None:
    """-k / -m / --deselect may drop browser tests, so nothing is left to them; nbval alone
    runs every notebook."""
    c = _conftest()
    monkeypatch.setattr(c.shutil, "which", lambda name: "/usr/bin/chromium")
    nb = REPO / "notebooks" / "01_quickstart.ipynb"
    assert c.pytest_ignore_collect(nb, _config("tests", "notebooks/")) is True
    assert c.pytest_ignore_collect(REPO / "notebooks" / "conftest.py", _config("tests", "notebooks/")) is None
    for config in (_config("tests", "notebooks/", keyword="quick"), _config("tests", "notebooks/", markexpr="not slow"),
                   _config("tests", "notebooks/", deselect=["tests/browser"]), _config("notebooks/")):
        assert c.pytest_ignore_collect(nb, config) is None
