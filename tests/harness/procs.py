"""/proc probes of the processes a test starts: children, liveness, fds, threads, RSS, and the
processes marked by an environment variable (nothing here starts or signals a process)."""

from __future__ import annotations

import os


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def marked_pids(var: str, token: str) -> list[int]:
    """Live processes whose environment carries var=token (a mark their launcher set, inherited by
    every descendant)."""
    needle = f"{var}={token}".encode()
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


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def thread_count(pid: int) -> int:
    return _status(pid, "Threads")


def rss_kb(pid: int) -> int:
    return _status(pid, "VmRSS")
