"""The cluster `pdserve bench chaos` breaks: two prefill and two decode servers, each behind a
TcpProxy (so links can be cut), and one router in front of the proxies. Every server keeps its
ports across restarts, so the router sees the same URL come back. Processes run in their own
process groups and are stopped by group.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from ..core.child_process import spawn_child
from .tcp_proxy import TcpProxy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def proc_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def proc_rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Group:
    """One command in its own process group, with its log file."""

    def __init__(self, cmd: list[str], log_path: str, env: dict | None = None):
        self.log = open(log_path, "a")
        self.proc = spawn_child(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})  # dies with the bench, however it dies

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)  # whatever is left of the group (workers)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()


@dataclass
class ChaosServer:
    """A `pdserve serve` on fixed ports (HTTP, and bootstrap for a prefill) behind a TcpProxy."""

    role: str
    name: str
    args: list[str]
    log_dir: str
    env: dict = field(default_factory=dict)
    # starts every launch: a parent-death signal fires when the *thread* that spawned exits, so
    # restarts from the fault thread are spawned from this long-lived one
    spawner: ThreadPoolExecutor | None = None
    port: int = field(default_factory=free_port)
    bootstrap_port: int | None = None
    group: Group | None = None
    proxy: TcpProxy | None = None
    launches: int = 0

    def __post_init__(self):
        if self.role == "prefill":
            self.bootstrap_port = free_port()
        self.proxy = TcpProxy(self.port)

    @property
    def direct_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:  # what the router is given: through the proxy
        return f"http://127.0.0.1:{self.proxy.port}"

    def start(self) -> None:
        self.launches += 1
        cmd = [sys.executable, "-m", "pdserve", "serve", "--role", self.role, "--host", "127.0.0.1",
               "--port", str(self.port), "--log-level", "warning", *self.args]
        if self.bootstrap_port:
            cmd += ["--bootstrap-port", str(self.bootstrap_port)]
        log = os.path.join(self.log_dir, f"{self.name}.log")
        self.group = self.spawner.submit(Group, cmd, log, self.env).result()

    def healthy(self) -> bool:
        try:
            return httpx.get(self.direct_url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.group.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.group.proc.returncode}; log in {self.log_dir}")
            if self.healthy():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready in {timeout:.0f}s; log in {self.log_dir}")

    def worker_pids(self) -> list[int]:
        out = []
        for pid in _children(self.group.proc.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"--dp-rank" in f.read().split(b"\0"):
                        out.append(pid)
            except OSError:
                continue
        return out

    def pids(self) -> list[int]:
        return [self.group.proc.pid, *self.worker_pids()]

    def held_pages(self) -> int:
        """Pages neither free nor cached over every worker (0 when idle), or -1 if unreachable."""
        try:
            workers = httpx.get(self.direct_url + "/server_info", timeout=5).json()["workers"]
        except (httpx.HTTPError, KeyError, ValueError):
            return -1
        return sum(w["total_pages"] - w["free_pages"] - w["cached_pages"] for w in workers)

    def stop(self) -> None:
        if self.group:
            self.group.stop()
            self.group = None

    def close(self) -> None:
        self.stop()
        self.proxy.close()


@dataclass
class ChaosCluster:
    servers: list[ChaosServer]
    router: Group
    router_url: str
    spawner: ThreadPoolExecutor

    @classmethod
    def start(cls, server_args: list[str], router_flags: list[str], log_dir: str, env: dict,
              timeout: float = 300.0) -> "ChaosCluster":
        spawner = ThreadPoolExecutor(1, thread_name_prefix="chaos-spawner")
        servers = [ChaosServer(role, f"{role}{i}", server_args, log_dir, env, spawner)
                   for role in ("prefill", "decode") for i in (1, 2)]
        router = None
        try:
            for s in servers:
                s.start()
            for s in servers:
                s.wait_ready(timeout)
            port = free_port()
            cmd = [sys.executable, "-m", "pdserve", "router", "--pd-disaggregation", "--host", "127.0.0.1",
                   "--port", str(port), "--log-level", "warning", *router_flags]
            for s in servers:
                cmd += ["--prefill", s.url, str(s.bootstrap_port)] if s.role == "prefill" else ["--decode", s.url]
            router = spawner.submit(Group, cmd, os.path.join(log_dir, "router.log"), env).result()
            c = cls(servers, router, f"http://127.0.0.1:{port}", spawner)
            c.wait_router(timeout)
            return c
        except BaseException:
            if router:
                router.stop()
            for s in servers:
                s.close()
            spawner.shutdown()
            raise

    def wait_router(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.router.proc.poll() is not None:
                raise RuntimeError(f"the router exited with {self.router.proc.returncode}")
            try:
                if httpx.get(self.router_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the router is not healthy in {timeout:.0f}s")

    def close(self) -> None:
        self.router.stop()
        for s in self.servers:
            s.close()
        self.spawner.shutdown()
