"""core/launcher.py with small real process trees (sh, sleep, python -c): a group starts in a
session of its own, a missed health deadline is a clear error with the group stopped, `stop()`
ends every process of the group (grandchildren included, SIGKILL after the grace when SIGTERM is
ignored) and is fine on a process that already exited, and `die_with_parent` keeps
core/child_process.py's parent-death signal. Every wait has a deadline; every group is stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.core.launcher import LaunchError, ProcessGroup, free_port, http_ok, stop_all
from tests.harness.procs import alive

ROOT = Path(__file__).resolve().parents[2]
GONE_S = 10.0  # the kernel kills at once; this only bounds the wait on a loaded machine


def wait_until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)
    return got


def tree(workdir: Path, ignore_term: bool = False) -> list[str]:
    """sh (leader) -> sh (child) -> sleep (grandchild); the child writes both pids to workdir."""
    trap = 'trap "" TERM; ' if ignore_term else ""  # SIG_IGN is inherited: the whole tree ignores it
    inner = ('echo $$ > "$1/child"; sleep 60 & echo $! > "$1/grandchild.tmp"; '
             'mv "$1/grandchild.tmp" "$1/grandchild"; wait')
    return ["sh", "-c", f"{trap}sh -c '{inner}' inner \"$1\" & wait", "leader", str(workdir)]


def descendants(workdir: Path) -> list[int]:
    """The child's and grandchild's pids, once both were written."""
    def read():
        try:
            return [int((workdir / n).read_text()) for n in ("child", "grandchild")]
        except (OSError, ValueError):
            return None
    return wait_until(read, GONE_S, "the process tree to start")


@pytest.fixture
def groups():
    """Every group a test makes, stopped at its end whatever happened."""
    made: list[ProcessGroup] = []
    yield made
    stop_all(made, grace_s=1.0)


def test_start_makes_the_leader_of_its_own_group_and_logs_its_output(tmp_path, groups):
    g = ProcessGroup([sys.executable, "-c", "import time; print('hello', flush=True); time.sleep(60)"],
                     name="sleeper", log_path=str(tmp_path / "out.log"))
    groups.append(g)
    assert g.wait_output(r"hel+o", 20).group(0) == "hello"
    assert os.getpgid(g.pid) == g.pid and os.getsid(g.pid) == g.pid != os.getsid(0)
    assert g.running() and "sleeper" in repr(g)
    assert g.stop() == -signal.SIGTERM and not alive(g.pid)


def test_wait_healthy_returns_once_the_child_serves(tmp_path, groups):
    port = free_port()
    g = ProcessGroup([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                     name="http.server", log_path=str(tmp_path / "http.log"), cwd=str(tmp_path))
    groups.append(g)
    url = f"http://127.0.0.1:{port}/"
    assert g.wait_healthy(lambda: http_ok(url), 30, what=url) is g
    assert http_ok(url) and not http_ok(f"http://127.0.0.1:{port}/missing")
    g.stop()
    assert not http_ok(url, timeout_s=1)


def test_healthy_deadline_exceeded_is_a_clear_error_and_the_group_is_stopped(tmp_path, groups):
    g = ProcessGroup(tree(tmp_path), name="never-ready", log_path=str(tmp_path / "tree.log"))
    groups.append(g)
    pids = descendants(tmp_path)
    with pytest.raises(LaunchError, match=r"never-ready \(pid \d+\) not healthy \(/health\) within 0.3s, stopped") as e:
        g.wait_healthy(lambda: False, 0.3, what="/health")
    assert e.value.returncode is None and isinstance(e.value, RuntimeError)
    assert g.poll() is not None  # reaped
    wait_until(lambda: not any(alive(p) for p in pids), GONE_S, "the child and grandchild to die")


def test_exit_while_starting_names_the_code_and_the_log(tmp_path, groups):
    g = ProcessGroup([sys.executable, "-c", "import sys; print('bad flag --x'); sys.exit(3)"], name="broken",
                     log_path=str(tmp_path / "broken.log"))
    groups.append(g)
    with pytest.raises(LaunchError, match=r"broken \(pid \d+\) exited with code 3 while starting") as e:
        g.wait_healthy(lambda: False, 30)
    assert e.value.returncode == 3 and "bad flag --x" in str(e.value)


@pytest.mark.parametrize("term_group", [True, False], ids=["term_group", "term_leader"])
def test_stop_kills_the_whole_group_including_grandchildren(tmp_path, groups, term_group):
    """term_leader: SIGTERM ends the leader alone and leaves its children; the group SIGKILL
    that follows ends them."""
    g = ProcessGroup(tree(tmp_path), term_group=term_group)
    groups.append(g)
    pids = descendants(tmp_path)
    assert g.stop(grace_s=5) == -signal.SIGTERM
    wait_until(lambda: not any(alive(p) for p in pids), GONE_S, "the child and grandchild to die")


def test_stop_sigkills_after_the_grace_when_sigterm_is_ignored(tmp_path, groups):
    g = ProcessGroup(tree(tmp_path, ignore_term=True))
    groups.append(g)
    pids = descendants(tmp_path)
    t0 = time.monotonic()
    assert g.stop(grace_s=0.3) == -signal.SIGKILL
    assert time.monotonic() - t0 >= 0.3
    wait_until(lambda: not any(alive(p) for p in [g.pid, *pids]), GONE_S, "the tree to die")


def test_stop_of_an_already_dead_process_is_fine(groups):
    g = ProcessGroup(["sh", "-c", "exit 4"])
    groups.append(g)
    assert g.wait(GONE_S) == 4
    assert g.stop() == 4 and g.stop() == 4 and g.kill() == 4  # again and again: nothing left to do
    g.signal(signal.SIGTERM)  # a group that is gone is fine too
    g.signal(signal.SIGTERM, group=False)


def test_stop_all_stops_every_group(tmp_path, groups):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
        groups.append(ProcessGroup(tree(d, ignore_term=d.name == "a")))
    pids = [p for d in dirs for p in descendants(d)]
    stop_all(groups, grace_s=0.3)
    assert [g.poll() for g in groups] == [-signal.SIGKILL, -signal.SIGTERM]
    wait_until(lambda: not any(alive(p) for p in pids), GONE_S, "every tree to die")


def test_die_with_parent_keeps_the_parent_death_signal(tmp_path):
    """A parent that made a group with die_with_parent is SIGKILLed: its child dies with it."""
    code = ("import sys, time; from pdserve.core.launcher import ProcessGroup; "
            "g = ProcessGroup(['sleep', '60'], die_with_parent=True); print(g.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    child = None
    try:
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.kill()
        parent.wait(GONE_S)
        wait_until(lambda: not alive(child), GONE_S, "the child to die with its parent")
    finally:
        parent.kill()
        parent.wait(GONE_S)
        parent.stdout.close()
        if child is not None and alive(child):
            os.killpg(child, signal.SIGKILL)


def test_a_string_command_is_refused():
    with pytest.raises(TypeError):
        ProcessGroup("sleep 1")


def test_free_port_is_free():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
