"""Hosts for multi-host tests: Linux network namespaces on a bridge this module makes.

`Lan()` makes a bridge with 10.213.K.1/24 in the test's own namespace (so the test reaches every
host directly) and `lan.host(name)` a namespace joined to it by a veth pair, with 10.213.K.N/24
and fd13:213:K::N/64 on its end and nothing else but loopback. `partition(host)` / `heal(host)` take that host's veth
down and up; `cap(host, rate)` puts a `tc tbf` bandwidth cap on the traffic towards it.
`lan.close()` deletes every namespace (their veths go with them) and the bridge.
`NsProcess` runs a command inside a host and stops it by process group (core/launcher.py);
`python -m tests.harness.netns NS CMD...` (used by `ns_server`) execs CMD inside namespace NS.
Needs root and `ip`; `unavailable()` says why not, for a skip.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field

from pdserve.core.launcher import ProcessGroup

IP_TIMEOUT_S = 10.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=check)


def unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces, veth pairs, a bridge)"
    name = f"pdprobe{os.getpid() % 100000}"
    try:
        r = _ip("netns", "add", name, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        return f"no usable `ip` command: {e}"
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


@dataclass
class Host:
    """One namespace on the bridge: `ip` is its only address besides loopback."""

    name: str  # the test's name for it ("prefill", "decode", ...)
    ns: str
    ip: str
    ip6: str  # its IPv6 address on the same link
    veth: str  # the bridge-side end, in the test's namespace

    def run(self, *cmd: str, timeout: float = IP_TIMEOUT_S) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns, *cmd], capture_output=True, text=True,
                              timeout=timeout)


@dataclass
class Lan:
    """A bridge and the hosts on it; `close()` removes everything it made, whatever failed."""

    index: int = field(default_factory=lambda: 20 + os.getpid() % 200)
    hosts: list[Host] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tag = f"{os.getpid() % 100000:05d}"
        self.bridge = f"pdbr{self.tag}"
        self.prefix = f"10.213.{self.index}"
        self.prefix6 = f"fd13:213:{self.index}"
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
            _ip("addr", "add", f"{self.prefix6}::1/64", "dev", self.bridge, "nodad")
            _ip("link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise

    @property
    def gateway(self) -> str:
        """The test's own address on the bridge."""
        return f"{self.prefix}.1"

    def host(self, name: str) -> Host:
        n = len(self.hosts) + 2
        h = Host(name, f"pd{self.tag}-{name}", f"{self.prefix}.{n}", f"{self.prefix6}::{n}", f"pv{self.tag}h{n}")
        self.hosts.append(h)
        inner = f"pv{self.tag}n{n}"
        _ip("netns", "add", h.ns)
        _ip("link", "add", h.veth, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", h.ns)
        _ip("link", "set", h.veth, "master", self.bridge)
        _ip("link", "set", h.veth, "up")
        _ip("-n", h.ns, "link", "set", "lo", "up")
        _ip("-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", inner)
        _ip("-n", h.ns, "addr", "add", f"{h.ip6}/64", "dev", inner, "nodad")
        _ip("-n", h.ns, "link", "set", inner, "up")
        return h

    def partition(self, host: Host) -> None:
        """Cut `host` off the bridge: its packets are dropped both ways, its sockets stay open."""
        _ip("link", "set", host.veth, "down")

    def heal(self, host: Host) -> None:
        _ip("link", "set", host.veth, "up")

    def cap(self, host: Host, rate: str, burst: str = "64kb", latency: str = "200ms") -> None:
        """Cap what the bridge sends to `host` (e.g. "40mbit") with a token bucket."""
        subprocess.run(["tc", "qdisc", "replace", "dev", host.veth, "root", "tbf", "rate", rate, "burst", burst,
                        "latency", latency], check=True, capture_output=True, timeout=IP_TIMEOUT_S)

    def capped_bytes(self, host: Host) -> int:
        """Bytes the cap on `host` has let through so far (tc's counter)."""
        out = subprocess.run(["tc", "-s", "qdisc", "show", "dev", host.veth], capture_output=True, text=True,
                             check=True, timeout=IP_TIMEOUT_S).stdout
        m = re.search(r"qdisc tbf .*?Sent (\d+) bytes", out, flags=re.S)
        return int(m.group(1)) if m else 0

    def uncap(self, host: Host) -> None:
        subprocess.run(["tc", "qdisc", "del", "dev", host.veth, "root"], capture_output=True, timeout=IP_TIMEOUT_S)

    def close(self) -> None:
        for h in self.hosts:
            _ip("link", "del", h.veth, check=False)  # both ends; the namespace's cleanup is lazy
            _ip("netns", "del", h.ns, check=False)
        self.hosts.clear()
        _ip("link", "del", self.bridge, check=False)


class NsProcess:
    """A command run inside `host` in its own process group, logging to a file; `stop()` kills the group."""

    def __init__(self, host: Host, cmd: list[str], log_path: str, env: dict | None = None, cwd: str | None = None):
        self.host, self.log_path = host, log_path
        self.group = ProcessGroup(["ip", "netns", "exec", host.ns, *cmd], name=f"{cmd[0]} in {host.name}",
                                  log_path=log_path, cwd=cwd, env={**os.environ, **(env or {})})

    @property
    def proc(self):
        return self.group.proc

    def tail(self, n: int = 3000) -> str:
        return self.group.output()[-n:]

    def stop(self) -> None:
        self.group.stop(grace_s=10.0)


def ns_server(base: type, host: Host, role: str, model_dir: str, v6: bool = False, **kw):
    """A `base` (cluster.Server or a subclass) started inside `host`, bound to its address (its
    IPv6 one with v6; extra flags given later win, e.g. a second --host)."""
    addr = f"[{host.ip6}]" if v6 else host.ip

    class InNamespace(base):
        def _entry(self) -> list[str]:
            return ["-m", "tests.harness.netns", host.ns, sys.executable, *super()._entry()]

        @property
        def url(self) -> str:
            return f"http://{addr}:{self.port}"

        @property
        def bootstrap_addr(self) -> str:
            return f"{addr}:{self.bootstrap_port}"

    kw["extra"] = ["--host", host.ip6 if v6 else host.ip, *kw.get("extra", [])]
    server = InNamespace(role, model_dir, **kw)
    server.host = host
    return server


def wait_for(pred, timeout: float, what: str, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(step)
    raise AssertionError(f"{what}: not within {timeout}s")


if __name__ == "__main__":  # python -m tests.harness.netns NS CMD...: exec CMD inside namespace NS
    os.execvp("ip", ["ip", "netns", "exec", sys.argv[1], *sys.argv[2:]])
