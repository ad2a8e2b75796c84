"""What the reliability suites share: servers with fault knobs, a router process, clients that
keep legs in flight, worker pids (procs.py has the other /proc probes), the predicates that say
a request is in its prefill, transfer or decode window (read from server_info), and the fault
suites' request (LONG, GREEDY) with the knobs that widen each of those windows.

Every process starts in its own process group (core/launcher.py) on free 127.0.0.1 ports and is
stopped by pid.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import types
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import httpx

from pdserve.core.launcher import ProcessGroup, http_ok
from pdserve.disagg.handoff import HandoffState

from .cluster import ROOT, Server, free_port, stop_all
from .procs import children
from .tiny_model import make_tiny_model


def shared_tiny_model(tmp_path_factory) -> str:
    """One tiny model per pytest session, shared by every module that asks (built once). Its
    directory is named `tiny`, the model name the OpenAI routes then answer to."""
    path = tmp_path_factory.getbasetemp() / "shared_tiny_model" / "tiny"
    if not (path / "model.safetensors").exists():
        make_tiny_model(str(path))
    return str(path)


def flush_cache(server) -> None:
    """Empty a live server's prefix cache (a server a test killed has none to empty)."""
    try:
        httpx.post(server.url + "/flush_cache", timeout=30).raise_for_status()
    except httpx.TransportError:
        pass


def wait_for(cond, timeout: float, what: str, detail=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{detail()}")
        time.sleep(0.05)


# ---- servers --------------------------------------------------------------------------------
@contextmanager
def running(**servers: Server) -> Iterator[types.SimpleNamespace]:
    """Wait until every server is ready and hand them over by name; stop them all together,
    whatever happened (a module's `cluster` fixture)."""
    try:
        for s in servers.values():
            s.wait_ready()
        yield types.SimpleNamespace(**servers)
    finally:
        stop_all(list(servers.values()))


class KnobServer(Server):
    """A `cluster.Server` whose DP workers are `tests.harness.slow_worker` (fault windows on demand), on
    given or free ports (a restart reuses the same ones)."""

    def __init__(self, role: str, model_dir: str, dp: int = 1, extra: list[str] | None = None,
                 env: dict | None = None, log_dir: str | None = None, port: int | None = None,
                 bootstrap_port: int | None = None):
        self.control = os.path.join(log_dir or "/tmp", f"knobs-{role}-{time.monotonic_ns()}.json")
        self.slow()
        super().__init__(role, model_dir, dp, extra, {**(env or {}), "SLOW_WORKER_CONTROL": self.control},
                         log_dir, port, bootstrap_port)

    def _entry(self) -> list[str]:
        return ["-m", "pdserve.server.launch", "--model-dir", self.model_dir,
                "--worker-module", "tests.harness.slow_worker", "--start-timeout", "120"]

    def slow(self, step_s: float = 0.0, transfer_s: float = 0.0) -> None:
        """Set the workers' fault-window knobs (read before their next step or write)."""
        tmp = self.control + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"step_s": step_s, "transfer_s": transfer_s}, f)
        os.replace(tmp, self.control)

    @property
    def bootstrap_addr(self) -> str:
        return f"127.0.0.1:{self.bootstrap_port}"

    def worker_pids(self) -> dict[int, int]:
        """dp rank -> pid of the live worker processes (children of the front)."""
        out = {}
        for pid in children(self.proc.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if b"--dp-rank" in argv:
                out[int(argv[argv.index(b"--dp-rank") + 1])] = pid
        return out

    def kill_worker(self, rank: int) -> None:
        os.kill(self.worker_pids()[rank], signal.SIGKILL)

    def worker(self, rank: int) -> dict:
        return next(w for w in self.info()["workers"] if w["dp_rank"] == rank)

    def pids(self) -> list[int]:
        return [self.proc.pid, *self.worker_pids().values()]


class Router:
    """`python -m pdserve router` in its own process group, on a given or free port."""

    def __init__(self, prefills: list[Server], decodes: list[Server], *flags: str, log_dir: str,
                 port: int | None = None):
        self.port = port or free_port()
        self.prefills, self.decodes, self.flags, self.log_dir = prefills, decodes, flags, log_dir
        cmd = [sys.executable, "-m", "pdserve", "router", "--pd-disaggregation", "--host", "127.0.0.1",
               "--port", str(self.port), "--log-level", "warning", "--health-check-interval-secs", "1",
               *flags]
        for p in prefills:
            cmd += ["--prefill", p.url, str(p.bootstrap_port)]
        for d in decodes:
            cmd += ["--decode", d.url]
        self.log_path = os.path.join(log_dir, f"router-{self.port}-{time.monotonic_ns()}.log")
        self.group = ProcessGroup(cmd, name="router", log_path=self.log_path, cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": ROOT})

    @property
    def proc(self):
        return self.group.proc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self) -> str:
        return self.group.output()[-3000:]

    def wait_healthy(self, timeout: float = 60.0, headers: dict | None = None) -> "Router":
        self.group.wait_healthy(lambda: http_ok(self.url + "/health", 2.0, headers), timeout,
                                what=self.url + "/health", poll_s=0.05)
        return self

    def restart(self) -> "Router":
        """A new router process on the same port with the same flags."""
        return Router(self.prefills, self.decodes, *self.flags, log_dir=self.log_dir, port=self.port)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.group.signal(sig)

    def stop(self) -> None:
        self.group.stop(grace_s=10.0)


# ---- clients --------------------------------------------------------------------------------
class Legs:
    """Requests in flight on background threads; `result()` gives the httpx.Response or the
    exception the client saw (a dropped connection is an answer too)."""

    def __init__(self, workers: int = 16):
        self.pool = ThreadPoolExecutor(workers)

    def post(self, url: str, body: dict, timeout: float = 60.0, headers: dict | None = None) -> Future:
        def call():
            try:
                with httpx.Client(timeout=timeout) as c:
                    return c.post(url, json=body, headers=headers)
            except httpx.HTTPError as e:
                return e
        return self.pool.submit(call)

    def both(self, prefill: Server, decode: Server, body: dict, path: str = "/generate",
             decode_extra: dict | None = None, timeout: float = 60.0) -> tuple[Future, Future]:
        return (self.post(prefill.url + path, body, timeout),
                self.post(decode.url + path, {**body, **(decode_extra or {})}, timeout))

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def error_of(resp) -> str:
    """The error message of a failed response (or the client-side exception)."""
    if isinstance(resp, Exception):
        return f"{type(resp).__name__}: {resp}"
    try:
        return resp.json()["error"]["message"]
    except Exception:
        return resp.text


def sse_events(text: str) -> list:
    lines = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", text[-500:]
    return [json.loads(ln) for ln in lines[:-1]]


# ---- fault windows and answers ------------------------------------------------------------
LONG = "hello " * 100  # 300 prompt tokens: 5 prefill chunks of 64
N = 24  # output tokens
GREEDY = {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}
LEG_TIMEOUT = 60.0  # a leg with no answer by then hung (FAST_ENV deadlines are <= 20 s)


def widen(phase: str, prefill: KnobServer, decode: KnobServer) -> None:
    """Make LONG's `phase` last long enough to inject a fault inside it: the prefill's steps
    (0.25 s a chunk), its page writes (2.5 s each) or the decode's steps (0.1 s a token)."""
    if phase == "prefill":
        prefill.slow(step_s=0.25)
    elif phase == "transfer":
        prefill.slow(transfer_s=2.5)
    elif phase == "decode":
        decode.slow(step_s=0.1)
    else:
        raise ValueError(f"no fault window {phase!r}")


@contextmanager
def cold_then_fast(*servers: KnobServer) -> Iterator[None]:
    """Each server starts the block with an empty prefix cache (LONG is prefilled in all its
    chunks, not reused from the test before) and leaves it fast again, whatever happened."""
    for s in servers:
        flush_cache(s)
    try:
        yield
    finally:
        for s in servers:
            s.slow()


def room_on(rank: int, dp: int) -> int:
    r = random.getrandbits(63)
    return r - r % dp + rank


def prefilling(srv: KnobServer, rank: int) -> bool:
    w = srv.worker(rank)
    return w["waiting_requests"] + w["running_requests"] > 0


def transferring(srv: KnobServer, rank: int) -> bool:
    """A prefill rank's handoff is writing pages (it has the prompt's KV and the decode's kv_req)."""
    return srv.worker(rank)["extra"]["handoff_states"].get(HandoffState.TRANSFERRING.value, 0) > 0


def kv_req_sent(srv: KnobServer, rank: int) -> bool:
    """A decode rank's handoff has sent its kv_req and waits for the KV."""
    return srv.worker(rank)["extra"]["handoff_states"].get(HandoffState.WAITING_FOR_INPUT.value, 0) > 0


def decoding(srv: KnobServer, rank: int) -> bool:
    w = srv.worker(rank)
    return w["running_requests"] > 0 and w["inflight_transfers"] == 0


def status(resp) -> int | None:
    return None if isinstance(resp, Exception) else resp.status_code


def assert_failed(resp, *words: str) -> None:
    assert status(resp) is not None and status(resp) >= 500, f"expected an error, got {resp!r}: {error_of(resp)}"
    msg = error_of(resp)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
