"""Fixtures for the browser tests: one headless JupyterLab (127.0.0.1, token, settings that
never fetch news nor autosave) and one Debian chromium driven by Playwright, shared by every
notebook of a test module so the start-up cost is paid once.

Chromium comes from Debian (`apt-get install chromium`, done by .ci/run); nothing here
downloads a browser. The tests skip only when no chromium binary is installed.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
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


def shutdown_kernels(base: str, token: str) -> int:
    """Shut every kernel of the JupyterLab server down (its sessions deleted); returns how many.
    Closing a notebook's page leaves its kernel running, and an engine a notebook left warm
    keeps a core busy while the next notebook runs."""
    with urllib.request.urlopen(f"{base}/api/sessions?token={token}", timeout=10) as r:
        sessions = json.load(r)
    for s in sessions:
        req = urllib.request.Request(f"{base}/api/sessions/{s['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(req, timeout=30).close()
    return len(sessions)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium binary; the only reason to skip is that it is not installed."""
    path = _chromium()
    if path is None:
        pytest.skip("no chromium binary installed (.ci/run installs Debian's chromium)")
    return path


@pytest.fixture(scope="module")
def jupyter_lab(tmp_path_factory: pytest.TempPathFactory, chromium: str) -> Iterator[tuple[str, str]]:
    """A JupyterLab server on 127.0.0.1 rooted at the repo; yields (base URL, token)."""
    tmp_path = tmp_path_factory.mktemp("jupyterlab")
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
        yield base, token
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


@pytest.fixture(scope="module")
def browser(chromium: str) -> Iterator[Any]:
    """One headless chromium for the module (a fresh page per notebook)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
        try:
            yield b
        finally:
            b.close()
