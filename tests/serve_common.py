"""A real `deepinfer serve` subprocess on 127.0.0.1 for the serve tests (one per test module)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from deepinfer.serve.launch import start_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the engine both the server and the in-process reference LLM are built with
ENGINE = {"max_model_len": 256, "max_num_seqs": 64, "max_num_batched_tokens": 512}


def metric(text: str, name: str) -> float:
    """The value of an unlabelled-but-model_name sample of ``name`` in a /metrics page."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@contextmanager
def serve(*extra: str, timeout: float = 120.0) -> Iterator[str]:
    """Start `deepinfer serve` with ENGINE's limits plus ``extra`` flags; yield its base URL."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    server = start_server([*flags, *extra], cwd=ROOT, env=env, timeout=timeout)
    try:
        yield server.url
    finally:
        server.stop()
