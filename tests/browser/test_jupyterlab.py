"""End to end in a real browser: every workbench notebook runs (Run All) in JupyterLab in
Debian's Chromium driven by Playwright, then one widget of it is used the way a person
would. A notebook fails on any browser console error or uncaught page error, on any error
or stderr output (harmless log lines must not show in the red stderr style), on a cell that
does not finish, and on any plotly plot drawn 0 px tall. A screenshot of each notebook is
kept as a CI artifact (artifacts/browser/<notebook>.png).

Time: one JupyterLab and one browser for the module; each notebook's own run time plus
about 10 s of browser work (`pytest --durations=0 tests/browser` lists them).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from tests.browser.conftest import REPO, shutdown_kernels

if TYPE_CHECKING:
    from playwright.sync_api import Page

SHOTS = REPO / "artifacts" / "browser"
RUN_TIMEOUT_S = 420


def _wait_for_kernel(page: Page, timeout_s: float = 90) -> None:
    """Wait until the notebook's kernel is idle, accepting the kernel dialog if it pops up
    (JupyterLab asks when the kernel specs arrive after the notebook opened)."""
    deadline = time.monotonic() + timeout_s
    idle = page.get_by_text(re.compile(r"\(ipykernel\) \| Idle"))
    while time.monotonic() < deadline:
        accept = page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept")
        if accept.count():
            accept.first.click()
        elif idle.count():
            return
        page.wait_for_timeout(250)
    raise TimeoutError("the notebook kernel did not become idle")


_PROMPTS_JS = "() => [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(e => e.textContent.trim())"
_ERRORS = ('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"], '
           '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.error"]')


def _bad_outputs(page: Page) -> list[str]:
    errors = page.locator(_ERRORS)
    return [errors.nth(i).inner_text()[:3000] for i in range(errors.count())]


def _wait_all_cells_ran(page: Page, timeout_s: float = RUN_TIMEOUT_S) -> None:
    """Wait until every code cell has an execution count; fail at once on an error output."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        bad = _bad_outputs(page)
        if bad:
            raise AssertionError(f"error / stderr output: {bad[0]}")
        prompts = page.evaluate(_PROMPTS_JS)
        if prompts and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts):
            return
        page.wait_for_timeout(500)
    raise TimeoutError(f"cells still not run after {timeout_s} s: {page.evaluate(_PROMPTS_JS)}")


def _wait_text(page: Page, text: str | re.Pattern, timeout_s: float = 120, scope: str = ".jp-OutputArea") -> None:
    page.locator(scope, has_text=text).first.wait_for(state="attached", timeout=timeout_s * 1000)


def _plot_heights(page: Page) -> list[float]:
    return page.evaluate("() => [...document.querySelectorAll('.jp-OutputArea .js-plotly-plot')]"
                         ".map(e => e.getBoundingClientRect().height)")


def _click(page: Page, label: str) -> None:
    page.locator(".jp-OutputArea .widget-button", has_text=re.compile(rf"^\s*{re.escape(label)}\s*$")).first.click()


def _toggle(page: Page, label: str) -> None:
    page.locator(".jp-OutputArea .widget-toggle-button", has_text=label).first.click()


# ---- one interaction per notebook: what a person would do after Run All -----------------
def _quickstart(page: Page) -> None:
    page.locator(".jp-OutputArea .widget-dropdown select").first.select_option("e2e_s")
    _wait_text(page, "e2e_s (ms)", scope=".jp-OutputArea .js-plotly-plot")


def _batch_tuning(page: Page) -> None:
    _click(page, "Run")
    _wait_text(page, re.compile(r"workload run done in"))


def _timeline(page: Page) -> None:
    _click(page, "Capture")
    _wait_text(page, re.compile(r"capture done in"))


def _speculative(page: Page) -> None:  # speculation off: the rerun's printout has no verify rows
    _toggle(page, "off")
    page.wait_for_function(
        "() => [...document.querySelectorAll('.jp-OutputArea .widget-output')].some(e =>"
        " e.textContent.includes('tok_s_device') && !e.textContent.includes('verify_tokens_per_step'))",
        timeout=120_000)


def _placement(page: Page) -> None:  # the panel must still drive its engine after Run All
    _click(page, "Run workload")
    _wait_text(page, re.compile(r"run 4: \d+ steps"))  # runs 0-3 are the notebook's


def _eval(page: Page) -> None:
    _toggle(page, "items/s")
    _wait_text(page, "items/s per config", scope=".jp-OutputArea .js-plotly-plot")


def _structured(page: Page) -> None:
    _toggle(page, "apply_ms")
    _wait_text(page, "apply_ms per step", scope=".jp-OutputArea .js-plotly-plot")


def _replay(page: Page) -> None:
    _toggle(page, "compact / off")
    _wait_text(page, "prefill compact / off", scope=".jp-OutputArea .js-plotly-plot")


NOTEBOOKS: dict[str, Callable[[Page], None]] = {
    "01_quickstart": _quickstart, "02_batch_tuning": _batch_tuning, "03_profiler_timeline": _timeline,
    "04_speculative_tuning": _speculative, "05_expert_placement": _placement, "06_eval_compare": _eval,
    "07_structured_output": _structured, "08_v41_bounded_replay": _replay,
}


@pytest.mark.parametrize("name", list(NOTEBOOKS))
def test_notebook_runs_and_responds_in_jupyterlab(name: str, jupyter_lab: tuple[str, str], browser: Any) -> None:
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
        assert heights and min(heights) > 0, f"plots drawn 0 px tall: {heights}"
        page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
    except BaseException:
        page.screenshot(path=str(SHOTS / f"{name}-failure.png"), full_page=True)
        raise
    finally:
        page.close()
        shutdown_kernels(base, token)  # the next notebook gets the cores
