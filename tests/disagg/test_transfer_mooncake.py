"""The mooncake transfer backend: two real TransferEngines in this process over numpy pools.

Pools carry a guard area after their layout that must stay zero, so a stray write is caught.
Engine failures are driven with a stand-in engine class; import failures with a stubbed import.
Skipped (with the reason) only when Mooncake's engine cannot be imported here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time

import numpy as np
import pytest

from pdserve.core.envs import Envs
from pdserve.transfer import TransferError, create_backend
from pdserve.transfer import mooncake as mc
from tests.harness.transfer_pools import BackendPair, Pool, recv_until  # noqa: E402

pytestmark = pytest.mark.timeout(120)
if (_problem := mc.import_problem()) is not None:
    pytest.skip(f"mooncake backend unavailable: {_problem}", allow_module_level=True)

class Pair(BackendPair):
    backend = "mooncake"


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture(scope="module")
def pair():
    p = Pair(Pool(4, 16, 256, seed=1), Pool(4, 24, 256))
    yield p
    p.close()


@pytest.fixture
def fresh(pair):
    """The shared pair with b's pool zeroed again."""
    pair.b_pool.arr[:] = 0
    return pair


def test_descriptor_names_session_and_pool(pair):
    ep = pair.b_ep
    assert json.loads(json.dumps(ep)) == ep
    assert ep["backend"] == "mooncake" and ep["protocol"] == "tcp" and ep["version"] >= 1
    assert ep["base_ptr"] == pair.b_pool.layout.base_ptr
    host, port = ep["session"].rsplit(":", 1)
    assert host == ep["ip"] == "127.0.0.1" and int(port) > 0
    assert ep["session"] != pair.a_ep["session"] and ep["instance"] != pair.a_ep["instance"]


def test_pages_land_where_asked(fresh):
    src, dst = [0, 1, 2, 7, 8, 3], [5, 6, 7, 0, 1, 23]
    res = fresh.a.write_pages(fresh.b_ep, fresh.b_layout, src, dst)
    assert res.bytes == len(src) * 4 * 256
    assert res.num_writes == 3 * 4  # joint runs (0->5 x3), (7->0 x2), (3->23 x1), per region
    assert res.finished_at >= res.started_at
    expect = np.zeros_like(fresh.b_pool.pages)
    expect[:, dst] = fresh.a_pool.pages[:, src]
    assert np.array_equal(fresh.b_pool.pages, expect)  # landed before write_pages returned
    assert not fresh.b_pool.guard.any()
    fresh.a.send(fresh.b_ep, {"done": 1})
    assert recv_until(fresh.b, 1) == [(fresh.a_ep, {"done": 1})]


def test_message_after_writes_sees_all_pages():
    p = Pair(Pool(4, 64, 16384, seed=2), Pool(4, 64, 16384))
    try:
        rng = np.random.default_rng(3)
        seen = []  # what the receiver's pool held when each message arrived
        for round_ in range(4):
            p.a_pool.pages[:] = rng.integers(0, 256, p.a_pool.pages.shape, dtype=np.uint8)
            dst = rng.permutation(64).tolist()
            p.a.write_pages(p.b_ep, p.b_layout, list(range(64)), dst)
            p.a.send(p.b_ep, {"round": round_})
            got = recv_until(p.b, 1)
            seen.append(np.array_equal(p.b_pool.pages[:, dst], p.a_pool.pages))
            assert [m for _, m in got] == [{"round": round_}]
        assert seen == [True] * 4
    finally:
        p.close()


def test_messages_ordered_and_answered(pair):
    for i in range(50):
        pair.a.send(pair.b_ep, {"seq": i, "tup": (1, 2)})
    got = recv_until(pair.b, 50)
    assert [m["seq"] for _, m in got] == list(range(50))
    assert all(sender == pair.a_ep for sender, _ in got) and got[0][1]["tup"] == [1, 2]
    pair.b.send(got[0][0], {"reply": True})
    assert recv_until(pair.a, 1) == [(pair.b_ep, {"reply": True})]


def test_concurrent_writers_each_followed_by_its_message(fresh):
    """Four threads write disjoint page sets and announce them; every announced set is in place."""
    ok: list[bool] = []

    def worker(t: int) -> None:
        src, dst = [t * 4 + i for i in range(4)], [20 - t * 5 + i for i in range(4)]
        fresh.a.write_pages(fresh.b_ep, fresh.b_layout, src, dst)
        fresh.a.send(fresh.b_ep, {"t": t, "src": src, "dst": dst})

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for _, m in recv_until(fresh.b, 4):
        ok.append(np.array_equal(fresh.b_pool.pages[:, m["dst"]], fresh.a_pool.pages[:, m["src"]]))
    assert ok == [True] * 4
    assert not fresh.b_pool.guard.any()


def test_peer_of_another_backend_is_refused(pair):
    tcp = create_backend("tcp", connect_timeout=5.0)
    tcp_pool = Pool(4, 24, 256)
    tcp_ep = tcp.start(tcp_pool.layout)
    try:
        with pytest.raises(TransferError, match=r"speaks tcp v1, this endpoint speaks mooncake v1"):
            pair.a.write_pages(tcp_ep, tcp_pool.layout, [0], [0])
        with pytest.raises(TransferError, match=r"speaks tcp v1, this endpoint speaks mooncake v1"):
            pair.a.send(tcp_ep, {"x": 1})
        with pytest.raises(TransferError, match=r"speaks mooncake v1, this endpoint speaks tcp v1"):
            tcp.send(pair.b_ep, {"x": 1})
        # a tcp endpoint that reaches the mooncake control port anyway is refused at its hello
        disguised = {**pair.b_ep, "backend": "tcp"}
        with pytest.raises(TransferError, match=r"refused the connection: .*it speaks tcp v1, "
                                                r"this endpoint speaks mooncake v1"):
            tcp.send(disguised, {"x": 1})
        assert recv_until(pair.b, 1, deadline_s=0.5) == []
        assert not tcp_pool.arr.any() and not pair.b_pool.guard.any()
    finally:
        tcp.close()


def test_protocol_and_descriptor_mismatch_refused(fresh):
    with pytest.raises(TransferError, match=r"uses mooncake protocol 'rdma', this endpoint uses 'tcp'"):
        fresh.a.send({**fresh.b_ep, "protocol": "rdma"}, {"x": 1})
    with pytest.raises(TransferError, match="needs session"):
        fresh.a.write_pages({k: v for k, v in fresh.b_ep.items() if k != "session"}, fresh.b_layout, [0], [0])
    with pytest.raises(TransferError, match="not the expected"):  # the peer "restarted"
        fresh.a.write_pages({**fresh.b_ep, "instance": "0" * 16}, fresh.b_layout, [0], [0])
    assert not fresh.b_pool.arr.any()


def test_write_outside_registered_pool_fails_with_engine_code(fresh):
    """A peer layout that lies (more pages than the peer has): the peer's engine refuses the
    bytes beyond its registered pool, the sender gets the engine's code, nothing lands."""
    lie = dataclasses.replace(fresh.b_layout, num_pages=200)
    with pytest.raises(TransferError, match=r"batch_transfer_sync_write of 4 runs .* failed with code -\d+"):
        fresh.a.write_pages(fresh.b_ep, lie, [0], [100])  # even region 0's page 100 is past the pool
    assert not fresh.b_pool.arr.any()
    fresh.a.write_pages(fresh.b_ep, fresh.b_layout, [1], [2])  # the pair still works
    assert np.array_equal(fresh.b_pool.pages[:, 2], fresh.a_pool.pages[:, 1])


def test_sender_side_validation(fresh):
    with pytest.raises(TransferError, match="out of range"):
        fresh.a.write_pages(fresh.b_ep, fresh.b_layout, [0], [24])
    with pytest.raises(TransferError, match="page_bytes=256 but peer page_bytes=512"):
        fresh.a.write_pages(fresh.b_ep, dataclasses.replace(fresh.b_layout, page_bytes=512), [0], [0])
    assert not fresh.b_pool.arr.any()


def test_closed_peer_fails_fast_and_close_leaves_no_threads(pair):
    before = native_threads()
    p = Pair(Pool(2, 8, 128, seed=4), Pool(2, 8, 128))
    p.a.write_pages(p.b_ep, p.b_layout, [0, 1], [3, 4])
    p.a.send(p.b_ep, {"hi": 1})
    assert [m for _, m in recv_until(p.b, 1)] == [{"hi": 1}]
    p.b.close()
    p.b.close()  # idempotent
    with pytest.raises(TransferError, match=r"mooncake://127\.0\.0\.1"):
        p.a.write_pages(p.b_ep, p.b_layout, [0], [0])
    with pytest.raises(TransferError, match="closed"):
        p.b.send(p.a_ep, {"x": 1})
    assert p.b.recv(0.05) == []
    p.a.close()
    with pytest.raises(TransferError, match="mooncake backend is closed"):
        p.a.write_pages(p.b_ep, p.b_layout, [0], [0])
    names = [t.name for t in threading.enumerate() if t.name.startswith("pdserve-tcp-")
             and t.name.rsplit("-", 1)[1] in (str(p.a_ep["port"]), str(p.b_ep["port"]))]
    assert names == []
    end = time.monotonic() + 30
    while native_threads() > before and time.monotonic() < end:  # engine threads wind down
        time.sleep(0.1)
    assert native_threads() <= before


class _FailingEngine:
    """Stands in for mooncake.engine.TransferEngine: returns `codes` for the named calls."""

    codes: dict = {}

    def initialize(self, *args):
        return self.codes.get("initialize", 0)

    def register_memory(self, ptr, size):
        return self.codes.get("register_memory", 0)

    def get_rpc_port(self):
        return 1

    def unregister_memory(self, ptr):
        return 0


@pytest.mark.parametrize("call,code", [("initialize", -1), ("register_memory", -7)])
def test_engine_failures_carry_the_engine_code(call, code):
    before = set(threading.enumerate())
    b = create_backend("mooncake")
    b._engine_class = type("E", (_FailingEngine,), {"codes": {call: code}})
    with pytest.raises(TransferError, match=rf"{call}.* failed with code {code}"):
        b.start(Pool(2, 4, 64).layout)
    assert set(threading.enumerate()) <= before  # its control channel is stopped already
    b.close()


def test_options_protocol_and_envs():
    with pytest.raises(TransferError, match="'bogus' is not supported; use one of tcp, rdma"):
        create_backend("mooncake", protocol="bogus")
    envs = Envs.read({"PDSERVE_MOONCAKE_PROTOCOL": "rdma", "PDSERVE_MOONCAKE_DEVICE": "mlx5_0"})
    opts = mc.MooncakeBackend.env_options(envs)
    assert opts == {"protocol": "rdma", "device": "mlx5_0"}
    assert mc.MooncakeBackend.env_options(Envs.read({})) == {"protocol": "tcp", "device": ""}
    b = create_backend("mooncake", **opts)
    assert (b.protocol, b.device) == ("rdma", "mlx5_0")
    b.close()


class _BlockEngineImport:
    """A meta-path finder that fails `import mooncake.engine` with a given ImportError."""

    def __init__(self, error: ImportError):
        self.error = error

    def find_spec(self, name, path=None, target=None):
        if name == "mooncake.engine":
            raise self.error
        return None


def test_import_errors_say_what_to_install(monkeypatch):
    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BlockEngineImport(ImportError(
        "libibverbs.so.1: cannot open shared object file: No such file or directory")), *sys.meta_path])
    with pytest.raises(TransferError, match=r"apt-get install libibverbs1"):
        create_backend("mooncake")
    sys.meta_path[0] = _BlockEngineImport(ModuleNotFoundError("No module named 'mooncake'", name="mooncake"))
    with pytest.raises(TransferError, match=r"pip install 'pdserve\[mooncake\]'"):
        create_backend("mooncake")
    assert "pip install" in mc.import_problem()
