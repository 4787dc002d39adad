"""A real `deepinfer serve` subprocess on 127.0.0.1 for the serve tests (one per test module)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the engine both the server and the in-process reference LLM are built with
ENGINE = {"max_model_len": 256, "max_num_seqs": 64, "max_num_batched_tokens": 512}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(text: str, name: str) -> float:
    """The value of an unlabelled-but-model_name sample of ``name`` in a /metrics page."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@contextmanager
def serve(*extra: str, timeout: float = 120.0) -> Iterator[str]:
    """Start `deepinfer serve` with ENGINE's limits plus ``extra`` flags; yield its base URL."""
    port = free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    cmd = [sys.executable, "-m", "deepinfer.cli", "serve", "--port", str(port), *flags, *extra]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "deepinfer serve: ready on" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("deepinfer serve did not start:\n" + "".join(lines[-40:]))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
