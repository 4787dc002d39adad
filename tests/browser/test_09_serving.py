"""Notebook 09 (serving under load) in a real browser, as tests/browser/test_jupyterlab.py
runs notebooks 01-08: Run All in JupyterLab (Debian's Chromium through Playwright), then the
latency picker is switched to TPOT the way a person would. Fails on any browser console or
page error, any error / stderr output, a cell that does not finish, or a plotly plot drawn
0 px tall; a screenshot is kept (artifacts/browser/09_serving_under_load.png).

Its own module (so its own JupyterLab): the notebook starts a `deepinfer serve` subprocess
and drives it with `deepinfer bench serve`'s client, a minute or so on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tests.browser.conftest import shutdown_kernels
from tests.browser.test_jupyterlab import (SHOTS, _bad_outputs, _plot_heights, _toggle, _wait_all_cells_ran,
                                           _wait_for_kernel, _wait_text)

if TYPE_CHECKING:
    from playwright.sync_api import Page


def _serving(page: Page) -> None:  # the latency picker redraws its figure for TPOT
    _toggle(page, "TPOT")
    _wait_text(page, "TPOT percentiles vs offered rate", scope=".jp-OutputArea .js-plotly-plot")


#: the notebooks this module runs (notebooks/conftest.py leaves them to it instead of nbval)
NOTEBOOKS: dict[str, Callable[[Page], None]] = {"09_serving_under_load": _serving}


def test_serving_notebook_runs_and_responds_in_jupyterlab(jupyter_lab: tuple[str, str], browser: Any) -> None:
    name = "09_serving_under_load"
    base, token = jupyter_lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1200})
    console: list[str] = []
    page.on("console", lambda m: console.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: console.append(f"page error: {e}"))
    try:
        page.goto(f"{base}/lab/tree/notebooks/{name}.ipynb?token={token}&reset", wait_until="domcontentloaded",
                  timeout=60_000)
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
        _wait_for_kernel(page)
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        _wait_all_cells_ran(page)
        NOTEBOOKS[name](page)
        page.wait_for_timeout(1000)  # let the last redraw land
        assert not _bad_outputs(page), _bad_outputs(page)[0]
        assert not console, "\n".join(console[:10])
        heights = _plot_heights(page)
        assert len(heights) >= 3 and min(heights) > 0, f"plots drawn 0 px tall (or missing): {heights}"
        page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
    except BaseException:
        page.screenshot(path=str(SHOTS / f"{name}-failure.png"), full_page=True)
        raise
    finally:
        page.close()
        shutdown_kernels(base, token)  # the next notebook gets the cores
