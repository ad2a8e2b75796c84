"""Child processes that die with their parent, however the parent dies (SIGKILL included).

`spawn_child(cmd, ...)` starts `cmd` through this file run as a tiny wrapper script
(`python -I child_process.py PARENT_PID -- cmd...`): the wrapper asks Linux for a parent-death
signal (prctl PR_SET_PDEATHSIG, SIGKILL), checks that its parent is still the one that spawned
it (the parent may have died before the prctl), then execs `cmd`; the signal survives the exec.
A wrapper instead of a `preexec_fn` because Python code between fork and exec is unsafe in a
process with threads (every front has some).

Caveat (Linux semantics): the signal fires when the *thread* that forked the child ends, not
the process. Spawn from the main thread or from a thread that lives as long as the child (an
event loop's thread), never from a pool thread that may end first: it would kill the child.

Graceful shutdown is unchanged: parents still stop their children with SIGTERM (or a shutdown
message) first; the parent-death signal only matters when the parent could not do that.
On systems without prctl (not Linux) the command runs unwrapped and the guarantee is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

PR_SET_PDEATHSIG = 1
WRAPPER_PATH = os.path.abspath(__file__)
SUPPORTED = sys.platform.startswith("linux")


def wrapped_command(cmd: list[str], parent_pid: int | None = None) -> list[str]:
    """`cmd` prefixed with the wrapper that arms the parent-death signal for `parent_pid`
    (default: this process)."""
    if not SUPPORTED:
        return list(cmd)
    pid = os.getpid() if parent_pid is None else parent_pid
    return [sys.executable, "-I", WRAPPER_PATH, str(pid), "--", *cmd]


def spawn_child(cmd: list[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
    """subprocess.Popen(cmd, **popen_kwargs), with the child (and what it execs) SIGKILLed by
    the kernel when the calling thread of this process ends. Same keyword arguments as Popen
    (`start_new_session=True` still works: the signal does not depend on the process group)."""
    if isinstance(cmd, (str, bytes)):
        raise TypeError("spawn_child takes the command as a list of arguments")
    return subprocess.Popen(wrapped_command(list(cmd)), **popen_kwargs)


def _arm_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")


def _wrapper_main(argv: list[str]) -> None:
    """PARENT_PID -- CMD...: arm the signal, make sure the parent is still there, exec CMD."""
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: child_process.py PARENT_PID -- CMD [ARG...]")
    parent = int(argv[0])
    cmd = argv[2:]
    _arm_parent_death_signal()
    if os.getppid() != parent:  # the parent died before the prctl: the signal will never come
        sys.exit(f"child_process: parent pid {parent} is gone; not starting {cmd[0]}")
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        sys.exit(f"child_process: cannot exec {cmd[0]}: {e}")


if __name__ == "__main__":
    _wrapper_main(sys.argv[1:])
