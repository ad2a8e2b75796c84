"""Spinning OpenMP waits only while they pay: the cores are ours and there is work.

A libgomp thread that spins between parallel regions makes single-stream decode up to 2.6x
faster than one that sleeps (a 2-core Zen 5 VM, where a sleeping vCPU is slow to wake), makes
everything 2-12x slower when another process wants one of the cores, and burns a core while
the server is idle. libgomp cuts a waiting thread's spin to a few hundred turns whenever its
team has more threads than the process has CPUs (it checks at every wait), and a team that
shrinks leaves its other threads waiting where they were. So the governor switches, at step
boundaries, between TEAM (all threads, the worker's spinning waits) and SOLO: one region with
cores + 1 threads puts the team's threads to sleep, then one thread does the work (the same
VM, beside one busy process: 67 tok/s single-stream and a 1024-token prefill in 829 ms, against
25 tok/s and 1292 ms for the spinning team). SOLO while idle and while a CPU-bound process
shares our cores (our threads then wait a whole time slice each time they are preempted);
TEAM otherwise.
"""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass
from typing import Callable

from ..core.wait_policy import governed

WINDOW_S = 0.5  # how often the cores' use is read (at a step boundary)
# A CPU-bound neighbour is told from a load generator or our own front, which also take a share
# of the cores but in short bursts (and beside which the spinning team is faster: solo lost 39%
# at 32 concurrent requests beside a benchmark client), by how long our threads wait for a core
# each time they are put back to run: a whole time slice beside a process that never sleeps.
SUSPECT = 0.25  # other processes' cores of time on our cores, with the team spinning ...
LONG_WAIT_MS = 1.5  # ... and our threads' mean wait per run: a CPU-bound neighbour (measured on a
# Zen 5 VM, decoding: 3.8 ms beside a busy loop, 0.8 beside a process with 0.8 ms bursts, 0.2 alone)
LEAVE_SOLO_OTHERS = 0.5  # other processes' cores of time, with us solo, under which it left
RECHECK_S = 5.0  # solo beside it, a team window after this long (it may have left while ...
MAX_RECHECK_S = 40.0  # ... using less than LEAVE_SOLO_OTHERS), doubling while it is found again


class SpinMode(str, enum.Enum):
    TEAM = "team"  # `threads` threads whose waits spin (the worker's wait policy)
    SOLO = "solo"  # one thread; the team's others asleep (parked by a region of cores + 1)


class Sharing(str, enum.Enum):
    """What the governor believes about the cores; working mode: TEAM when ALONE, else SOLO."""
    ALONE = "alone"  # no CPU-bound neighbour seen
    SHARED = "shared"  # one seen: solo until it leaves, or until a recheck


# the moves _observe makes (it checks each against this table)
MOVES = {
    Sharing.ALONE: {Sharing.SHARED},
    Sharing.SHARED: {Sharing.ALONE},
}


def spins(env: dict[str, str] | os._Environ) -> bool:
    """True where the worker's libgomp waits spin: OMP_WAIT_POLICY=ACTIVE, or not PASSIVE with
    a GOMP_SPINCOUNT other than 0 (libgomp's own default spins 300000 turns)."""
    policy = env.get("OMP_WAIT_POLICY", "").strip().upper()
    if policy == "PASSIVE":
        return False
    return policy == "ACTIVE" or env.get("GOMP_SPINCOUNT", "").strip() != "0"


@dataclass
class CoreUse:
    """Cumulative: CPU seconds on our cores by anyone (steal excluded) and by this process; our
    threads' seconds waiting for a core, and how many times they were put on one."""
    cores_busy: float
    ours: float
    waited: float = 0.0
    runs: int = 0


def read_core_use(cpus: list[int]) -> CoreUse:
    """From /proc/stat (the cores' busy time) and os.times (this process's threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    busy = 0
    want = {f"cpu{c}" for c in cpus}
    with open("/proc/stat") as f:
        for line in f:
            parts = line.split()
            if parts and parts[0] in want:
                user, nice, system, _idle, _iowait, irq, softirq = map(int, parts[1:8])
                busy += user + nice + system + irq + softirq
    waited = runs = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                _, w, n = map(int, f.read().split()[:3])
        except (OSError, ValueError):
            continue  # a thread that just ended, or no schedstats in this kernel
        waited, runs = waited + w, runs + n
    t = os.times()
    return CoreUse(busy / tick, t.user + t.system, waited / 1e9, runs)


class SpinGovernor:
    """Call `before_step()` before each engine step and `idle()` when the loop has no work; both
    are cheap (a clock read; /proc every WINDOW_S; a switch costs one small parallel region).
    `set_threads` is torch.set_num_threads and `wake_team` runs one parallel region (a team's
    size takes effect at its next region)."""

    def __init__(self, threads: int, cpus: list[int], set_threads: Callable[[int], None],
                 wake_team: Callable[[], None], read_use: Callable[[list[int]], CoreUse] = read_core_use,
                 clock: Callable[[], float] = time.monotonic):
        self.threads, self.cpus = threads, cpus
        self.set_threads, self.wake_team, self.read_use, self.clock = set_threads, wake_team, read_use, clock
        self.mode = SpinMode.TEAM
        self.sharing = Sharing.ALONE
        self.recheck_s = RECHECK_S
        self.recheck_at = 0.0
        self.rechecking = False  # back in the team only to see whether the neighbour is still there
        self.wait_ms = 0.0  # our threads' mean wait per run in the last window
        self.switches = 0
        self.others = 0.0  # cores' worth of other processes' time in the last window
        self._last_t, self._last = clock(), read_use(cpus)
        self._team_s, self._mode_t = 0.0, self._last_t  # time in TEAM this window; last switch

    def before_step(self) -> None:
        now = self.clock()
        if now - self._last_t >= WINDOW_S:
            self._observe(now)
        self._set(SpinMode.TEAM if self.sharing is Sharing.ALONE else SpinMode.SOLO)

    def idle(self) -> None:
        self._set(SpinMode.SOLO)

    def _observe(self, now: float) -> None:
        use = self.read_use(self.cpus)
        wall = now - self._last_t
        last = self._last
        self.others = max(0.0, (use.cores_busy - last.cores_busy) - (use.ours - last.ours)) / wall
        runs = use.runs - last.runs
        self.wait_ms = max(0.0, use.waited - last.waited) / runs * 1e3 if runs > 0 else 0.0
        team_share = self._team_time(now) / wall
        self._last_t, self._last, self._team_s, self._mode_t = now, use, 0.0, now
        if self.sharing is Sharing.ALONE:
            # a window mostly parked for idleness says nothing of a neighbour beside the team
            if team_share < 0.5:
                return
            if self.others >= SUSPECT and self.wait_ms >= LONG_WAIT_MS:
                # found again by a recheck: it never left, so recheck less often
                self.recheck_s = min(MAX_RECHECK_S, self.recheck_s * 2) if self.rechecking else RECHECK_S
                self.recheck_at = now + self.recheck_s
                self._move(Sharing.SHARED)
            self.rechecking = False
        elif self.others < LEAVE_SOLO_OTHERS or now >= self.recheck_at:
            self.rechecking = self.others >= LEAVE_SOLO_OTHERS
            self._move(Sharing.ALONE)

    def _move(self, to: Sharing) -> None:
        if to not in MOVES[self.sharing]:
            raise AssertionError(f"spin governor: {self.sharing.value} -> {to.value}")
        self.sharing = to

    def _team_time(self, now: float) -> float:
        return self._team_s + (now - self._mode_t if self.mode is SpinMode.TEAM else 0.0)

    def _set(self, mode: SpinMode) -> None:
        if mode is self.mode:
            return
        now = self.clock()
        self._team_s, self._mode_t = self._team_time(now), now
        self.mode = mode
        self.switches += 1
        if mode is SpinMode.TEAM:
            self.set_threads(self.threads)
            return
        self.set_threads(len(self.cpus) + 1)
        self.wake_team()  # its threads now wait throttled, so they sleep, and stay asleep while
        self.set_threads(1)  # one thread works (a team of one starts no other thread)

    def summary(self) -> dict:
        return {"mode": self.mode.value, "sharing": self.sharing.value, "others_cores": round(self.others, 3),
                "wait_per_run_ms": round(self.wait_ms, 3),
                "switches": self.switches}


def governor_for(threads: int, env=os.environ) -> SpinGovernor | None:
    """A governor for a worker with `threads` torch threads on its CPUs, where it helps: waits
    that spin, more than one thread, and a team as large as the cores (else cores + 1 would not
    exceed them). None otherwise."""
    cpus = sorted(os.sched_getaffinity(0))
    if not governed(threads, cpus) or not spins(env):
        return None
    import torch

    def wake_team() -> None:
        torch.ones(1 << 17).add_(1)  # above torch's grain size: runs as one parallel region

    return SpinGovernor(threads, cpus, torch.set_num_threads, wake_team)
