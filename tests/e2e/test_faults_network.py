"""Fault injection around the servers (tiny model, 127.0.0.1): kill -9 of the router during
prefill, transfer and decode; clients that give up at random points; a bootstrap service that
is slow or answers 5xx; a transfer peer that accepts the connection and then stalls.

For each: every client gets an answer (a result, a clear error, or for a killed router its
dropped connection) within the configured deadlines (FAST_ENV), and the servers return to idle
and keep serving. Fault windows are entered by watching server_info (see test_faults.py).
"""

from __future__ import annotations

import random
import types
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.harness.cluster import pd_body  # noqa: E402
from tests.harness.fault_stubs import BootstrapStub, StallingPeer  # noqa: E402
from tests.harness.fault_tools import (  # noqa: E402
    GREEDY,
    LEG_TIMEOUT,
    LONG,
    KnobServer,
    N,
    Router,
    assert_failed,
    cold_then_fast,
    decoding,
    error_of,
    prefilling,
    room_on,
    running,
    shared_tiny_model,
    transferring,
    wait_for,
    widen,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return str(tmp_path_factory.mktemp("faults_network"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, logs):
    """A healthy prefill dp 2 + decode dp 2; every test leaves them as it found them."""
    model = shared_tiny_model(tmp_path_factory)
    with running(Pr=KnobServer("prefill", model, dp=2, log_dir=logs),
                 Dr=KnobServer("decode", model, dp=2, log_dir=logs)) as servers:
        yield servers


@pytest.fixture
def knobs(cluster):
    """Every test starts with empty prefix caches and leaves the servers fast again."""
    with cold_then_fast(cluster.Pr, cluster.Dr):
        yield


# ---- kill -9 of the router ------------------------------------------------------------------
@pytest.mark.parametrize("phase", ["prefill", "transfer", "decode"])
def test_kill_router(cluster, legs, knobs, logs, phase):
    Pr, Dr = cluster.Pr, cluster.Dr
    router = Router([Pr], [Dr], log_dir=logs).wait_healthy()
    again = None
    try:
        widen(phase, Pr, Dr)
        fut = legs.post(router.url + "/generate",
                        {"text": LONG, "sampling_params": GREEDY, "stream": phase == "decode"}, LEG_TIMEOUT)
        either = lambda f: f(Pr, 0) or f(Pr, 1)  # noqa: E731
        window = {"prefill": lambda: either(prefilling), "transfer": lambda: either(transferring),
                  "decode": lambda: decoding(Dr, 0) or decoding(Dr, 1)}[phase]
        wait_for(window, 20, f"routed request in its {phase} phase")
        router.kill()
        resp = fut.result()
        assert isinstance(resp, httpx.HTTPError), resp  # the client's connection dropped
        # both legs' connections closed with the router: both servers abort and free everything
        Pr.wait_idle(timeout=20)
        Dr.wait_idle(timeout=20)
        Pr.slow()
        Dr.slow()
        router.stop()
        again = router.restart().wait_healthy()
        r = httpx.post(again.url + "/generate", json={"text": LONG, "sampling_params": GREEDY}, timeout=LEG_TIMEOUT)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == N, r.text
    finally:
        router.stop()
        if again is not None:
            again.stop()


# ---- client disconnects at random points ----------------------------------------------------
def test_client_disconnects_at_random_points(cluster, knobs, logs):
    """Clients give up at random moments of prefill, transfer and decode, through the router and
    straight to each leg; nothing is left behind and the next request is served."""
    Pr, Dr = cluster.Pr, cluster.Dr
    Pr.slow(step_s=0.05, transfer_s=0.3)
    Dr.slow(step_s=0.03)
    router = Router([Pr], [Dr], log_dir=logs).wait_healthy()
    rng = random.Random(7)
    try:
        def one(k: int):
            stream = k % 2 == 0
            body = {"text": LONG if k % 3 else "short prompt", "sampling_params": GREEDY, "stream": stream}
            target = router.url
            if k % 5 == 4:  # a lone leg straight to one server; its other leg never comes
                room = room_on(k % 2, 2)
                body = pd_body(body, Pr, room)
                target = (Pr if k % 2 else Dr).url
            give_up = rng.uniform(0.05, 1.5)
            try:
                with httpx.Client(timeout=httpx.Timeout(give_up)) as c:
                    if stream:
                        with c.stream("POST", target + "/generate", json=body) as r:
                            for _ in r.iter_raw():
                                pass
                    else:
                        c.post(target + "/generate", json=body)
            except httpx.HTTPError:
                return "gave up"
            return "answered"

        with ThreadPoolExecutor(6) as ex:
            outcomes = list(ex.map(one, range(24)))
        assert "gave up" in outcomes
        Pr.wait_idle(timeout=30)
        Dr.wait_idle(timeout=30)
        Pr.slow()
        Dr.slow()
        r = httpx.post(router.url + "/generate", json={"text": LONG, "sampling_params": GREEDY}, timeout=LEG_TIMEOUT)
        assert r.status_code == 200, r.text
    finally:
        router.stop()


# ---- a bootstrap service that answers slowly or with 5xx ------------------------------------
@pytest.fixture
def stub_router(cluster, logs):
    """A router whose prefill's bootstrap address is a stub in front of the real service (a new
    address per test: nothing about it is cached on the decode yet)."""
    Pr, Dr = cluster.Pr, cluster.Dr
    stub = BootstrapStub(f"127.0.0.1:{Pr.bootstrap_port}")
    router = Router([types.SimpleNamespace(url=Pr.url, bootstrap_port=stub.port)], [Dr], log_dir=logs)
    try:
        yield stub, router.wait_healthy()
    finally:
        router.stop()
        stub.stop()


@pytest.mark.parametrize("mode,status,delay,causes", [
    ("error", 500, 0.0, ["answered 500: stub failure"]),  # not retried: fails at once
    # retried until the topology deadline (5 s), unless the heartbeat (0.5 s x 2) calls it gone first
    ("error", 503, 0.0, ["answered 503", "missed 2 heartbeats"]),
    ("slow", 200, 6.0, ["Timeout", "missed 2 heartbeats"]),  # slower than every deadline (5 s)
    ("slow", 200, 0.2, None),  # slow but within every deadline: served
])
def test_bootstrap_slow_or_failing(cluster, stub_router, mode, status, delay, causes):
    stub, router = stub_router
    stub.mode, stub.status, stub.delay = mode, status, delay
    r = httpx.post(router.url + "/generate", json={"text": LONG, "sampling_params": GREEDY}, timeout=LEG_TIMEOUT)
    if causes is None:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code >= 500, r.text
        msg = error_of(r)
        assert any(c in msg for c in causes), msg
        assert f"127.0.0.1:{stub.port}" in msg  # names the bootstrap address it could not use
    stub.mode = "pass"
    cluster.Pr.wait_idle(timeout=20)
    cluster.Dr.wait_idle(timeout=20)
    r = httpx.post(router.url + "/generate", json={"text": LONG, "sampling_params": GREEDY}, timeout=LEG_TIMEOUT)
    assert r.status_code == 200, r.text


# ---- a transfer peer that accepts the connection and then stalls ----------------------------
def test_prefill_transfer_endpoint_stalls(cluster):
    """The decode's kv_req goes to a prefill 'rank' that accepts and never answers the
    handshake: the room fails by the tcp connect deadline, naming room and peer."""
    from pdserve.disagg.bootstrap_server import ThreadedBootstrap
    from pdserve.disagg.bootstrap_table import BootstrapTable, RankInfo

    Dr = cluster.Dr
    real = httpx.get(f"http://{cluster.Pr.bootstrap_addr}/route?prefill_dp_rank=0", timeout=10).json()
    peer = StallingPeer()
    table = BootstrapTable(dp_size=1)
    endpoint = {"backend": "tcp", "version": 1, "ip": "127.0.0.1", "port": peer.port, "instance": "stalled"}
    table.register_rank(RankInfo(dp_rank=0, dp_size=1, rank_ip="127.0.0.1", rank_port=peer.port,
                                 page_size=real["page_size"], kv_cache_dtype=real["kv_cache_dtype"],
                                 load_balance_method="follow_bootstrap_room", fingerprint=real["fingerprint"],
                                 endpoint=endpoint))
    fake = ThreadedBootstrap(table)
    try:
        room = random.getrandbits(63)
        body = {"text": LONG, "sampling_params": GREEDY, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": fake.port, "bootstrap_room": room}
        r = httpx.post(Dr.url + "/generate", json=body, timeout=LEG_TIMEOUT)
        assert_failed(r, str(room), f"127.0.0.1:{peer.port}", "handshake")
        assert peer.accepted, "the decode never connected"
        Dr.wait_idle(timeout=20)
    finally:
        fake.stop()
        peer.stop()


def test_decode_transfer_endpoint_stalls(cluster):
    """A kv_req names a decode endpoint that accepts and never answers: the prefill's page write
    fails by the tcp connect deadline, the prefill leg answers with that, and frees its pages."""
    import ctypes

    from pdserve.core.kv_layout import KVLayout
    from pdserve.transfer.base import PROTOCOL_VERSION
    from pdserve.transfer.tcp import TcpBackend

    Pr = cluster.Pr
    rank0 = httpx.get(f"http://{Pr.bootstrap_addr}/route?prefill_dp_rank=0", timeout=10).json()
    peer = StallingPeer()
    pool = bytearray(1 << 16)
    backend = TcpBackend(connect_timeout=5.0)
    page = rank0["page_size"]
    layout = KVLayout(base_ptr=0, num_regions=4, num_pages=512, page_bytes=512, region_stride=512 * 512,
                      page_size=page, dtype=rank0["kv_cache_dtype"])
    backend.start(KVLayout(ctypes.addressof(ctypes.c_char.from_buffer(pool)), 1, 1, len(pool), len(pool),
                           page, "float32"))
    try:
        ids = list(range(10, 50))
        room = room_on(0, 2)
        stalled = {"backend": "tcp", "version": PROTOCOL_VERSION, "ip": "127.0.0.1", "port": peer.port,
                   "instance": "stalled"}
        backend.send(rank0["endpoint"], {
            "t": "kv_req", "room": room, "dst_pages": list(range(-(-len(ids) // page))), "prompt_len": len(ids),
            "decode_rank": 0, "layout": {k: getattr(layout, k) for k in layout.__dataclass_fields__},
            "endpoint": stalled, "page_size": page, "kv_dtype": rank0["kv_cache_dtype"],
            "fingerprint": rank0["fingerprint"], "backend": "tcp"})
        body = {"input_ids": ids, "sampling_params": GREEDY, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": Pr.bootstrap_port, "bootstrap_room": room}
        r = httpx.post(Pr.url + "/generate", json=body, timeout=LEG_TIMEOUT)
        assert_failed(r, str(room), f"127.0.0.1:{peer.port}", "handshake")
        Pr.wait_idle(timeout=20)
    finally:
        backend.close()
        peer.stop()
