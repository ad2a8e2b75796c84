"""The cluster `pdserve bench chaos` breaks: two prefill and two decode servers, each behind a
TcpProxy (so links can be cut), and one router in front of the proxies. Every server keeps its
ports across restarts, so the router sees the same URL come back. Processes run in their own
process groups (core/launcher.py) and are stopped by group.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from ..core.launcher import ProcessGroup, free_port, http_ok
from .tcp_proxy import TcpProxy


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


def start_group(cmd: list[str], log_path: str, env: dict | None = None) -> ProcessGroup:
    """One command in its own process group, appending to its log (a restart keeps the log), and
    dying with the bench however the bench dies."""
    return ProcessGroup(cmd, name=os.path.basename(log_path).removesuffix(".log"), log_path=log_path,
                        log_append=True, die_with_parent=True, env={**os.environ, **(env or {})})


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
    group: ProcessGroup | None = None
    proxy: TcpProxy | None = None
    launches: int = 0

    def __post_init__(self):
        if self.role == "prefill":
            self.bootstrap_port = free_port()
        self.proxy = TcpProxy(("127.0.0.1", self.port))

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
        self.group = self.spawner.submit(start_group, cmd, log, self.env).result()

    def healthy(self) -> bool:
        return http_ok(self.direct_url + "/health")

    def wait_ready(self, timeout: float) -> None:
        self.group.wait_healthy(self.healthy, timeout, what=self.direct_url + "/health", poll_s=0.2)

    def worker_pids(self) -> list[int]:
        out = []
        for pid in _children(self.group.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"--dp-rank" in f.read().split(b"\0"):
                        out.append(pid)
            except OSError:
                continue
        return out

    def pids(self) -> list[int]:
        return [self.group.pid, *self.worker_pids()]

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
    router: ProcessGroup
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
            router = spawner.submit(start_group, cmd, os.path.join(log_dir, "router.log"), env).result()
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
        self.router.wait_healthy(lambda: http_ok(self.router_url + "/health"), timeout,
                                 what=self.router_url + "/health", poll_s=0.2)

    def close(self) -> None:
        self.router.stop()
        for s in self.servers:
            s.close()
        self.spawner.shutdown()
