"""End to end in a real browser: JupyterLab (headless, 127.0.0.1, token) runs
notebooks/01_quickstart.ipynb in Debian's Chromium driven by Playwright; the plotly plot
and a widget must render, no cell may error, and a screenshot is kept as a CI artifact
(artifacts/browser/quickstart.png).

Chromium comes from Debian (`apt-get install chromium`, done by .ci/run); the test never
downloads a browser. It skips only when no chromium binary is installed.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Page

REPO = Path(__file__).resolve().parents[2]
SCREENSHOT = REPO / "artifacts" / "browser" / "quickstart.png"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
NOTEBOOK_TIMEOUT_S = 150
#: User settings for the test's JupyterLab: no news/update fetches, no autosave (outputs must
#: never land in the committed notebook), every cell kept in the DOM (no windowing).
SETTINGS = {
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
}


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def chromium() -> str:
    """Debian's chromium binary; the only reason to skip is that it is not installed."""
    path = _chromium()
    if path is None:
        pytest.skip("no chromium binary installed (.ci/run installs Debian's chromium)")
    return path


@pytest.fixture
def jupyter_lab(tmp_path: Path, chromium: str) -> Iterator[str]:
    """A JupyterLab server on 127.0.0.1 rooted at the repo; yields its base URL with token."""
    port, token = _free_port(), secrets.token_hex(16)
    for plugin, values in SETTINGS.items():
        path = tmp_path / "settings" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # one torch thread: the browser shares the cores
    log = open(tmp_path / "jupyter.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip", "127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={REPO}", "--ServerApp.open_browser=False",
         "--allow-root", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--LabApp.extension_manager=readonly"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail(f"JupyterLab did not start:\n{(tmp_path / 'jupyter.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield f"{base}|{token}"
    finally:
        try:  # clean shutdown stops the kernels too
            req = urllib.request.Request(f"{base}/api/shutdown?token={token}", method="POST")
            urllib.request.urlopen(req, timeout=5).close()
            proc.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()


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


def _wait_for_output(page: Page, text: str, timeout_s: float = NOTEBOOK_TIMEOUT_S) -> None:
    """Wait for ``text`` in a cell's output; fail at once on an error output."""
    deadline = time.monotonic() + timeout_s
    done = page.locator(".jp-OutputArea-output", has_text=text)
    errors = page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]',
                          has_text=re.compile("Traceback|Error"))
    while time.monotonic() < deadline:
        if done.count():
            return
        if errors.count():
            raise AssertionError(f"a cell failed: {errors.first.inner_text()[:3000]}")
        page.wait_for_timeout(500)
    raise TimeoutError(f"no output {text!r} after {timeout_s} s")


def test_quickstart_runs_in_jupyterlab_in_chromium(jupyter_lab: str, chromium: str) -> None:
    from playwright.sync_api import sync_playwright

    base, token = jupyter_lab.split("|")
    url = f"{base}/lab/tree/notebooks/01_quickstart.ipynb?token={token}&reset"
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1200})
        try:
            page.goto(url, wait_until="domcontentloaded", timeout=60_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            _wait_for_kernel(page)
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
            _wait_for_output(page, "quickstart checks passed")
            plot = page.locator(".jp-OutputArea .js-plotly-plot").first
            plot.wait_for(state="attached", timeout=30_000)
            widget = page.locator(".jp-OutputArea .jupyter-widgets.widget-dropdown, "
                                  ".jp-OutputArea .widget-dropdown").first
            widget.wait_for(state="attached", timeout=30_000)
            plot.evaluate("el => el.scrollIntoView({block: 'start'})")
            page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length > 0",
                                   timeout=30_000)
            page.wait_for_timeout(500)
            page.screenshot(path=str(SCREENSHOT))
            errors = page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
            texts = [errors.nth(i).inner_text() for i in range(errors.count())]
            bad = [t for t in texts if "Traceback" in t or "Error" in t]
            assert not bad, f"error output in the notebook: {bad[0][:2000]}"
            assert page.locator(".jp-OutputArea-output", has_text="Traceback").count() == 0
            assert page.locator(".js-plotly-plot").count() >= 2  # steps figure + FigureWidget
        except BaseException:
            page.screenshot(path=str(SCREENSHOT.with_name("quickstart-failure.png")))
            raise
        finally:
            browser.close()
    assert SCREENSHOT.stat().st_size > 10_000
