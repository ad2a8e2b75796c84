"""`pdserve bench kv-remote` end to end on loopback: both sides in this process, tcp (default
and with set socket buffers) and raw, bytes checked by digest, CPU per GB printed for each kind
(scripts/bench_kv_netns.sh runs it across namespaces)."""

from __future__ import annotations

import argparse
import threading

import pytest

from pdserve.bench import kv_remote_bench
from pdserve.core.launcher import free_port

pytestmark = pytest.mark.timeout(120)


def test_remote_bench_moves_and_checks_the_bytes(capsys):
    import socket

    port = free_port()
    rx = threading.Thread(target=kv_remote_bench.serve, args=("127.0.0.1", port), daemon=True)
    rx.start()
    args = argparse.Namespace(peer=f"127.0.0.1:{port}", host="127.0.0.1", tokens="64,128", repeats=1,
                              run_pages=4, backends="tcp,tcp:1048576")
    for _ in range(100):  # until the receiver listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            threading.Event().wait(0.05)
    kv_remote_bench.run(args)
    rx.join(timeout=30)
    out = capsys.readouterr().out
    assert "tcp/raw" in out and "tcp:1048576/raw" in out and "CPU s/GB" in out
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith(("64", "128"))]
    assert len(rows) == 2
    for row in rows:  # tokens, MiB, 3 rates, 2 ratios, then sender|receiver CPU per kind
        assert len(row) == 10 and all(len(c.split("|")) == 2 for c in row[7:]), row
