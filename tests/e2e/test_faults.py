"""Fault injection on real processes (tiny model, 127.0.0.1): kill -9 of a prefill worker, a whole
prefill server and a decode worker during prefill, transfer and decode, and a prefill restarted
on the same ports. (Router, client, bootstrap and transfer-peer faults: test_faults_network.py.)

For each: every client gets an answer (a result, a clear error, or for a killed server its dropped
connection) well within the configured deadlines (FAST_ENV), the survivors keep serving, and
they return to idle. Fault windows are widened with the `tests.harness.slow_worker` knobs and entered
by watching server_info, never by sleeping a guessed time.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.harness.cluster import FAST_ENV, pd_body  # noqa: E402
from tests.harness.fault_tools import (  # noqa: E402
    GREEDY,
    LEG_TIMEOUT,
    LONG,
    KnobServer,
    Legs,
    N,
    assert_failed,
    cold_then_fast,
    decoding,
    error_of,
    kv_req_sent,
    prefilling,
    room_on,
    running,
    shared_tiny_model,
    status,
    transferring,
    wait_for,
    widen,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

P_LAST = D_LAST = 3  # the rank of the dp-4 servers that no test kills
QUARANTINE_S = float(FAST_ENV["PDSERVE_KV_QUARANTINE_TIMEOUT"])  # a killed prefill's rooms keep their pages


# ---- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return str(tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return shared_tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def cluster(model, logs):
    """P (prefill dp 4) + D (decode dp 4) for the worker kills (each test kills its own rank;
    rank 3 of each is never killed), and three prefill dp 1 servers to kill whole."""
    with running(P=KnobServer("prefill", model, dp=4, log_dir=logs),
                 D=KnobServer("decode", model, dp=4, log_dir=logs),
                 **{f"S{k}": KnobServer("prefill", model, dp=1, log_dir=logs) for k in range(3)}) as servers:
        yield servers


@pytest.fixture
def knobs(cluster):
    """Every test starts with empty prefix caches and leaves the servers fast again."""
    with cold_then_fast(*vars(cluster).values()):
        yield


@pytest.fixture(scope="module")
def reference(cluster):
    """The healthy answer to LONG (greedy), through the ranks no test kills."""
    return serve_once(cluster.P, cluster.D, P_LAST, D_LAST)


# ---- helpers --------------------------------------------------------------------------------
def serve_once(P: KnobServer, D: KnobServer, p_rank: int, d_rank: int) -> list[int]:
    """Both legs of LONG on the given ranks; both must succeed. -> the output ids."""
    body = pd_body({"text": LONG, "sampling_params": GREEDY}, P, room_on(p_rank, P.dp))
    with httpx.Client(timeout=LEG_TIMEOUT) as c, ThreadPoolExecutor(2) as ex:
        fp = ex.submit(c.post, P.url + "/generate", json=body)
        fd = ex.submit(c.post, D.url + "/generate", json={**body, "routed_dp_rank": d_rank})
        rp, rd = fp.result(), fd.result()
    assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
    assert rd.json()["meta_info"]["completion_tokens"] == N
    return rd.json()["output_ids"]


def assert_serves(P: KnobServer, D: KnobServer, p_rank: int, d_rank: int, want: list[int]) -> None:
    assert serve_once(P, D, p_rank, d_rank) == want


def start_pair(legs: Legs, P: KnobServer, D: KnobServer, p_rank: int, d_rank: int, stream: bool = False):
    room = room_on(p_rank, P.dp)
    body = pd_body({"text": LONG, "sampling_params": GREEDY, "stream": stream}, P, room)
    fp, fd = legs.both(P, D, body, decode_extra={"routed_dp_rank": d_rank}, timeout=LEG_TIMEOUT)
    return room, fp, fd


# ---- kill -9 of one prefill DP worker -------------------------------------------------------
@pytest.mark.parametrize("phase,rank", [("prefill", 0), ("transfer", 1), ("decode", 2)])
def test_kill_prefill_worker(cluster, legs, knobs, reference, phase, rank):
    P, D = cluster.P, cluster.D
    widen(phase, P, D)
    room, fp, fd = start_pair(legs, P, D, rank, D_LAST)
    window = {"prefill": lambda: prefilling(P, rank), "transfer": lambda: transferring(P, rank),
              "decode": lambda: decoding(D, D_LAST)}[phase]
    wait_for(window, 20, f"prefill rank {rank} request in its {phase} phase")
    P.kill_worker(rank)
    rp, rd = fp.result(), fd.result()
    if phase == "decode":  # the KV had moved: the decode finishes the answer on its own
        assert status(rp) == 200, error_of(rp)
        assert status(rd) == 200 and rd.json()["output_ids"] == reference, error_of(rd)
    else:
        assert_failed(rp, f"dp worker rank {rank} is gone")
        # at once (the prefill's bootstrap /health names the dead rank, or its endpoint refuses
        # the kv_req), not at the waiting deadline
        assert_failed(rd, str(room), f"dp_rank {rank}")
        assert "TIMEOUT" not in error_of(rd)
    wait_for(lambda: P.info()["dead_workers"], 10, "the dead worker in server_info")
    assert rank in [w["dp_rank"] for w in P.info()["dead_workers"]]
    assert httpx.get(P.url + "/health", timeout=10).status_code == 503
    P.wait_idle()
    D.wait_idle()
    assert_serves(P, D, P_LAST, D_LAST, reference)
    # a new request for the dead rank is refused at once on both legs
    room, fp, fd = start_pair(legs, P, D, rank, D_LAST)
    assert status(fp.result()) == 503
    assert_failed(fd.result(), str(room))
    D.wait_idle()


# ---- kill -9 of one decode DP worker --------------------------------------------------------
@pytest.mark.parametrize("phase,rank", [("prefill", 0), ("transfer", 1), ("decode", 2)])
def test_kill_decode_worker(cluster, legs, knobs, reference, phase, rank):
    P, D = cluster.P, cluster.D
    widen(phase, P, D)
    room, fp, fd = start_pair(legs, P, D, P_LAST, rank)
    window = {"prefill": lambda: prefilling(P, P_LAST) and kv_req_sent(D, rank),
              "transfer": lambda: transferring(P, P_LAST), "decode": lambda: decoding(D, rank)}[phase]
    wait_for(window, 20, f"decode rank {rank} request in its {phase} phase")
    D.kill_worker(rank)
    rp, rd = fp.result(), fd.result()
    assert_failed(rd, f"dp worker rank {rank} is gone")
    if phase == "prefill":  # the prefill's write to the dead decode fails, naming the room
        assert_failed(rp, str(room), "KV transfer")
    elif phase == "transfer":  # the rest of the write may still fit in socket buffers
        assert status(rp) == 200 or "KV transfer" in error_of(rp), error_of(rp)
    else:
        assert status(rp) == 200, error_of(rp)
    P.wait_idle()
    D.wait_idle()
    assert_serves(P, D, P_LAST, D_LAST, reference)


# ---- kill -9 of a whole prefill server ------------------------------------------------------
@pytest.mark.parametrize("phase,spare", [("prefill", "S0"), ("transfer", "S1"), ("decode", "S2")])
def test_kill_prefill_server(cluster, legs, knobs, reference, phase, spare):
    S, D = getattr(cluster, spare), cluster.D
    widen(phase, S, D)
    room, fp, fd = start_pair(legs, S, D, 0, D_LAST)
    window = {"prefill": lambda: prefilling(S, 0), "transfer": lambda: transferring(S, 0),
              "decode": lambda: decoding(D, D_LAST)}[phase]
    wait_for(window, 20, f"prefill server request in its {phase} phase")
    S.kill()
    rp, rd = fp.result(), fd.result()
    if phase == "decode":
        assert status(rp) == 200, error_of(rp)
        assert status(rd) == 200 and rd.json()["output_ids"] == reference, error_of(rd)
    else:
        assert isinstance(rp, httpx.HTTPError), rp  # its client saw the connection drop
        assert_failed(rd, str(room), "missed", "heartbeats", "gone")
        # unheard is not proof of dead: the room's pages wait out the quarantine, then are freed
        held = D.worker(D_LAST)["extra"]
        if held["handoff_states"] != {"quarantined": 1}:
            # on a loaded machine this read can come after the whole (short, test) quarantine:
            # then the decode has logged that quarantine running out for this very room
            expired = [ln for ln in D.tail(2000).splitlines()
                       if f"room {room} (prefill" in ln and "of quarantine; its pages are released" in ln]
            assert held["quarantined_handoffs"] == 0 and expired, (held, D.tail(20))
        else:
            assert held["quarantined_handoffs"] == 1, held
        # the decode rank that watched S knows it is gone: a new request naming S fails at once,
        # saying so (it used to wait out the topology deadline, 5 s here, 30 s by default)
        t0 = time.monotonic()
        late = legs.post(D.url + "/generate", pd_body({"text": "hello", "sampling_params": GREEDY}, S,
                                                      room_on(0, 1) + 2, routed_dp_rank=D_LAST),
                         timeout=LEG_TIMEOUT).result()
        assert time.monotonic() - t0 < 2.0, time.monotonic() - t0
        assert_failed(late, "missed", "heartbeats", "prefill server is gone")
    D.wait_idle(timeout=QUARANTINE_S + 15)
    assert_serves(cluster.P, D, P_LAST, D_LAST, reference)


# ---- a prefill server restarted on the same ports -------------------------------------------
def test_prefill_restarted_on_same_port(cluster, model, logs, reference):
    """The decode must notice the new instance (topology, rank endpoints, transfer connections)
    and serve the very first request after the restart."""
    D = cluster.D
    old = KnobServer("prefill", model, dp=2, log_dir=logs).wait_ready()
    new = None
    try:
        for rank in (0, 1):
            assert_serves(old, D, rank, D_LAST, reference)
        old_instance = old.info()["bootstrap_instance_id"]
        old.kill()
        old.proc.wait(10)
        new = KnobServer("prefill", model, dp=2, log_dir=logs, port=old.port,
                         bootstrap_port=old.bootstrap_port).wait_ready()
        assert new.info()["bootstrap_instance_id"] != old_instance
        for rank in (0, 1, 0, 1):
            assert_serves(new, D, rank, D_LAST, reference)
        new.wait_idle()
        D.wait_idle()
    finally:
        old.stop()
        if new is not None:
            new.stop()
