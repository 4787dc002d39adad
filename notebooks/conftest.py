"""nbval settings for the workbench notebooks (collected with ``--nbval-lax notebooks/``).

The notebooks are committed without outputs and end with assert cells, so a broken engine
fails them through errors, not through output comparison. For cells that do opt in to
comparison (``# NBVAL_CHECK_OUTPUT``), plotly figures, widget views and HTML tables (all
full of timings and random ids) are left out, and ``nbval_sanitize.cfg`` masks timings,
paths and addresses in text output.
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path

import pytest

#: Output MIME types never compared: plotly JSON, widget views, HTML renderings.
SKIP_MIME = ("application/vnd.plotly.v1+json", "application/vnd.jupyter.widget-view+json",
             "application/vnd.jupyter.widget-state+json", "text/html", "image/png", "image/svg+xml")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Extend nbval's per-notebook ``skip_compare`` with :data:`SKIP_MIME`."""
    for item in items:
        parent = getattr(item, "parent", None)
        if parent is not None and hasattr(parent, "skip_compare"):
            parent.skip_compare = tuple(dict.fromkeys((*parent.skip_compare, *SKIP_MIME)))


# ---- notebooks the browser tests already run -------------------------------------------------
# tests/browser runs every notebook its modules list in ``NOTEBOOKS`` (Run All in JupyterLab)
# and fails on any error or stderr output, so an assert cell failing there fails the suite, as
# under nbval. Running those notebooks under nbval too in the same session doubled the slowest
# part of CI; they are left out of nbval's collection (not skipped: never collected) when the
# session also collects the browser tests and a chromium is installed for them. Alone
# (``pytest --nbval-lax notebooks/``) or without chromium, nbval runs every notebook.

REPO = Path(__file__).resolve().parents[1]
BROWSER_DIR = REPO / "tests" / "browser"


def browser_notebooks() -> set[str]:
    """Names (file stems) of the notebooks some ``tests/browser/test_*.py`` module lists in
    its ``NOTEBOOKS``; a module that fails to import covers none (nbval keeps them)."""
    names: set[str] = set()
    for path in sorted(BROWSER_DIR.glob("test_*.py")):
        try:
            module = importlib.import_module(f"tests.browser.{path.stem}")
        except Exception:  # noqa: BLE001 - a broken browser module must not hide notebooks from nbval
            continue
        names |= {str(n) for n in getattr(module, "NOTEBOOKS", ())}
    return names


def session_runs_browser_tests(args: list[str], ignored: list[str], invocation_dir: Path) -> bool:
    """Whether pytest's positional ``args`` (paths, maybe with ``::node`` ids) collect
    tests/browser, with no ``--ignore`` of it or of a folder above it, and a chromium for it."""
    if shutil.which("chromium") is None and shutil.which("chromium-browser") is None:
        return False  # the browser tests skip: nbval must run the notebooks

    def resolve(arg: str) -> Path:
        return (invocation_dir / arg.split("::", 1)[0]).resolve()

    above = (BROWSER_DIR, *BROWSER_DIR.parents)
    if any(resolve(i) in above for i in ignored):
        return False
    # a node id inside tests/browser runs some of its notebooks only: nbval keeps them all
    return any(resolve(a) in above or (BROWSER_DIR in resolve(a).parents and "::" not in a) for a in args)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave a notebook to the browser tests when this session runs them (see above)."""
    if collection_path.suffix != ".ipynb" or not config.getoption("nbval_lax", default=False):
        return None
    if not hasattr(config, "_deepinfer_browser_notebooks"):
        # -k / -m / --deselect may drop browser tests: then nbval runs every notebook
        selective = config.option.keyword or config.option.markexpr or config.getoption("deselect", default=None)
        runs = not selective and session_runs_browser_tests(list(config.args), list(config.getoption("ignore") or ()),
                                          Path(config.invocation_params.dir))
        config._deepinfer_browser_notebooks = browser_notebooks() if runs else set()
    return True if collection_path.stem in config._deepinfer_browser_notebooks else None


def pytest_report_collectionfinish(config: pytest.Config) -> str | None:
    left = sorted(getattr(config, "_deepinfer_browser_notebooks", ()))
    return f"nbval left to tests/browser (they run there, once): {', '.join(left)}" if left else None
