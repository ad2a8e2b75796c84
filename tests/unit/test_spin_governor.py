"""The spin governor: stepped with a fake clock and fake core-use readings, plus one check of the
libgomp behaviour it relies on (a team of cores + 1 parks the spinning threads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.engine.spin_governor import (
    LEAVE_SOLO_OTHERS,
    MAX_RECHECK_S,
    RECHECK_S,
    SUSPECT,
    WINDOW_S,
    CoreUse,
    Sharing,
    SpinGovernor,
    SpinMode,
    governor_for,
    spins,
)


class Fake:
    """Clock, core-use readings and the calls the governor makes."""

    def __init__(self):
        self.t = 0.0
        self.busy = 0.0  # cores' busy seconds, cumulative
        self.ours = 0.0
        self.waited = 0.0
        self.runs = 0
        self.calls: list = []

    def advance(self, others_cores: float, ours_cores: float = 2.0, s: float = WINDOW_S, wait_ms: float = 0.01,
                runs_per_s: int = 2000):
        self.t += s
        self.ours += ours_cores * s
        self.busy += (ours_cores + others_cores) * s
        runs = int(runs_per_s * s)
        self.runs += runs
        self.waited += runs * wait_ms / 1e3

    def governor(self, threads=2, cpus=(0, 1)) -> SpinGovernor:
        return SpinGovernor(threads, list(cpus), lambda n: self.calls.append(("threads", n)),
                            lambda: self.calls.append(("region",)),
                            lambda c: CoreUse(self.busy, self.ours, self.waited, self.runs), lambda: self.t)


HOG = dict(others_cores=0.67, ours_cores=1.33, wait_ms=3.0)  # beside the team: a slice per preemption
HOG_SOLO = dict(others_cores=1.0, ours_cores=1.0, wait_ms=0.02)  # each on its own core


def test_idle_parks_the_team_and_work_brings_it_back():
    f = Fake()
    g = f.governor()
    assert g.mode is SpinMode.TEAM
    g.before_step()
    assert f.calls == []  # already a team: nothing to do per step
    g.idle()
    # a region of cores + 1 threads (so waits are throttled and the threads sleep), then one thread
    assert f.calls == [("threads", 3), ("region",), ("threads", 1)] and g.mode is SpinMode.SOLO
    g.idle()
    assert len(f.calls) == 3  # parked once
    g.before_step()
    assert f.calls[-1] == ("threads", 2) and g.mode is SpinMode.TEAM and g.switches == 2


def test_a_cpu_bound_neighbour_makes_it_solo_and_rechecks_back_off_while_it_stays():
    f = Fake()
    g = f.governor()
    f.advance(**HOG)
    g.before_step()
    assert g.mode is SpinMode.SOLO and g.sharing is Sharing.SHARED and g.wait_ms == pytest.approx(3.0)
    for recheck in (RECHECK_S, 2 * RECHECK_S, 4 * RECHECK_S, MAX_RECHECK_S, MAX_RECHECK_S):
        t_found = f.t
        while f.t + WINDOW_S < t_found + recheck:  # solo beside it, no team window
            f.advance(**HOG_SOLO)
            g.before_step()
            assert g.mode is SpinMode.SOLO
        f.advance(**HOG_SOLO)
        f.advance(**HOG_SOLO)
        g.before_step()
        assert g.mode is SpinMode.TEAM and g.rechecking  # one team window: still there?
        f.advance(**HOG)
        g.before_step()
        assert g.mode is SpinMode.SOLO  # yes


def test_solo_sees_it_leave_and_the_team_comes_back_at_once():
    f = Fake()
    g = f.governor()
    f.advance(**HOG)
    g.before_step()
    f.advance(**HOG_SOLO)
    g.before_step()
    assert g.mode is SpinMode.SOLO
    f.advance(others_cores=LEAVE_SOLO_OTHERS * 0.8, ours_cores=1.0)  # it left
    g.before_step()
    assert g.mode is SpinMode.TEAM and g.sharing is Sharing.ALONE and not g.rechecking
    f.advance(**HOG)  # a new one: found at once, and rechecked after RECHECK_S again
    g.before_step()
    assert g.mode is SpinMode.SOLO and g.recheck_s == RECHECK_S


def test_a_bursty_neighbour_leaves_the_team_spinning():
    f = Fake()
    g = f.governor()
    for _ in range(20):  # a load generator: half a core, but it sleeps often, so our waits are short
        f.advance(others_cores=0.6, ours_cores=1.4, wait_ms=0.15)
        g.before_step()
        assert g.mode is SpinMode.TEAM


def test_below_suspect_nothing_happens_and_idle_windows_are_not_read():
    f = Fake()
    g = f.governor()
    for _ in range(20):
        f.advance(others_cores=SUSPECT * 0.9, wait_ms=5.0)
        g.before_step()
        assert g.mode is SpinMode.TEAM
    g.idle()  # parked for most of the next window: its reading is not the team's
    f.advance(others_cores=1.0, ours_cores=0.0, s=WINDOW_S * 0.8, wait_ms=5.0)
    g.before_step()
    f.advance(others_cores=1.0, ours_cores=1.0, s=WINDOW_S * 0.3, wait_ms=5.0)
    g.before_step()
    assert g.sharing is Sharing.ALONE and g.mode is SpinMode.TEAM
    f.advance(**HOG)  # a whole team window beside it
    g.before_step()
    assert g.sharing is Sharing.SHARED


def test_no_reading_inside_a_window():
    f = Fake()
    reads = []
    g = SpinGovernor(2, [0, 1], lambda n: None, lambda: None,
                     lambda c: reads.append(1) or CoreUse(f.busy, f.ours, f.waited, f.runs), lambda: f.t)
    f.t += WINDOW_S / 3
    g.before_step()
    g.before_step()
    assert len(reads) == 1  # the one at construction
    f.t += WINDOW_S
    g.before_step()
    assert len(reads) == 2


@pytest.mark.parametrize("env,expected", [
    ({}, True),  # libgomp's default spins 300000 turns
    ({"OMP_WAIT_POLICY": "active"}, True),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, False),
    ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}, False),
    ({"GOMP_SPINCOUNT": "10000"}, True),
    ({"GOMP_SPINCOUNT": "0"}, False),
])
def test_which_settings_spin(env, expected):
    assert spins(env) is expected


def test_no_governor_where_it_cannot_help():
    cores = len(os.sched_getaffinity(0))
    assert governor_for(1, {"OMP_WAIT_POLICY": "ACTIVE"}) is None  # one thread never waits for another
    assert governor_for(max(2, cores), {"OMP_WAIT_POLICY": "PASSIVE"}) is None  # nothing spins
    if cores > 2:
        assert governor_for(2, {"OMP_WAIT_POLICY": "ACTIVE"}) is None  # 3 threads would not exceed the cores


PARKED = r"""
import json, os, sys, time
os.sched_setaffinity(0, [int(c) for c in sys.argv[1].split(",")])
import torch
from pdserve.engine.spin_governor import governor_for
torch.set_num_threads(2)
g = governor_for(2)
x = torch.randn(512, 512)
x @ x
def use(s=0.6):
    t0, c0 = time.monotonic(), os.times()
    time.sleep(s)
    c1 = os.times()
    return (c1.user + c1.system - c0.user - c0.system) / (time.monotonic() - t0)
g.idle()
parked = use()
g.before_step()
x @ x
print(json.dumps({"parked": parked, "mode": g.mode.value, "threads": torch.get_num_threads()}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_libgomp_parks_spinning_threads_in_a_team_of_cores_plus_one():
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))[:2]))
    env = {**os.environ, "OMP_WAIT_POLICY": "ACTIVE"}
    env.pop("GOMP_SPINCOUNT", None)
    done = subprocess.run([sys.executable, "-c", PARKED, cpus], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # spinning, the idle team would use about one core; parked, it sleeps
    assert got["parked"] < 0.3, got
    # back to work: the team again (or solo, where this machine's other load tests CPU-bound)
    assert (got["mode"], got["threads"]) in (("team", 2), ("solo", 1)), got
