"""Step by step, no server processes: how a decode learns that prefill workers died or that a
prefill restarted (bootstrap table and /health, heartbeat, receiver, client revalidation), and
that the tcp backend drops its connection to a restarted peer's old instance."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pdserve.core.errors import Unavailable
from pdserve.core.kv_layout import KVLayout
from pdserve.disagg import wire
from pdserve.disagg.bootstrap_client import BootstrapClient, BootstrapError, Health
from pdserve.disagg.bootstrap_server import ThreadedBootstrap
from pdserve.disagg.bootstrap_table import BootstrapTable, RankInfo
from pdserve.disagg.decode_events import PeerAlive, PeerGone, Resolved
from pdserve.disagg.decode_rooms import DecodeState
from pdserve.disagg.handoff import HandoffState
from pdserve.disagg.heartbeat import Heartbeat
from pdserve.disagg.prefill_peers import PrefillPeers
from pdserve.transfer.tcp import TcpBackend
from tests.harness.handoff_harness import (
    ADDR,
    AUX,
    PROMPT,
    ROOM,
    SRC,
    Link,
    assert_idle,
    assert_pages_landed,
    make_link,
    poll_until,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_stray_threads")]
S = HandoffState


def rank_info(rank: int, dp_size: int = 2, port: int = 20000) -> RankInfo:
    return RankInfo(rank, dp_size, "127.0.0.1", port + rank, 4, "float32", "follow_bootstrap_room")


@pytest.fixture
def link(request) -> Link:
    lk = make_link()
    request.addfinalizer(lk.close)
    return lk


def resolve(lk: Link, room: int, rank: int | None, instance: str = "inst-1") -> None:
    lk.receiver.accept(room, f"d-{room}", ADDR, 8, None)
    if rank is not None:
        res = lk.resolved(room, rank)
        lk.prefills.resolved(Resolved(room, ADDR, rank, "fast", res.info, instance))
    lk.receiver.poll()


def failed(lk: Link) -> dict[int, str]:
    end = time.monotonic() + 5
    out: dict[int, str] = {}
    while time.monotonic() < end:
        out.update({d.room: d.reason for d in lk.receiver.poll() if not d.ok})
        time.sleep(0.01)
        if out and not any(r.state is DecodeState.ABORTING for r in lk.receiver.rooms.values()):
            break
    return out


# ---- bootstrap table and service ---------------------------------------------------------------
def test_gone_rank_is_refused_and_listed_by_health():
    table = BootstrapTable(dp_size=2)
    for r in (0, 1):
        table.register_rank(rank_info(r))
    table.mark_rank_gone(1, "process pid 7 exited with code -9")
    with pytest.raises(Unavailable, match="prefill dp_rank 1 is gone: process pid 7"):
        table.rank(1)
    assert table.rank(0).dp_rank == 0 and table.topology().dp_size == 2
    srv = ThreadedBootstrap(table)
    try:
        with BootstrapClient(timeout=5.0) as client:
            peers = PrefillPeers(client)
            assert peers.beat(srv.addr).instance_id == table.instance_id
            assert peers.gone_ranks(srv.addr) == {1: "process pid 7 exited with code -9"}
            table.register_rank(rank_info(1))  # a worker registering again is alive
            peers.beat(srv.addr)
            assert peers.gone_ranks(srv.addr) == {}
    finally:
        srv.stop()


def test_silent_cached_topology_is_revalidated_before_use():
    clock = [0.0]
    old = BootstrapTable(dp_size=1, instance_id="old")
    old.register_rank(rank_info(0, 1))
    srv = ThreadedBootstrap(old)
    port = srv.port
    with BootstrapClient(timeout=5.0) as client:
        peers = PrefillPeers(client, clock=lambda: clock[0])
        assert peers.topology(srv.addr, max_age_s=1.0).instance_id == "old"
        srv.stop()
        new = BootstrapTable(dp_size=1, instance_id="new")
        new.register_rank(rank_info(0, 1, port=31000))
        srv = ThreadedBootstrap(new, port=port)
        try:
            assert peers.topology(srv.addr, max_age_s=1.0).instance_id == "old"  # heard from recently
            clock[0] += 2.0
            assert peers.topology(srv.addr, max_age_s=1.0).instance_id == "new"
            assert peers.endpoint(srv.addr, 0).rank_port == 31000
            assert peers.snapshot(srv.addr).instance_id == "new"
        finally:
            srv.stop()


# ---- receiver ------------------------------------------------------------------------------------
def test_gone_ranks_fail_only_rooms_resolved_to_them(link):
    resolve(link, 1, rank=0)
    resolve(link, 2, rank=1)
    resolve(link, 3, rank=None)  # still resolving: its own lookup will find the rank gone
    link.prefills.gone(ADDR, "prefill h:1 dp_rank 1 is gone: died", ranks=frozenset({1}))
    out = failed(link)
    assert list(out) == [2] and out[2] == "room 2 (prefill dp_rank 1): prefill h:1 dp_rank 1 is gone: died"
    assert set(link.receiver.rooms) == {1, 3}


def test_restart_fails_only_rooms_resolved_against_another_instance(link):
    resolve(link, 1, rank=0, instance="new")
    resolve(link, 2, rank=0, instance="old")
    resolve(link, 3, rank=None)  # still resolving: its resolution sees the new instance
    link.prefills.alive(ADDR, "new")
    out = failed(link)
    assert list(out) == [2] and "restarted (instance old -> new); its rooms are lost" in out[2]
    assert set(link.receiver.rooms) == {1, 3}


def test_a_restart_while_idle_spares_rooms_of_the_new_instance(link):
    """Issue 14 item 4: rooms resolved against instance A finished; the prefill restarted as B
    while the decode was idle; a new room resolving (and then resolved) against B must live."""
    resolve(link, 1, rank=0, instance="A")
    link.prefills.alive(ADDR, "A")
    link.prefills.gone(ADDR, "its worker died", ranks=frozenset({0}))  # ends room 1, pages and all
    failed(link)
    assert link.receiver.rooms == {}
    resolve(link, 2, rank=None)  # resolving against B
    link.prefills.alive(ADDR, "B")
    assert link.receiver.poll() == []
    res = link.resolved(2, 0)
    link.prefills.resolved(Resolved(2, ADDR, 0, "query", res.info, "B"))
    link.prefills.alive(ADDR, "B")
    assert link.receiver.poll() == [] and not link.receiver.rooms[2].handoff.done


UNHEARD = f"prefill bootstrap {ADDR} missed 2 heartbeats (0.5s apart): prefill server is gone"


def test_an_unheard_prefill_fails_the_room_at_once_and_its_late_kv_done_frees_the_pages(link):
    """A partitioned (not dead) prefill that has the kv_req writes the pages once the link heals:
    the receiver answers the room at once but holds its pages, and keeps watching that prefill,
    until the write's kv_done says nothing more can land."""
    link.sender.accept(ROOM, "p-1", PROMPT)
    link.deliver_req()
    link.prefills.gone(ADDR, UNHEARD)
    [done] = poll_until(link.receiver.poll)
    assert not done.ok and done.reason == f"room {ROOM} (prefill dp_rank 0): {UNHEARD}"
    assert done.meta["failure_cause"] == "peer_gone"
    assert link.receiver.holds(ROOM) and link.receiver.released() == [] and link.receiver.inflight() == 1
    assert link.receiver.states() == {"quarantined": 1} and link.prefills.watched() == {ADDR}
    link.sender.prefill_done(ROOM, SRC, AUX)  # healed: the prefill writes the room's pages
    [pdone] = link.prefill_done()
    assert pdone.ok  # for the prefill the handoff worked
    link.to_decode()  # its kv_done
    assert link.receiver.poll() == [] and link.receiver.released() == [ROOM] and not link.receiver.holds(ROOM)
    assert link.receiver.released() == []  # named once
    assert_pages_landed(link, SRC, link.pool.held[f"d-{ROOM}"])  # into pages nobody else had
    assert_idle(link)


def test_the_same_prefill_heard_again_is_asked_and_its_answer_frees_the_pages(link):
    link.deliver_req()  # the prefill has the kv_req but not the request: it would wait
    link.prefills.gone(ADDR, UNHEARD)
    poll_until(link.receiver.poll)
    link.prefills.alive(ADDR, "inst-1")  # the link healed, the same instance answers
    assert link.receiver.poll() == []
    [abort] = link.to_prefill()
    assert abort["t"] == wire.KV_ABORT and abort["room"] == ROOM and "missed 2 heartbeats" in abort["reason"]
    [fail] = link.to_decode()
    assert fail["t"] == wire.KV_FAIL
    assert link.receiver.poll() == [] and link.receiver.released() == [ROOM]
    link.sender.poll()  # the prefill's own record of the room
    assert_idle(link)


def test_a_quarantine_without_word_ends_at_its_deadline(link):
    link.deliver_req()
    link.prefills.gone(ADDR, UNHEARD)
    poll_until(link.receiver.poll)
    t = link.receiver.rooms[ROOM].entered[DecodeState.QUARANTINED]
    assert link.receiver.poll(now=t + 359.0) == [] and link.receiver.released() == []
    assert link.receiver.poll(now=t + 360.5) == [] and link.receiver.released() == [ROOM]
    assert link.receiver.inflight() == 0 and link.prefills.watched() == set()


# ---- heartbeat -----------------------------------------------------------------------------------
class StubClient:
    """A BootstrapClient stand-in: one instance id (None = no answer), gone ranks and load."""

    timeout = 1.0

    def __init__(self):
        self.instance: str | None = "a"
        self.gone: dict[int, str] = {}
        self.load: int | None = None

    def health(self, addr: str, *, timeout: float | None = None) -> Health | None:
        return None if self.instance is None else Health(self.instance, dict(self.gone), self.load)


def test_heartbeat_reports_gone_ranks_and_the_live_instance_of_every_answer():
    client, calls, alive = StubClient(), [], []
    peers = PrefillPeers(client)
    hb = Heartbeat(peers, interval=3600.0, max_failures=2, watched=lambda: {ADDR},
                   post=lambda ev: (calls if isinstance(ev, PeerGone) else alive).append(ev))
    try:
        hb.beat_all()
        assert calls == []
        client.gone = {1: "process pid 9 exited with code -9"}
        hb.beat_all()
        assert calls == [PeerGone(ADDR, f"prefill {ADDR} dp_rank 1 is gone: process pid 9 exited with code -9",
                                  ranks=frozenset({1}))]
        calls.clear()
        client.gone, client.instance = {}, "b"
        hb.beat_all()
        assert calls == [] and alive == [PeerAlive(ADDR, "a"), PeerAlive(ADDR, "a"), PeerAlive(ADDR, "b")]
        client.load = 4096  # the prefill's load rides on its /health: kept per address
        hb.beat_all()
        assert peers.load_tokens(ADDR) == 4096 and peers.load_tokens("other:1") is None
        client.instance = None  # misses are counted on the peer and reset once reported
        hb.beat_all()
        assert peers.misses(ADDR) == 1
        hb.beat_all()
        assert peers.misses(ADDR) == 0 and "missed 2 heartbeats" in calls[-1].reason
    finally:
        hb.close()


def test_a_prefill_the_heartbeat_gave_up_fails_new_rooms_at_once():
    """A new room naming a prefill the heartbeat declared gone fails at once with that reason
    (not after the topology deadline); once it answers again it is used; one never reached is
    still retried until the deadline (it may be starting)."""
    client = StubClient()
    topo_calls = []
    TOPO = type("Topo", (), {"instance_id": ""})()

    def fetch_topology(addr, *, deadline_s=None):
        topo_calls.append(deadline_s)
        if client.instance is None:
            raise BootstrapError(f"bootstrap {addr}: no answer for {deadline_s} s")
        return TOPO
    client.fetch_topology = fetch_topology
    peers = PrefillPeers(client)
    hb = Heartbeat(peers, interval=3600.0, max_failures=2, watched=lambda: {ADDR}, post=lambda ev: None)
    try:
        with pytest.raises(BootstrapError, match="no answer for 30"):  # never reached: retried
            client.instance = None
            peers.topology(ADDR, deadline_s=30)
        client.instance = "a"
        assert peers.topology(ADDR, deadline_s=30) is TOPO
        client.instance = None
        hb.beat_all()
        hb.beat_all()  # given up
        assert peers.snapshot(ADDR).gone and peers.snapshot(ADDR).topology is None
        t0 = time.monotonic()
        with pytest.raises(BootstrapError, match=f"prefill bootstrap {ADDR} missed 2 heartbeats.*gone"):
            peers.topology(ADDR, deadline_s=30)
        assert time.monotonic() - t0 < 1.0 and len(topo_calls) == 2  # no fetch, no wait
        client.instance = "b"  # back (restarted): used again
        assert peers.topology(ADDR, deadline_s=30) is TOPO and not peers.snapshot(ADDR).gone
    finally:
        hb.close()


# ---- tcp: a peer restarted on the same address ---------------------------------------------------
def make_pool(pages: int = 4, page_bytes: int = 64) -> tuple[np.ndarray, KVLayout]:
    arr = np.zeros(2 * pages * page_bytes, dtype=np.uint8)
    return arr, KVLayout(arr.ctypes.data, 2, pages, page_bytes, pages * page_bytes, 16, "bfloat16")


def recv_one(backend: TcpBackend) -> dict:
    end = time.monotonic() + 5
    while time.monotonic() < end:
        got = backend.recv(0.05)
        if got:
            return got[0][1]
    raise AssertionError("nothing received")


def test_connection_to_a_restarted_peers_old_instance_is_dropped():
    mems = [make_pool() for _ in range(3)]
    sender, old = TcpBackend(connect_timeout=2.0), TcpBackend(connect_timeout=2.0)
    new = None
    try:
        sender.start(mems[0][1])
        old_ep = old.start(mems[1][1])
        sender.send(old_ep, {"n": 1})
        assert recv_one(old) == {"n": 1}
        old.close()
        new = TcpBackend(connect_timeout=2.0)
        new_ep = new.start(mems[2][1], port=old_ep["port"])
        assert new_ep["instance"] != old_ep["instance"]
        sender.send(new_ep, {"n": 2})
        assert recv_one(new) == {"n": 2}
        keys = [k for k in sender._out if k[:2] == ("127.0.0.1", old_ep["port"])]
        assert keys == [("127.0.0.1", old_ep["port"], new_ep["instance"])]
    finally:
        for b in (sender, old, new):
            if b is not None:
                b.close()
