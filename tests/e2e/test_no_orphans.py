"""Nothing outlives its parent (issue 17): `pdserve up` killed with SIGKILL takes its router,
servers and their DP workers with it, and a server killed with SIGKILL takes its DP workers;
checked by pid and by the ports being free again, within a deadline. Each check fails without
core/child_process.py's parent-death signal."""

from __future__ import annotations

import os
import signal
import socket
import sys
import uuid

import pytest

from pdserve.core.launcher import ProcessGroup, free_port
from tests.harness.cluster import ROOT
from tests.harness.fault_tools import KnobServer, Legs, shared_tiny_model, wait_for
from tests.harness.procs import alive, children, marked_pids

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
MARK = "PDSERVE_ORPHAN_TEST_MARK"
GONE_S = 15.0  # the kernel signals at once; this only bounds the wait on a loaded machine


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT holds nothing
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def asleep(pid: int) -> bool:
    """The main thread of `pid` sleeps in time.sleep (a worker loop waits in poll instead)."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return "nanosleep" in f.read()
    except OSError:
        return False


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return shared_tiny_model(tmp_path_factory)


def test_sigkill_of_up_leaves_no_process_and_frees_its_ports(tiny, tmp_path):
    token = uuid.uuid4().hex
    ports = [free_port() for _ in range(4)]  # router, prefill, decode, bootstrap
    cmd = [sys.executable, "-m", "pdserve", "up", "--model", tiny, "--log-dir", str(tmp_path),
           "--port", str(ports[0]), "--prefill-port", str(ports[1]), "--decode-port", str(ports[2]),
           "--bootstrap-port", str(ports[3]), "--prefill-dp", "1", "--decode-dp", "1",
           "--dtype", "float32", "--max-total-tokens", "2048", "--start-timeout", "120"]
    out_path = tmp_path / "up.out"
    group = ProcessGroup(cmd, name="pdserve up", log_path=str(out_path), cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT, MARK: token})
    up = group.proc
    try:
        wait_for(lambda: "pdserve is up" in out_path.read_text() or up.poll() is not None, 150,
                 "pdserve up to start", lambda: out_path.read_text()[-2000:])
        assert up.poll() is None, out_path.read_text()
        pids = [p for p in marked_pids(MARK, token) if p != up.pid]
        workers = [p for p in pids if "pdserve.worker" in cmdline(p)]
        assert len(pids) >= 3 + 2 and len(workers) == 2, [cmdline(p) for p in pids]  # 3 fronts, 2 workers
        assert not any(port_free(p) for p in ports), "every listener is up"
        os.kill(up.pid, signal.SIGKILL)  # up alone: its children are in process groups of their own
        up.wait(timeout=10)
        wait_for(lambda: not any(alive(p) for p in pids), GONE_S, "every child of pdserve up to die",
                 lambda: f"alive: {[cmdline(p) for p in pids if alive(p)]}")
        wait_for(lambda: all(port_free(p) for p in ports), GONE_S, "the ports of pdserve up to be free",
                 lambda: f"taken: {[p for p in ports if not port_free(p)]}")
    finally:
        group.kill()
        for pid in marked_pids(MARK, token):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_sigkill_of_a_server_leaves_no_worker_even_one_busy_in_a_step(tiny, tmp_path):
    """The busy worker sleeps in its engine step, so its own once-a-second parent check cannot
    run: only the parent-death signal ends it within the deadline."""
    server = KnobServer("colocated", tiny, dp=1, log_dir=str(tmp_path))
    legs = Legs(workers=1)
    try:
        server.wait_ready()
        workers = list(server.worker_pids().values())
        assert len(workers) == 1, [cmdline(p) for p in children(server.proc.pid)]
        server.slow(step_s=10 * GONE_S)
        legs.post(server.url + "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4}})
        wait_for(lambda: asleep(workers[0]), 30, "the worker asleep in its engine step")
        os.kill(server.proc.pid, signal.SIGKILL)  # the front only, not its process group
        server.proc.wait(timeout=10)
        wait_for(lambda: not any(alive(p) for p in workers), GONE_S, "the dp worker to die",
                 lambda: f"alive: {[cmdline(p) for p in workers if alive(p)]}")
        wait_for(lambda: port_free(server.port), GONE_S, f"port {server.port} to be free")
    finally:
        server.stop()
        legs.close()
