"""The test harness itself: a server whose port was taken between free_port() and its bind
(any outgoing connection on the machine may take it) is started again on fresh ports."""

from __future__ import annotations

import socket

from tests.harness import cluster  # noqa: E402
from tests.harness.fault_tools import shared_tiny_model  # noqa: E402


def test_server_restarts_when_its_port_was_taken(tmp_path_factory, monkeypatch):
    model = shared_tiny_model(tmp_path_factory)
    taken = socket.create_server(("127.0.0.1", 0))
    real = cluster.free_port
    picks = iter([taken.getsockname()[1]])
    monkeypatch.setattr(cluster, "free_port", lambda: next(picks, None) or real())
    server = cluster.Server("colocated", model, log_dir=str(tmp_path_factory.mktemp("harness")))
    try:
        first = server.port
        server.wait_ready(timeout=120)
        assert server.port != first and server._launches == 2
        assert server.info()["port"] == server.port
    finally:
        server.stop()
        taken.close()
