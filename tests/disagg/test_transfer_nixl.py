"""The nixl transfer backend: two real NIXL agents (UCX) in this process over numpy pools.

Pools carry a guard area after their layout that must stay zero, so a stray write is caught.
Notification gating is driven with real NIXL notifications sent by hand; import failures with
a stubbed import; the progress-thread delay with a stand-in bindings module. Skipped (with the
reason) only when NIXL cannot be imported here.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import sys
import threading
import time
import types

import numpy as np
import pytest

from pdserve.core.kv_layout import KVLayout
from pdserve.transfer import TransferError, create_backend, nixl_agent, nixl_gate
from pdserve.transfer import nixl as nx
from tests.harness.transfer_pools import BackendPair, Pool, recv_until  # noqa: E402

pytestmark = pytest.mark.timeout(120)
if (_problem := nx.import_problem()) is not None:
    pytest.skip(f"nixl backend unavailable: {_problem}", allow_module_level=True)

class Pair(BackendPair):
    backend = "nixl"


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


def test_descriptor_names_agent_metadata_and_pool(pair):
    ep = pair.b_ep
    assert json.loads(json.dumps(ep)) == ep
    assert ep["backend"] == "nixl" and ep["version"] >= 1 and ep["plugins"] == ["UCX"]
    assert ep["base_ptr"] == pair.b_pool.layout.base_ptr and ep["ip"] == "127.0.0.1"
    assert ep["agent"] == f"pdserve-{ep['instance']}" != pair.a_ep["agent"]
    assert base64.b64decode(ep["agent_metadata"]) and ep["agent_metadata"] != pair.a_ep["agent_metadata"]


def test_pool_spans_merge_adjacent_regions_only():
    lay = KVLayout(base_ptr=1000, num_regions=3, num_pages=4, page_bytes=10, region_stride=40, page_size=1,
                   dtype="bfloat16")
    assert nx._pool_spans(lay) == [(1000, 120)]
    padded = KVLayout(1000, 3, 4, 10, 50, 1, "bfloat16")  # a gap after each region's pages
    assert nx._pool_spans(padded) == [(1000, 40), (1050, 40), (1100, 40)]


def test_pages_land_where_asked(fresh):
    src, dst = [0, 1, 2, 7, 8, 3], [5, 6, 7, 0, 1, 23]
    res = fresh.a.write_pages(fresh.b_ep, fresh.b_layout, src, dst)
    assert res.bytes == len(src) * 4 * 256
    assert res.num_writes == 3 * 4  # joint runs (0->5 x3), (7->0 x2), (3->23 x1), per region
    assert res.finished_at >= res.started_at
    fresh.a.send(fresh.b_ep, {"done": 1})
    assert recv_until(fresh.b, 1) == [(fresh.a_ep, {"done": 1})]
    expect = np.zeros_like(fresh.b_pool.pages)
    expect[:, dst] = fresh.a_pool.pages[:, src]
    assert np.array_equal(fresh.b_pool.pages, expect)
    assert not fresh.b_pool.guard.any()


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

    def worker(t: int) -> None:
        src, dst = [t * 4 + i for i in range(4)], [20 - t * 5 + i for i in range(4)]
        fresh.a.write_pages(fresh.b_ep, fresh.b_layout, src, dst)
        fresh.a.send(fresh.b_ep, {"t": t, "src": src, "dst": dst})

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    got = recv_until(fresh.b, 4)
    assert sorted(m["t"] for _, m in got) == [0, 1, 2, 3]
    ok = [np.array_equal(fresh.b_pool.pages[:, m["dst"]], fresh.a_pool.pages[:, m["src"]]) for _, m in got]
    assert ok == [True] * 4
    assert not fresh.b_pool.guard.any()


def test_message_waits_for_the_notification_of_its_write(pair):
    """A message naming a write whose notification has not come is held; the notification
    (sent here by hand through NIXL, as a WRITE would send it) releases it, in order."""
    out = pair.a._peer_out(pair.b_ep["agent"])
    with out.lock:
        out.done.append(10_000)  # a write numbered 10000 'completed' but its notification is not out
    pair.a.send(pair.b_ep, {"after": "write"})
    pair.a.send(pair.b_ep, {"next": 1})  # behind it on the same path
    assert pair.b.recv(0.3) == []
    pair.a._agent.send_notif(pair.b_ep["agent"], nixl_gate.notif_for(10_000))
    got = recv_until(pair.b, 2)
    assert [m for _, m in got] == [{"after": "write"}, {"next": 1}]


def test_missing_notification_drops_the_path_after_io_timeout(caplog):
    p = Pair(Pool(2, 4, 64, seed=5), Pool(2, 4, 64), io_timeout=0.5)
    try:
        out = p.a._peer_out(p.b_ep["agent"])
        with out.lock:
            out.done.append(77)  # never notified
        p.a.send(p.b_ep, {"lost": 1})
        with caplog.at_level("ERROR", logger="pdserve.transfer.nixl"):
            assert recv_until(p.b, 1, deadline_s=2.0) == []
        assert "no NIXL notification for write(s) [77]" in caplog.text
        assert f"nixl://127.0.0.1:{p.a_ep['port']}" in caplog.text
        p.a.send(p.b_ep, {"later": 1})  # nothing more is delivered on that path
        assert recv_until(p.b, 1, deadline_s=0.5) == []
    finally:
        p.close()


def test_peer_of_another_backend_is_refused(pair):
    tcp = create_backend("tcp", connect_timeout=5.0)
    tcp_pool = Pool(4, 24, 256)
    tcp_ep = tcp.start(tcp_pool.layout)
    try:
        with pytest.raises(TransferError, match=r"speaks tcp v1, this endpoint speaks nixl v1"):
            pair.a.write_pages(tcp_ep, tcp_pool.layout, [0], [0])
        with pytest.raises(TransferError, match=r"speaks tcp v1, this endpoint speaks nixl v1"):
            pair.a.send(tcp_ep, {"x": 1})
        with pytest.raises(TransferError, match=r"speaks nixl v1, this endpoint speaks tcp v1"):
            tcp.send(pair.b_ep, {"x": 1})
        disguised = {**pair.b_ep, "backend": "tcp"}  # reaches the nixl control port anyway
        with pytest.raises(TransferError, match=r"refused the connection: .*it speaks tcp v1, "
                                                r"this endpoint speaks nixl v1"):
            tcp.send(disguised, {"x": 1})
        assert recv_until(pair.b, 1, deadline_s=0.5) == []
        assert not tcp_pool.arr.any() and not pair.b_pool.guard.any()
    finally:
        tcp.close()


def test_descriptor_mismatches_refused_before_any_byte(fresh):
    ep, lay = fresh.b_ep, fresh.b_layout
    with pytest.raises(TransferError, match=r"uses NIXL plugins \['LIBFABRIC'\], this endpoint uses \['UCX'\]"):
        fresh.a.send({**ep, "plugins": ["LIBFABRIC"]}, {"x": 1})
    with pytest.raises(TransferError, match="needs agent"):
        fresh.a.write_pages({k: v for k, v in ep.items() if k != "agent_metadata"}, lay, [0], [0])
    with pytest.raises(TransferError, match="not the expected"):  # the peer "restarted"
        fresh.a.write_pages({**ep, "instance": "0" * 16}, lay, [0], [0])
    other_pool = Pool(4, 24, 256)  # a live peer whose descriptor is tampered with
    other = create_backend("nixl")
    other_ep, other_lay = other.start(other_pool.layout), other_pool.layout
    try:
        with pytest.raises(TransferError, match="agent_metadata is not base64"):
            fresh.a.write_pages({**other_ep, "agent_metadata": "%%%"}, other_lay, [0], [0])
        with pytest.raises(TransferError, match=r"names agent .* but its metadata is agent .*'s"):
            fresh.a.write_pages({**other_ep, "agent_metadata": ep["agent_metadata"]}, other_lay, [0], [0])
        assert not other_pool.arr.any()
    finally:
        other.close()
    assert not fresh.b_pool.arr.any()


def test_write_outside_registered_pool_is_refused(fresh):
    """A peer layout that lies (more pages than the peer has): NIXL refuses the descriptors
    beyond the memory the peer registered, nothing lands, and the pair keeps working."""
    lie = dataclasses.replace(fresh.b_layout, num_pages=200)
    with pytest.raises(TransferError, match=r"NIXL WRITE #\d+ of 4 runs \(1024 bytes\) to nixl://127\.0\.0\.1:\d+ "
                                            r"refused: outside the KV pool the peer registered"):
        fresh.a.write_pages(fresh.b_ep, lie, [0], [100])
    assert not fresh.b_pool.arr.any()
    fresh.a.write_pages(fresh.b_ep, fresh.b_layout, [1], [2])
    fresh.a.send(fresh.b_ep, {"ok": 1})
    assert [m for _, m in recv_until(fresh.b, 1)] == [{"ok": 1}]
    assert np.array_equal(fresh.b_pool.pages[:, 2], fresh.a_pool.pages[:, 1])


def test_sender_side_validation(fresh):
    with pytest.raises(TransferError, match="out of range"):
        fresh.a.write_pages(fresh.b_ep, fresh.b_layout, [0], [24])
    with pytest.raises(TransferError, match="page_bytes=256 but peer page_bytes=512"):
        fresh.a.write_pages(fresh.b_ep, dataclasses.replace(fresh.b_layout, page_bytes=512), [0], [0])
    with pytest.raises(TransferError, match="control message must be a dict"):
        fresh.a.send(fresh.b_ep, ["not", "a", "dict"])
    assert not fresh.b_pool.arr.any()


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_closed_peer_fails_fast_and_close_releases_everything(no_stray_threads):
    before = native_threads()
    p = Pair(Pool(2, 8, 128, seed=4), Pool(2, 8, 128))
    p.a.write_pages(p.b_ep, p.b_layout, [0, 1], [3, 4])
    p.a.send(p.b_ep, {"hi": 1})
    assert [m for _, m in recv_until(p.b, 1)] == [{"hi": 1}]
    p.b.close()
    p.b.close()  # idempotent
    assert p.b._agent is None and p.b._reg is None
    started = time.monotonic()
    with pytest.raises(TransferError, match=r"nixl://127\.0\.0\.1"):
        p.a.write_pages(p.b_ep, p.b_layout, [0], [0])
    assert time.monotonic() - started < p.a._ctl.connect_timeout  # refused at connect, not at a deadline
    with pytest.raises(TransferError, match="nixl backend is closed"):
        p.b.send(p.a_ep, {"x": 1})
    assert p.b.recv(0.05) == []
    p.a.close()
    assert p.a._remotes == {} and p.a._agent is None
    with pytest.raises(TransferError, match="nixl backend is closed"):
        p.a.write_pages(p.b_ep, p.b_layout, [0], [0])
    end = time.monotonic() + 10  # the agents' progress threads are joined by their destructors
    while native_threads() > before and time.monotonic() < end:
        time.sleep(0.05)
    assert native_threads() <= before


class _StubBindings:
    """Stands in for NIXL's bindings module: records the progress delay an agent was built with."""

    def __init__(self):
        self.delays: list[int] = []

    def nixlAgent(self, name, config):  # noqa: N802
        self.delays.append(config.pthrDelay)
        return object()


def test_agents_get_a_sleeping_progress_thread():
    """nixl_agent() sets the UCX progress thread's delay to 0 (a core spinning per agent); ours
    get PROGRESS_DELAY_US, and the module is left as it was."""
    stub = _StubBindings()

    class Agent:
        def __init__(self, name, cfg):
            self.cfg = types.SimpleNamespace(pthrDelay=0)
            api.nixlBind.nixlAgent(name, self.cfg)
            self.backends = {"UCX": 1}

    api = types.SimpleNamespace(nixlBind=stub, nixl_agent=Agent, nixl_agent_config=lambda **kw: kw,
                                nixl_thread_sync_t=types.SimpleNamespace(NIXL_THREAD_SYNC_RW="rw"))
    nixl_agent.new_agent(api, "x", ("UCX",))
    assert stub.delays == [nixl_agent.PROGRESS_DELAY_US] and api.nixlBind is stub


def test_ucx_ib_modules_off_only_without_rdma_devices(monkeypatch, tmp_path):
    monkeypatch.delenv("UCX_MODULES", raising=False)
    monkeypatch.setattr(os.path, "isdir", lambda p: False)
    nixl_agent.set_env_defaults()
    assert os.environ["UCX_MODULES"] == "^ib"
    monkeypatch.setenv("UCX_MODULES", "all")  # the user's choice stands
    nixl_agent.set_env_defaults()
    assert os.environ["UCX_MODULES"] == "all"


class _BlockApiImport:
    """A meta-path finder that makes every NIXL API module unimportable."""

    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in ("nixl", "nixl_cu12", "nixl_cu13"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def test_import_errors_say_what_to_install(monkeypatch):
    for mod in list(sys.modules):
        if mod.split(".")[0] in ("nixl", "nixl_cu12", "nixl_cu13"):
            monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(sys, "meta_path", [_BlockApiImport(), *sys.meta_path])
    with pytest.raises(TransferError, match=r"needs NIXL's Python API: pip install --no-deps nixl-cu12==1\.5\.1"):
        create_backend("nixl")
    assert "nixl-cu12" in nx.import_problem()


def _gate(timeout: float = 5.0) -> nixl_gate.NotifGate:
    return nixl_gate.NotifGate(timeout, "me", lambda sender: sender["agent"])


def test_gate_delivers_in_order_once_named_notifications_are_in():
    g, a, b = _gate(), {"agent": "A"}, {"agent": "B"}
    g.hold(a, {"w": [0, 1], "m": {"a": 1}}, now=0.0)
    g.hold(a, {"w": [], "m": {"a": 2}}, now=0.0)  # behind a's first message
    g.hold(b, {"w": [], "m": {"b": 1}}, now=0.0)  # another sender is not held up by a
    assert g.release({}, now=0.1) == ([(b, {"b": 1})], True)
    assert g.release({"A": [nixl_gate.notif_for(1), b"not ours"]}, now=0.2) == ([], True)
    assert g.release({"A": [nixl_gate.notif_for(0)]}, now=0.3) == ([(a, {"a": 1}), (a, {"a": 2})], False)
    # a notification that came before its message is kept for it
    assert g.release({"A": [nixl_gate.notif_for(2)]}, now=0.4) == ([], False)
    g.hold(a, {"w": [2], "m": {"a": 3}}, now=0.5)
    assert g.release({}, now=0.6) == ([(a, {"a": 3})], False)


def test_gate_drops_malformed_messages_and_breaks_a_path_on_timeout(caplog):
    g, a = _gate(timeout=1.0), {"agent": "A"}
    with caplog.at_level("WARNING", logger="pdserve.transfer.nixl"):
        for bad in ({"m": {"x": 1}}, {"w": [True], "m": {}}, {"w": [1], "m": "text"}, ["w"]):
            g.hold(a, bad, now=0.0)
    assert g.release({}, now=0.0) == ([], False) and caplog.text.count("malformed control message from A") == 4
    g.hold(a, {"w": [5], "m": {"x": 1}}, now=0.0)
    with caplog.at_level("ERROR", logger="pdserve.transfer.nixl"):
        assert g.release({}, now=1.5) == ([], False)
    assert "no NIXL notification for write(s) [5] from A within 1.0s" in caplog.text
    g.hold(a, {"w": [], "m": {"later": 1}}, now=2.0)
    assert g.release({"A": [nixl_gate.notif_for(5)]}, now=2.0) == ([], False)  # the path stays broken


def test_recv_with_no_wait_takes_what_has_arrived(pair):
    pair.a.write_pages(pair.b_ep, pair.b_layout, [0], [0])
    pair.a.send(pair.b_ep, {"poll": 1})
    got: list = []
    end = time.monotonic() + 15
    while not got and time.monotonic() < end:
        got = pair.b.recv(0)  # never blocks, yet sees the message once its write's notification is in
        time.sleep(0.01)
    assert [m for _, m in got] == [{"poll": 1}]
