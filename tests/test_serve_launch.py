"""`deepinfer serve --port 0` and deepinfer.serve.launch: servers started side by side never race
for a port the parent picked (CI once lost one to ``address already in use``)."""

from __future__ import annotations

import os
import socket

import httpx
import pytest

from deepinfer.serve.launch import ready_url, start_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
FLAGS = ["--max-model-len", "64", "--max-num-seqs", "2", "--log-level", "warning"]


def test_ready_url_reads_the_announced_port():
    assert ready_url("deepinfer serve: ready on http://127.0.0.1:43121 (model 'x')\n") == "http://127.0.0.1:43121"
    assert ready_url("INFO: Uvicorn running on http://127.0.0.1:43121") is None


def test_two_servers_on_os_picked_ports_answer_while_the_old_port_is_taken():
    """Two servers each bind a port the OS picks: distinct, both serve a completion. A socket the
    test holds keeps one port taken throughout, which a parent-picked port could have collided with."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        servers = [start_server(FLAGS, cwd=ROOT, env=ENV, timeout=120) for _ in range(2)]
        try:
            ports = {int(s.url.rsplit(":", 1)[1]) for s in servers}
            assert len(ports) == 2 and taken not in ports
            for s in servers:
                r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        finally:
            for s in servers:
                s.stop()
    assert all(s.proc.returncode is not None for s in servers)


def test_a_server_that_exits_before_ready_raises_with_its_output():
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        start_server([*FLAGS, "--max-num-seqs", "0"], cwd=ROOT, env=ENV, timeout=120)


def test_port_is_the_launchers_to_pick():
    with pytest.raises(ValueError, match="--port"):
        start_server(["--port", "8000"])
