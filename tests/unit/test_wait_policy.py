"""How workers' OpenMP threads wait (core/wait_policy.py): the choice follows the probes'
timings, a flag or the user's environment wins, one thread needs no probe, the result is cached
per CPU and threads; and the probe itself runs and reports both timings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.core.config import ServerConfig
from pdserve.core.host import HostInfo
from pdserve.core.wait_policy import CANDIDATES, env_for, pick, resolve

HOST = HostInfo("Test CPU", frozenset({"avx2"}), 2)


def _probe(table: dict[str, tuple[float, float]], calls: list):
    def probe(env, threads, cpus):
        name = next(k for k, v in CANDIDATES.items() if v == env)
        calls.append((name, threads, tuple(cpus)))
        q, b = table[name]
        return {"quiet_ms": q, "busy_ms": b}
    return probe


# quiet / busy ms: spinning is fastest quiet and slowest busy; passive the reverse
TABLE = {"passive": (14.0, 20.0), "spin:10000": (10.5, 21.0), "spin:100000": (10.0, 40.0), "active": (10.0, 90.0)}


def test_the_fastest_alone_wins_among_those_that_hold_up_beside_a_busy_neighbour():
    measured = {k: {"quiet_ms": q, "busy_ms": b} for k, (q, b) in TABLE.items()}
    policy, why = pick(measured)
    # spin:100000 and active are faster alone but 2x and 4.5x slower beside the neighbour
    assert policy == "spin:10000" and why.startswith("spin:10000")
    assert "--cpu-wait-policy spin:100000" in why or "--cpu-wait-policy active" in why
    measured["spin:10000"]["busy_ms"] = 22.5  # 1.125x the best busy: out
    assert pick(measured)[0] == "passive"
    measured["active"]["busy_ms"] = 19.0  # spinning that holds up under load is kept
    assert pick(measured)[0] == "active"


def test_the_rule_on_figures_measured_on_a_zen5_vm():
    # `pdserve bench calibrate`, 2 threads, Dec 2: the product of the two ratios chose active,
    # whose serving prefill beside a busy process then took 5.7x vLLM-CPU's time
    measured = {"active": {"quiet_ms": 20.2, "busy_ms": 62.3}, "passive": {"quiet_ms": 45.6, "busy_ms": 54.7},
                "spin:10000": {"quiet_ms": 19.5, "busy_ms": 155.0}, "spin:100000": {"quiet_ms": 21.0, "busy_ms": 309.0}}
    policy, why = pick(measured)
    assert policy == "passive" and "spin:10000 would be 2.34x faster alone" in why
    # with the governor parking the team when busy: active, unless passive is clearly faster alone
    assert pick(measured, governed=True)[0] == "active"
    measured["passive"]["quiet_ms"] = 15.0
    assert pick(measured, governed=True)[0] == "passive"


def test_resolve_probes_once_per_cpu_and_threads(tmp_path):
    calls: list = []
    probe = _probe(TABLE, calls)
    # two threads on two cores: the spin governor guards the busy case, the fastest alone wins
    # two threads on two cores: the spin governor guards the busy case; passive against active
    c = resolve("auto", 2, [0, 1], tmp_path, {}, probe, HOST)
    assert c.policy == "active" and "governor" in c.reason
    assert sorted(n for n, _, _ in calls) == ["active", "passive"] and all(t == 2 for _, t, _ in calls)
    again = resolve("auto", 2, [0, 1], tmp_path, {}, probe, HOST)
    assert again == c and len(calls) == 2  # cached
    resolve("auto", 2, [0, 1], tmp_path, {}, probe, HostInfo("Other CPU", HOST.isa_flags, 2))
    assert len(calls) == 4  # another CPU measures again
    resolve("auto", 3, [0, 1, 2], tmp_path, {}, probe, HOST)
    assert len(calls) == 6  # and another thread count
    # two threads on four cores: no governor (a team of 3 would not exceed the cores)
    c = resolve("auto", 2, [0, 1, 2, 3], tmp_path, {}, probe, HOST)
    assert c.policy == "spin:10000" and c.env == {"GOMP_SPINCOUNT": "10000"}
    assert set(c.measured) == set(CANDIDATES) and len(calls) == 6 + len(CANDIDATES)


def test_no_probe_where_the_answer_is_given(tmp_path):
    calls: list = []
    probe = _probe(TABLE, calls)
    assert resolve("active", 2, None, tmp_path, {}, probe, HOST).env == {"OMP_WAIT_POLICY": "ACTIVE"}
    assert resolve("spin:5", 2, None, tmp_path, {}, probe, HOST).env == {"GOMP_SPINCOUNT": "5"}
    user = resolve("auto", 2, None, tmp_path, {"GOMP_SPINCOUNT": "7"}, probe, HOST)
    assert user.policy == "user" and user.env == {} and "GOMP_SPINCOUNT=7" in user.reason
    one = resolve("auto", 1, None, tmp_path, {}, probe, HOST)
    assert one.policy == "passive" and "one thread" in one.reason
    assert calls == []


def test_failed_probes_fall_back_to_passive(tmp_path):
    def probe(env, threads, cpus):
        raise RuntimeError("no torch")
    c = resolve("auto", 2, [0, 1], tmp_path, {}, probe, HOST)
    assert c.policy == "passive" and "probes failed" in c.reason
    assert not list(tmp_path.glob("wait-*.json"))  # a failure is not cached


def test_bad_flag_values_are_start_up_errors():
    for bad in ("spin", "spin:x", "busy"):
        with pytest.raises(ValueError, match="--cpu-wait-policy"):
            ServerConfig(cpu_wait_policy=bad)
    assert env_for("passive") == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_the_probe_reports_quiet_and_busy_timings():
    done = subprocess.run([sys.executable, "-m", "pdserve.engine.wait_probe", "--threads", "1",
                           "--seconds", "0.05"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["quiet_ms"] > 0 and got["busy_ms"] > 0
