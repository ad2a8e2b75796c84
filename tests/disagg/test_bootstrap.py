"""Bootstrap table (rooms, TTL, rank registry) and the bootstrap HTTP service driven by its client
over real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from pdserve.core.errors import BadRequest, Unavailable
from pdserve.core.launcher import free_port
from pdserve.core.pd_vocab import BackendName, KvDtype
from pdserve.disagg.bootstrap_client import BootstrapClient, BootstrapError, bootstrap_addr
from pdserve.disagg.bootstrap_server import MAX_QUERY_ROOMS, ThreadedBootstrap
from pdserve.disagg.bootstrap_table import BootstrapTable, RankInfo
from pdserve.disagg.prefill_peers import PrefillPeers

FP = {"architecture": "LlamaForCausalLM", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16}


def rank_body(rank: int, dp_size: int = 2, **over) -> dict:
    body = dict(dp_rank=rank, dp_size=dp_size, rank_ip="127.0.0.1", rank_port=20000 + rank,
                page_size=16, kv_cache_dtype="bfloat16", load_balance_method="auto",
                fingerprint=FP, endpoint={"kind": "tcp", "port": 20000 + rank},
                transfer_backend="tcp")
    body.update(over)
    return body


def rank_info(rank: int, dp_size: int = 2, **over) -> RankInfo:
    return RankInfo.from_json(rank_body(rank, dp_size, **over))


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# ---- table: rooms ----
def test_record_lookup_forget():
    t = BootstrapTable(dp_size=2)
    t.record(10, 1)
    t.record(11, 0)
    t.record_failed(12, "conflict at 12")
    assert t.lookup([10, 11, 12, 13]) == ({10: 1, 11: 0}, {12: "conflict at 12"})
    assert len(t) == 3
    t.forget(10)
    t.forget(999)  # unknown: no error
    assert t.lookup([10]) == ({}, {})
    assert len(t) == 2


def test_failed_wins_over_record():
    t = BootstrapTable(dp_size=2)
    t.record(5, 1)
    t.record_failed(5, "bad")
    t.record(5, 0)
    assert t.lookup([5]) == ({}, {5: "bad"})


def test_ttl_expiry_and_refresh():
    clock = FakeClock()
    t = BootstrapTable(dp_size=2, ttl=10.0, clock=clock)
    t.record(1, 0)
    clock.t = 5.0
    t.record(2, 1)
    t.record_failed(3, "x")
    clock.t = 9.0
    t.record(1, 0)  # re-recording refreshes its TTL
    clock.t = 15.0
    assert t.lookup([1, 2, 3]) == ({1: 0}, {})
    assert len(t) == 1
    clock.t = 19.0
    assert len(t) == 0


def test_record_validates_room_and_rank():
    t = BootstrapTable(dp_size=2)
    with pytest.raises(BadRequest, match="bootstrap_room"):
        t.record(-1, 0)
    with pytest.raises(BadRequest, match=r"dp_rank for bootstrap_room 7.*\[0, 2\)"):
        t.record(7, 2)
    with pytest.raises(BadRequest):
        BootstrapTable().record(7, "0")  # type: ignore[arg-type]


# ---- table: ranks ----
def test_ready_only_when_every_rank_registered():
    t = BootstrapTable(force_query_dp_rank=True, instance_id="inst")
    assert not t.ready
    with pytest.raises(Unavailable, match="0/"):
        t.topology()
    t.register_rank(rank_info(1))
    with pytest.raises(Unavailable, match=r"1/2.*missing: \[0\]"):
        t.rank(1)
    t.register_rank(rank_info(0))
    assert t.ready and t.dp_size == 2
    topo = t.topology()
    assert (topo.dp_size, topo.page_size, topo.kv_cache_dtype) == (2, 16, "bfloat16")
    assert topo.follow_bootstrap_room and topo.force_query_dp_rank  # auto = follow on a prefill
    assert topo.load_balance_method == "follow_bootstrap_room"
    assert topo.fingerprint == FP and topo.instance_id == "inst"
    assert t.rank(1).rank_port == 20001
    with pytest.raises(BadRequest, match="prefill_dp_rank"):
        t.rank(2)


@pytest.mark.parametrize("field,value", [
    ("page_size", 32), ("kv_cache_dtype", "float32"), ("fingerprint", {**FP, "num_layers": 3}),
    ("load_balance_method", "round_robin"), ("transfer_backend", "mooncake"),
])
def test_registration_must_agree_with_other_ranks(field, value):
    t = BootstrapTable()
    t.register_rank(rank_info(0))
    with pytest.raises(BadRequest, match=f"rank 1 registered {field}=.*rank 0 registered {field}="):
        t.register_rank(rank_info(1, **{field: value}))


def test_registration_names_parse_to_their_enums_or_name_the_field():
    info = rank_info(0, kv_cache_dtype="float32", transfer_backend="mooncake")
    assert info.kv_cache_dtype is KvDtype.FLOAT32 and info.transfer_backend is BackendName.MOONCAKE
    assert rank_info(0, transfer_backend=None).transfer_backend is BackendName.TCP  # the default
    assert info.to_json()["kv_cache_dtype"] == "float32" and json.dumps(info.to_json())  # its wire spelling
    with pytest.raises(BadRequest, match=r"field 'kv_cache_dtype': unknown KV cache dtype 'bf16'; known: "
                                         r"bfloat16, float16, float32"):
        rank_info(0, kv_cache_dtype="bf16")
    with pytest.raises(BadRequest, match=r"field 'transfer_backend': unknown transfer backend 'rdma'; known: "
                                         r"fake, mooncake, nixl, tcp"):
        rank_info(0, transfer_backend="rdma")


def test_dtype_and_backend_names_have_one_parser():
    assert KvDtype.parse("bfloat16") is KvDtype.parse("torch.bfloat16") is KvDtype.BFLOAT16  # torch's str()
    assert BackendName.parse("nixl") is BackendName.NIXL and BackendName.parse(BackendName.TCP) is BackendName.TCP
    assert f"{KvDtype.FLOAT16} {BackendName.TCP!r}" == "float16 'tcp'"  # they read as their wire spelling
    for parse, bad in ((KvDtype.parse, "float64"), (KvDtype.parse, None), (BackendName.parse, "TCP")):
        with pytest.raises(ValueError, match=f"unknown .* {bad!r}; known: "):
            parse(bad)


def test_registration_dp_size_consistent():
    t = BootstrapTable(dp_size=2)
    with pytest.raises(BadRequest, match="dp_size 4.*dp_size 2"):
        t.register_rank(rank_info(0, dp_size=4))
    t = BootstrapTable()
    t.register_rank(rank_info(0, dp_size=2))
    with pytest.raises(BadRequest, match="dp_size"):
        t.register_rank(rank_info(1, dp_size=3))


def test_reregistration_replaces_rank():
    t = BootstrapTable(dp_size=2)
    t.register_rank(rank_info(0))
    t.register_rank(rank_info(1))
    t.register_rank(rank_info(1, rank_port=30001))  # a restarted worker
    assert t.rank(1).rank_port == 30001
    single = BootstrapTable(dp_size=1)
    single.register_rank(rank_info(0, dp_size=1))
    single.register_rank(rank_info(0, dp_size=1, page_size=32))  # no other rank to disagree with
    assert single.topology().page_size == 32


# ---- HTTP service + client ----
@pytest.fixture
def client():
    c = BootstrapClient(timeout=5.0)
    yield c
    c.close()


@pytest.fixture
def serve():
    started: list[ThreadedBootstrap] = []

    def start(table: BootstrapTable, **kw) -> ThreadedBootstrap:
        srv = ThreadedBootstrap(table, "127.0.0.1", **kw)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture
def http():
    with httpx.Client(timeout=5.0, trust_env=False) as c:
        yield c


def test_503_until_all_ranks_then_topology(serve, client, http):
    table = BootstrapTable()
    srv = serve(table)
    r = http.get(f"http://{srv.addr}/route", params={"prefill_dp_rank": -1})
    assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"
    client.register_rank(srv.addr, rank_info(0), deadline_s=5)
    assert http.get(f"http://{srv.addr}/route?prefill_dp_rank=0").status_code == 503
    with pytest.raises(BootstrapError, match=f"topology of {srv.addr}.*503") as e:
        client.fetch_topology(srv.addr, deadline_s=0.2)
    assert e.value.http_status == 503
    client.register_rank(srv.addr, rank_info(1), deadline_s=5)
    topo = client.fetch_topology(srv.addr)
    assert topo == table.topology()
    assert topo.dp_size == 2 and topo.follow_bootstrap_room and not topo.force_query_dp_rank
    body = http.get(f"http://{srv.addr}/route?prefill_dp_rank=1").json()
    assert (body["rank_ip"], body["rank_port"]) == ("127.0.0.1", 20001)
    assert body["endpoint"] == {"kind": "tcp", "port": 20001}
    assert client.fetch_rank(srv.addr, 1) == (rank_info(1), table.instance_id)
    assert client.health(srv.addr).instance_id == table.instance_id


def test_topology_fetch_waits_for_registration(serve, client):
    table = BootstrapTable(dp_size=1)
    srv = serve(table)
    got = []
    t = threading.Thread(target=lambda: got.append(client.fetch_topology(srv.addr, deadline_s=20)))
    t.start()
    table.register_rank(rank_info(0, dp_size=1))
    t.join(timeout=30)
    assert not t.is_alive() and got[0].dp_size == 1


def test_register_retries_until_service_is_up(serve, client):
    port = free_port()
    table = BootstrapTable(dp_size=1)
    errors: list[Exception] = []

    def register():
        try:
            client.register_rank(f"127.0.0.1:{port}", rank_info(0, dp_size=1), deadline_s=20)
        except Exception as e:  # surfaced by the assert below
            errors.append(e)

    t = threading.Thread(target=register)
    t.start()
    serve(table, port=port)
    t.join(timeout=30)
    assert not t.is_alive() and errors == [] and table.ready


def test_query_batching_found_failed_absent(serve, client, http):
    table = BootstrapTable(dp_size=4)
    srv = serve(table)
    big = (1 << 63) - 1
    table.record(big, 3)  # in-process, as the prefill front does
    client.register_dp_rank(srv.addr, 22, 1)  # over HTTP, as a remote worker does
    assert http.post(f"http://{srv.addr}/query_dp_ranks",
                     json={"bootstrap_rooms": [big, 22, 33]}).json() == {str(big): 3, "22": 1}
    table.record_failed(44, "follow_bootstrap_room conflict: ...")
    found, failed = client.query_dp_ranks(srv.addr, [big, 22, 33, 44])
    assert found == {big: 3, 22: 1} and failed == {44: "follow_bootstrap_room conflict: ..."}
    assert client.query_dp_ranks(srv.addr, []) == ({}, {})


@pytest.mark.parametrize("method,path,payload", [
    ("PUT", "/route", b"{not json"),
    ("PUT", "/route", [1, 2]),
    ("PUT", "/route", {k: v for k, v in rank_body(0).items() if k != "rank_ip"}),
    ("PUT", "/route", rank_body(0, dp_rank="0")),
    ("PUT", "/route", rank_body(0, dp_rank=2)),
    ("PUT", "/route", rank_body(0, rank_port=True)),
    ("PUT", "/route", rank_body(0, load_balance_method="random")),
    ("PUT", "/route", rank_body(0, kv_cache_dtype="bf17")),
    ("PUT", "/route", rank_body(0, transfer_backend="rdma")),
    ("PUT", "/route", rank_body(0, dp_size=0)),
    ("PUT", "/route", rank_body(0, dp_size=3)),  # table has dp_size 2
    ("GET", "/route?prefill_dp_rank=abc", None),
    ("GET", "/route?prefill_dp_rank=5", None),
    ("POST", "/register_dp_rank", {"bootstrap_room": -1, "dp_rank": 0}),
    ("POST", "/register_dp_rank", {"bootstrap_room": 1 << 63, "dp_rank": 0}),
    ("POST", "/register_dp_rank", {"bootstrap_room": 1, "dp_rank": 2}),
    ("POST", "/register_dp_rank", {"bootstrap_room": "1", "dp_rank": 0}),
    ("POST", "/query_dp_ranks", {"bootstrap_rooms": 5}),
    ("POST", "/query_dp_ranks", {"bootstrap_rooms": [1, "2"]}),
    ("POST", "/query_dp_ranks", {"bootstrap_rooms": [1 << 63]}),
    ("POST", "/query_dp_ranks", {"bootstrap_rooms": [True]}),
    ("POST", "/query_dp_ranks", {"bootstrap_rooms": list(range(MAX_QUERY_ROOMS + 1))}),
    ("POST", "/query_dp_ranks", b""),
    ("POST", "/fail_room", {"bootstrap_room": 1}),
    ("POST", "/fail_room", {"bootstrap_room": 1, "reason": "  "}),
    ("POST", "/fail_room", {"bootstrap_room": -1, "reason": "x"}),
    ("POST", "/fail_room", {"bootstrap_room": 1, "reason": 7}),
])
def test_bad_inputs_are_400_json(serve, http, method, path, payload):
    table = BootstrapTable(dp_size=2)
    table.register_rank(rank_info(0))
    table.register_rank(rank_info(1))
    srv = serve(table)
    kw = {"content": payload} if isinstance(payload, bytes) else {"json": payload}
    r = http.request(method, f"http://{srv.addr}{path}", **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert http.get(f"http://{srv.addr}/health").status_code == 200  # still serving
    assert table.lookup([1]) == ({}, {}) and table.rank(0) == rank_info(0)


def test_inconsistent_registration_message(serve, client):
    srv = serve(BootstrapTable())
    client.register_rank(srv.addr, rank_info(0), deadline_s=5)
    with pytest.raises(BootstrapError, match=r"answered 400: rank 1 registered page_size=32") as e:
        client.register_rank(srv.addr, rank_info(1, page_size=32), deadline_s=5)
    assert e.value.http_status == 400


def test_unknown_route_is_json_404(serve, http):
    srv = serve(BootstrapTable())
    r = http.get(f"http://{srv.addr}/nope")
    assert r.status_code == 404 and "error" in r.json()


def test_token_guards_write_routes(serve, http):
    table = BootstrapTable(dp_size=1)
    srv = serve(table, token="s3cret")
    base = f"http://{srv.addr}"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = http.put(f"{base}/route", json=rank_body(0, dp_size=1), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = http.post(f"{base}/register_dp_rank", json={"bootstrap_room": 1, "dp_rank": 0},
                      headers=headers)
        assert r.status_code == 401
        r = http.post(f"{base}/fail_room", json={"bootstrap_room": 1, "reason": "x"}, headers=headers)
        assert r.status_code == 401
    assert not table.ready and len(table) == 0
    with BootstrapClient(timeout=5.0, token="s3cret") as authed:
        authed.register_rank(srv.addr, rank_info(0, dp_size=1), deadline_s=5)
        authed.register_dp_rank(srv.addr, 1, 0)
    # reads stay open
    assert http.get(f"{base}/route?prefill_dp_rank=-1").status_code == 200
    assert http.post(f"{base}/query_dp_ranks", json={"bootstrap_rooms": [1]}).json() == {"1": 0}
    assert http.get(f"{base}/health").json()["instance_id"] == table.instance_id


def test_fail_room_reaches_the_handler_naming_the_room(serve, client):
    table = BootstrapTable(dp_size=1)
    got: list[tuple[int, str]] = []
    srv = serve(table, on_room_failed=lambda room, reason: got.append((room, reason)))
    client.fail_room(srv.addr, 42, "room 42: prefill uses 'mooncake', this decode uses 'tcp'")
    client.fail_room(srv.addr, 43, "x" * 5000)
    assert got[0] == (42, "the decode side gave up the room: room 42: prefill uses 'mooncake', "
                          "this decode uses 'tcp'")
    assert got[1][0] == 43 and got[1][1].startswith("the decode side gave up the room: room 43: xxx")
    assert len(got[1][1]) < 2100  # bounded
    plain = serve(table)  # without a handler the table records it failed
    client.fail_room(plain.addr, 44, "room 44: gone")
    assert table.lookup([44]) == ({}, {44: "the decode side gave up the room: room 44: gone"})


def test_restarted_prefill_invalidates_what_the_decode_knew(serve, client):
    """PrefillPeers is the decode's one owner of what it knows per prefill address: a new
    instance id in any answer drops the topology and endpoints of the old one."""
    peers = PrefillPeers(client)
    old = BootstrapTable(dp_size=1, instance_id="old")
    old.register_rank(rank_info(0, dp_size=1))
    srv = serve(old)
    addr, port = srv.addr, srv.port
    assert peers.topology(addr).instance_id == "old"
    assert peers.endpoint(addr, 0).rank_port == 20000
    srv.stop()
    assert peers.beat(addr) is None and peers.misses(addr) == 1
    new = BootstrapTable(dp_size=1, instance_id="new")
    new.register_rank(rank_info(0, dp_size=1, rank_port=31000))
    serve(new, port=port)
    assert peers.topology(addr).instance_id == "old"  # still cached
    assert peers.beat(addr).instance_id == "new"  # noticed the restart: what it knew is dropped
    assert peers.misses(addr) == 0 and peers.snapshot(addr).topology is None
    assert peers.topology(addr).instance_id == "new"
    assert peers.endpoint(addr, 0).rank_port == 31000
    peers.invalidate(addr)
    assert peers.snapshot(addr).endpoints == {}
    assert peers.topology(addr).instance_id == "new"


def test_dead_service_errors_name_the_address(client):
    addr = f"127.0.0.1:{free_port()}"
    with pytest.raises(BootstrapError, match=f"bootstrap {addr}: POST /query_dp_ranks failed"):
        client.query_dp_ranks(addr, [1])
    with pytest.raises(BootstrapError, match="registering prefill dp_rank 0: no success within"):
        client.register_rank(addr, rank_info(0), deadline_s=0.3)
    assert client.health(addr) is None


def test_bootstrap_addr():
    assert bootstrap_addr("10.0.0.1", None) == "10.0.0.1:8998"
    assert bootstrap_addr("h", 9000) == "h:9000"
    assert bootstrap_addr("::1", 9000) == "[::1]:9000"
