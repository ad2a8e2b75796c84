"""--cpu-bind: how cores are divided among DP workers and servers, the OpenMP environment each
worker starts with, and (end to end) the affinity of a real worker process's threads."""

from __future__ import annotations

import os

import pytest

from pdserve.core.config import ServerConfig
from pdserve.core.cpu_binding import CpuBindError, parse_cpus, rank_cpus, split_among_servers, threads_for, up_layout
from pdserve.core.wait_policy import WaitChoice
from pdserve.server.worker_cmd import wait_choice, worker_env


def test_parse_cpus():
    assert parse_cpus("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpus("5") == [5]
    for bad in ("", "a", "3-1", "-2"):
        with pytest.raises(CpuBindError):
            parse_cpus(bad)


def test_auto_splits_the_cores_among_the_ranks():
    cpus = list(range(8))
    assert [rank_cpus("auto", r, 2, cpus) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [rank_cpus("auto", r, 3, cpus) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [rank_cpus("auto", r, 4, [0, 1]) for r in range(4)] == [[0], [1], [0], [1]]  # fewer cores
    assert rank_cpus("none", 0, 2, cpus) is None


def test_explicit_lists_per_rank_are_checked():
    cpus = list(range(4))
    assert [rank_cpus("0-1|2,3", r, 2, cpus) for r in range(2)] == [[0, 1], [2, 3]]
    with pytest.raises(CpuBindError, match="gives 1 rank"):
        rank_cpus("0-3", 0, 2, cpus)
    with pytest.raises(CpuBindError, match=r"may not use"):
        rank_cpus("0|9", 1, 2, cpus)


def test_a_bad_cpu_bind_is_a_start_up_error():
    with pytest.raises(CpuBindError):
        ServerConfig(dp_size=2, cpu_bind="0")
    ServerConfig(dp_size=2, cpu_bind="none")


def test_threads_follow_the_bound_cores_unless_given():
    assert threads_for(0, [0, 1, 2], 1) == 3
    assert threads_for(1, [0, 1, 2], 1) == 1
    assert threads_for(0, None, 1) >= 1


def test_worker_env_from_the_server_config():
    assert worker_env(WaitChoice("passive", {"OMP_WAIT_POLICY": "PASSIVE"}, "x"), {}) == {
        "OMP_WAIT_POLICY": "PASSIVE"}
    # the rank's own threads decide: one thread per rank needs no measurement
    one = wait_choice(ServerConfig(dp_size=2, cpu_bind="0|1"), {})
    assert one.policy == "passive" and "one thread" in one.reason
    assert wait_choice(ServerConfig(cpu_wait_policy="spin:500"), {}).env == {"GOMP_SPINCOUNT": "500"}
    assert wait_choice(ServerConfig(), {"OMP_WAIT_POLICY": "ACTIVE"}).env == {}  # the user's own wins


def test_servers_started_together_get_their_own_cores_where_there_are_enough():
    assert split_among_servers([2, 2], list(range(8))) == ["0,1|2,3", "4,5|6,7"]
    assert split_among_servers([1, 1], [0, 1]) == ["0", "1"]
    assert split_among_servers([2, 2], [0, 1]) == ["0|1", "0|1"]  # one core each, dealt round robin
    assert split_among_servers([1, 2], list(range(6))) == ["0,1", "2,3|4,5"]


def test_up_layout_gives_every_worker_a_core_or_shrinks_the_dp_sizes():
    assert up_layout(None, None, list(range(8))) == (2, 2, "0,1|2,3", "4,5|6,7")
    assert up_layout(None, None, [0, 1, 2, 3]) == (2, 2, "0|1", "2|3")
    assert up_layout(None, None, [0, 1]) == (1, 1, "0", "1")  # 4 workers would share cores
    assert up_layout(None, None, [4, 5, 6]) == (1, 1, "4", "5,6")
    assert up_layout(None, None, [3]) == (1, 1, "3", "3")
    assert up_layout(2, 2, [0, 1]) == (2, 2, "0|1", "0|1")  # asked for: dealt round robin
    assert up_layout(2, None, [0, 1]) == (2, 1, "0|1", "0")
    assert up_layout(1, 3, list(range(8))) == (1, 3, "0,1", "2,3|4,5|6,7")


@pytest.mark.e2e
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to tell bindings apart")
def test_a_real_workers_threads_run_on_its_cores(tmp_path):
    from tests.harness.cluster import Server
    from tests.harness.tiny_model import make_tiny_model

    cpus = sorted(os.sched_getaffinity(0))[:2]
    model = make_tiny_model(str(tmp_path / "tiny"))
    srv = Server("colocated", model, dp=2, log_dir=str(tmp_path),
                 extra=["--cpu-bind", f"{cpus[1]}|{cpus[0]}", "--num-threads", "0"])
    try:
        srv.wait_ready()
        front = srv.proc.pid
        workers = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == front]
        assert len(workers) == 2
        seen = sorted(sorted(_thread_cpus(w)) for w in workers)
        assert seen == [[cpus[0]], [cpus[1]]], seen  # every thread of each worker on its one core

    finally:
        srv.stop()


@pytest.mark.e2e
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_a_one_rank_worker_uses_every_core(tmp_path):
    """dp 1, auto: the worker may run on all cores and runs that many torch threads (a bound
    worker whose compute threads all sat on one core prefilled at half speed)."""
    from tests.harness.cluster import Server
    from tests.harness.tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "tiny"))
    srv = Server("colocated", model, log_dir=str(tmp_path), extra=["--num-threads", "0",
                                                                   "--cpu-wait-policy", "spin:1234"])
    try:
        srv.wait_ready()
        import httpx

        httpx.post(srv.url + "/generate", json={"input_ids": list(range(3, 200)),
                                                "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        (worker,) = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == srv.proc.pid]
        assert _thread_cpus(worker) == set(os.sched_getaffinity(0))
        env = open(f"/proc/{worker}/environ", "rb").read().split(b"\0")
        assert not [e for e in env if e.startswith(b"GOMP_CPU_AFFINITY=")]
        assert b"GOMP_SPINCOUNT=1234" in env or "GOMP_SPINCOUNT" in os.environ
        info = httpx.get(srv.url + "/server_info", timeout=30).json()["cpu"]
        assert info["wait_policy"]["env"] == {"GOMP_SPINCOUNT": "1234"}
        assert "forced" in info["wait_policy"]["reason"] and info["cores"] >= 2
    finally:
        srv.stop()

def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def _thread_cpus(pid: int) -> set[int]:
    """Union of the CPUs every thread of `pid` may run on."""
    out: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        out |= os.sched_getaffinity(int(tid))
    return out
