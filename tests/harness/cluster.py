"""Real pdserve server processes on 127.0.0.1 for end-to-end tests, each a process group
(core/launcher.py) always stopped by pid."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import httpx

from pdserve.core import launcher
from pdserve.core.launcher import LaunchError, ProcessGroup, free_port, http_ok  # a test may patch cluster.free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAST_ENV = {  # short deadlines so failures show up in seconds
    "PDSERVE_BOOTSTRAP_TIMEOUT": "8", "PDSERVE_WAITING_TIMEOUT": "20",
    "PDSERVE_DP_RANK_QUERY_TIMEOUT": "10", "PDSERVE_TOPOLOGY_TIMEOUT": "5",
    "PDSERVE_HEARTBEAT_INTERVAL": "0.5", "PDSERVE_HEARTBEAT_MAX_FAILURE": "2",
    # pages of a room failed while its prefill was unheard: shorter than a partition's write could
    # take (tests of partitions set their own), long enough to see them held
    "PDSERVE_KV_QUARANTINE_TIMEOUT": "4",
}


class Server:
    """`pdserve serve` in its own process group; `stop()` kills the whole group."""

    def __init__(self, role: str, model_dir: str, dp: int = 1, extra: list[str] | None = None,
                 env: dict | None = None, log_dir: str | None = None, port: int | None = None,
                 bootstrap_port: int | None = None):
        self.role, self.dp, self.model_dir = role, dp, model_dir
        self._extra, self._env, self._log_dir = extra or [], env or {}, log_dir or "/tmp"
        self._given_ports = (port, bootstrap_port)  # given ports are kept (a restart reuses them)
        self._launches = 0
        self._launch()

    def _entry(self) -> list[str]:
        """The command before the serve flags (subclasses start another front module)."""
        return ["-m", "pdserve", "serve"]

    def _launch(self) -> None:
        """Start on the given or fresh free ports (again after a port was taken before the bind)."""
        self._launches += 1
        port, bport = self._given_ports
        self.port = port or free_port()
        self.bootstrap_port = (bport or free_port()) if self.role == "prefill" else None
        args = [sys.executable, *self._entry(), "--role", self.role, "--model", self.model_dir,
                "--host", "127.0.0.1", "--port", str(self.port), "--dp-size", str(self.dp),
                "--dtype", "float32", "--max-total-tokens", "2048", "--page-size", "4",
                "--num-threads", "1", "--chunked-prefill-size", "64", "--log-level", "warning"]
        if self.bootstrap_port:
            args += ["--bootstrap-port", str(self.bootstrap_port)]
        args += self._extra
        full_env = {**os.environ, **FAST_ENV, **self._env, "PYTHONPATH": ROOT}
        self.log_path = os.path.join(self._log_dir,
                                     f"pdserve-{self.role}-{self.port}-{time.monotonic_ns()}.log")
        self.group = ProcessGroup(args, name=f"{self.role} server", log_path=self.log_path, env=full_env, cwd=ROOT)

    @property
    def proc(self):
        """The front's subprocess.Popen (the leader of the server's process group)."""
        return self.group.proc

    def _port_was_taken(self) -> bool:
        """The server exited because another process bound its free port after free_port()
        picked it (ephemeral ports are shared with every outgoing connection on the machine)."""
        return (self._given_ports == (None, None) and self._launches < 3 and self.proc.poll() is not None
                and "address already in use" in self.tail(80))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 180.0) -> "Server":
        deadline = time.monotonic() + timeout
        while True:
            try:  # a module waits on its servers one after another: short polls add little
                self.group.wait_healthy(lambda: http_ok(self.url + "/health", 1.0), deadline - time.monotonic(),
                                        what=self.url + "/health", poll_s=0.05)
                return self
            except LaunchError as e:
                if e.returncode is None or not self._port_was_taken():
                    raise
            self._launch()

    def tail(self, n: int = 40) -> str:
        return self.group.tail(n)

    def info(self) -> dict:
        return httpx.get(self.url + "/server_info", timeout=10).json()

    def wait_idle(self, timeout: float = 15.0) -> list[dict]:
        """Every worker back to idle (free + cached == total, nothing running/waiting/in flight)."""
        deadline = time.monotonic() + timeout
        while True:
            workers = self.info()["workers"]
            if all(w["free_pages"] + w["cached_pages"] == w["total_pages"] and w["running_requests"] == 0
                   and w["waiting_requests"] == 0 and w["inflight_transfers"] == 0 for w in workers):
                return workers
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.role} server not idle: {workers}")
            time.sleep(0.1)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """`sig` to the whole group (front and workers); no wait."""
        self.group.signal(sig)

    def stop(self) -> None:
        self.group.stop()


def start_all(servers: list[Server]) -> list[Server]:
    for s in servers:
        s.wait_ready()
    return servers


def stop_all(servers: list[Server]) -> None:
    """Stop servers together: every front gets SIGTERM first, so their shutdowns overlap."""
    launcher.stop_all([s.group for s in servers])


class GenerateProbe:
    """A wait condition for a router: one short /generate through `url` answers 200. `last` keeps
    the latest answer or error, for the message of a wait that ran out."""

    def __init__(self, url: str):
        self.url, self.last = url, ""

    def __call__(self) -> bool:
        try:
            r = httpx.post(self.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}},
                           timeout=30)
            self.last = f"{r.status_code} {r.text[:300]}"
            return r.status_code == 200
        except httpx.HTTPError as e:
            self.last = repr(e)
            return False


def pd_body(body: dict, prefill: Server, room: int, **extra) -> dict:
    return {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": room, **extra}


async def post_both(prefill: Server, decode: Server, body: dict, path: str = "/generate",
                    decode_extra: dict | None = None, timeout: float = 60.0):
    """The same body to both legs at once, as a PD router does -> (prefill resp, decode resp)."""
    async with httpx.AsyncClient(timeout=timeout) as c:
        return await asyncio.gather(c.post(prefill.url + path, json=body),
                                    c.post(decode.url + path, json={**body, **(decode_extra or {})}))


def run(coro):
    return asyncio.run(coro)
