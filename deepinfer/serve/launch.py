"""Start `deepinfer serve` as a child process and wait until it accepts requests.

Tests, benchmarks and notebooks start servers side by side (pytest-xdist workers, one server per
engine client). Picking a free port in the parent and handing it to the child races: another
process can bind it in between (CI saw ``[Errno 98] address already in use``). So the child binds
port 0 itself and the ready line names the port the OS gave it; :func:`start_server` reads it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

#: what `deepinfer serve` prints once it accepts requests (deepinfer/serve/server.py)
READY_PREFIX = "deepinfer serve: ready on "
_READY_URL = re.compile(re.escape(READY_PREFIX) + r"(http://\S+)")


def ready_url(line: str) -> str | None:
    """The base URL a ready line announces, or None for any other line."""
    m = _READY_URL.search(line)
    return m.group(1) if m else None


@dataclass
class ServerProcess:
    """A running `deepinfer serve` child: its process, base URL and the output read so far."""

    proc: subprocess.Popen
    url: str
    lines: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (graceful shutdown), SIGKILL if it has not exited within ``timeout`` s."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_server(flags: Sequence[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
                 timeout: float = 600.0, command: Sequence[str] | None = None) -> ServerProcess:
    """Run ``python -m deepinfer.cli serve --port 0 *flags`` and return once it is ready.

    ``command`` replaces ``python -m deepinfer.cli serve`` (e.g. the server under a profiler); it must
    take the serve flags after it. ``flags`` must not name ``--port``: the server picks a free one. Its output keeps being read
    (into :attr:`ServerProcess.lines`) so a full pipe never blocks its logging. Raises RuntimeError
    with the server's last output lines if it exits or is not ready within ``timeout`` seconds."""
    if any(f == "--port" or f.startswith("--port=") for f in flags):
        raise ValueError("start_server picks the port itself (--port 0); leave --port out of flags")
    argv = [*(command or (sys.executable, "-m", "deepinfer.cli", "serve")), "--port", "0", *flags]
    proc = subprocess.Popen(argv, cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if not found and (url := ready_url(line)):
                found.append(url)
                ready.set()
        ready.set()  # the pipe closed: the server exited

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.2):
        if time.monotonic() > deadline:
            break
    if not found:
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        raise RuntimeError(f"deepinfer serve was not ready (exit code {code}):\n" + "".join(lines[-40:]))
    return ServerProcess(proc, found[0], lines)

