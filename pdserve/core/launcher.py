"""Process groups: how `pdserve up`, the benches and the tests start and stop child processes.

`ProcessGroup(cmd, ...)` starts `cmd` as the leader of a new session, so of a process group of
its own that its children join (a server front's DP workers); `wait_healthy(ready, timeout_s)`
polls `ready()` until it holds, and when the leader exits first or the deadline passes it stops
the group and raises a LaunchError naming the group, with its log's tail. `stop()` sends SIGTERM
(to the group, or to the leader alone when the leader stops its own children), waits up to a
grace for the leader, then SIGKILLs the whole group (whatever is left of it) and reaps the
leader; it is safe to call twice and after the leader died by itself. `stop_all` stops several
at once so their shutdowns overlap. `free_port()` is the one way to pick a port for a child to
bind, and `http_ok(url)` the plain health probe.

`die_with_parent=True` also arms core/child_process.py's parent-death signal: the leader dies
with this process however this process dies. Mind the caveat there: create such a group from a
thread that lives as long as it (the main thread, an event loop's thread).
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .child_process import wrapped_command

STOP_GRACE_S = 15.0  # SIGTERM, then SIGKILL to the group
REAP_S = 10.0  # after SIGKILL the leader is gone at once, unless the kernel holds it (D state)
POLL_S = 0.1
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local probes only


class LaunchError(RuntimeError):
    """A group's leader exited before it was healthy (`returncode` is its exit code) or was not
    healthy by its deadline (`returncode` None); either way the group has been stopped."""

    def __init__(self, message: str, returncode: int | None = None):
        super().__init__(message)
        self.returncode = returncode


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on now (the kernel's pick). Another process may
    take it before the child binds it: a caller that must not fail relaunches on EADDRINUSE."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def http_ok(url: str, timeout_s: float = 2.0, headers: dict[str, str] | None = None) -> bool:
    """GET `url` answered 200 within timeout_s (no proxy: these are probes of local children)."""
    try:
        with _NO_PROXY.open(urllib.request.Request(url, headers=headers or {}), timeout=timeout_s) as r:
            status: int = r.status
            return status == 200
    except (OSError, http.client.HTTPException, ValueError):  # URLError and HTTPError are OSErrors
        return False


class ProcessGroup:
    """One command in its own process group, its output in `log_path` (or where `popen_kwargs`
    say). Contract: once built, the group is always ended by `stop()` (or `stop_all`), which
    leaves no process of the group alive and the leader reaped; every wait has a deadline."""

    def __init__(self, cmd: Sequence[str], *, name: str = "", log_path: str | None = None,
                 log_append: bool = False, term_group: bool = True, die_with_parent: bool = False,
                 **popen_kwargs: Any):
        """`term_group=False`: SIGTERM goes to the leader alone (a front or `pdserve up` that
        stops its own children gracefully); SIGKILL always goes to the whole group."""
        if isinstance(cmd, (str, bytes)):
            raise TypeError("ProcessGroup takes the command as a list of arguments")
        self.cmd = list(cmd)
        self.name = name or os.path.basename(self.cmd[0])
        self.log_path = log_path
        self.term_group = term_group
        popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
        argv = wrapped_command(self.cmd) if die_with_parent else self.cmd
        if log_path is None:
            self.proc = subprocess.Popen(argv, start_new_session=True, **popen_kwargs)
        else:
            popen_kwargs.setdefault("stderr", subprocess.STDOUT)
            with open(log_path, "a" if log_append else "w") as log:  # the child keeps its own copy
                self.proc = subprocess.Popen(argv, start_new_session=True, stdout=log, **popen_kwargs)

    def __repr__(self) -> str:
        return f"ProcessGroup({self.name!r}, pid={self.proc.pid}, returncode={self.proc.returncode})"

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        """The leader's pid, which is also the process group id."""
        return self.proc.pid

    def poll(self) -> int | None:
        """The leader's exit code, or None while it runs."""
        return self.proc.poll()

    def running(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int, *, group: bool = True) -> None:
        """Send `sig` to the whole group (or to the leader alone); a group already gone is fine."""
        try:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)  # a no-op once the leader was reaped
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, timeout_s: float) -> int | None:
        """The leader's exit code once it exits within timeout_s, else None."""
        try:
            return self.proc.wait(timeout=max(0.0, timeout_s))
        except subprocess.TimeoutExpired:
            return None

    def wait_healthy(self, ready: Callable[[], bool], timeout_s: float, *, what: str = "",
                     poll_s: float = POLL_S) -> ProcessGroup:
        """Poll `ready()` until it holds; LaunchError (the group stopped) if the leader exits
        first or timeout_s passes. `what` names the check in the error (e.g. the URL)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.check_running(" while starting")
            except LaunchError:
                self.stop()
                raise
            if ready():
                return self
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                check = f" ({what})" if what else ""
                raise LaunchError(f"{self.name} (pid {self.pid}) not healthy{check} within {timeout_s:g}s, "
                                  f"stopped{self._log_note()}")
            time.sleep(min(poll_s, left))

    def check_running(self, when: str = "") -> None:
        """LaunchError (naming the exit code, with the log's tail) if the leader has exited; for
        a wait on several groups at once (`ready` of wait_healthy checks the others)."""
        rc = self.proc.poll()
        if rc is not None:
            raise LaunchError(f"{self.name} (pid {self.pid}) exited with code {rc}{when}{self._log_note()}", rc)

    def wait_output(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """The first match of `pattern` in the log, once printed (as wait_healthy otherwise)."""
        found: list[re.Match[str]] = []

        def printed() -> bool:
            m = re.search(pattern, self.output())
            if m:
                found.append(m)
            return m is not None

        self.wait_healthy(printed, timeout_s, what=f"printing {pattern!r}", poll_s=0.05)
        return found[0]

    def output(self) -> str:
        """Everything logged so far ("" without a log file)."""
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def tail(self, lines: int = 40) -> str:
        return "".join(self.output().splitlines(keepends=True)[-lines:])

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM, up to grace_s for the leader to exit, SIGKILL to the whole group, reap the
        leader; returns its exit code."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM, group=self.term_group)
            self.wait(grace_s)
        return self.kill()

    def kill(self) -> int | None:
        """SIGKILL to the whole group at once (the leader's children too), then reap the leader."""
        self.signal(signal.SIGKILL)
        try:
            return self.proc.wait(timeout=REAP_S)
        except subprocess.TimeoutExpired:
            raise LaunchError(f"{self.name} (pid {self.pid}) not gone {REAP_S:g}s after SIGKILL") from None

    def _log_note(self) -> str:
        if self.log_path is None:
            return ""
        return f"; end of {self.log_path}:\n{self.tail(30)}"


def stop_all(groups: Iterable[ProcessGroup], grace_s: float = STOP_GRACE_S) -> None:
    """Stop several groups together: every one is sent SIGTERM first, so their shutdowns
    overlap, then each gets what is left of one shared grace, SIGKILL and reaping."""
    groups = list(groups)
    for g in groups:
        if g.running():
            g.signal(signal.SIGTERM, group=g.term_group)
    deadline = time.monotonic() + grace_s
    errors = []
    for g in groups:
        g.wait(deadline - time.monotonic())
        try:
            g.kill()
        except LaunchError as e:  # the others are still stopped
            errors.append(e)
    if errors:
        raise errors[0]
