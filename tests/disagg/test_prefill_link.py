"""PrefillLink in-process: a real link (resolver, query batcher, heartbeat beaten by hand) over a
ThreadedBootstrap on 127.0.0.1, under a DecodeReceiver on the handoff harness's FakeBackends.
The machine's effects become the link's calls and its answers typed events in the receiver's
inbox; a prefill the heartbeats gave up fails new rooms at once, naming it as gone, while one
never reached is retried until the topology deadline (servers may start in any order)."""

from __future__ import annotations

import queue
import time

import pytest

from pdserve.disagg.bootstrap_client import BootstrapClient
from pdserve.disagg.bootstrap_server import ThreadedBootstrap
from pdserve.disagg.bootstrap_table import BootstrapTable, RankInfo
from pdserve.disagg.decode_events import GiveUp, Invalidate, RankResolved, Resolve
from pdserve.disagg.handoff import HandoffState
from pdserve.disagg.link_api import Inbox
from pdserve.disagg.prefill_link import LinkSettings, PrefillLink
from tests.harness.cluster import free_port
from tests.harness.handoff_harness import AUX, FP, PAGE_SIZE, PROMPT, SRC, WAIT_S, Link, make_link, poll_until

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_stray_threads")]
S = HandoffState
TOPOLOGY_S = 1.5  # the link's topology deadline here
GONE_WITHIN_S = 2.0  # the bound the issue sets for a new room naming a prefill known gone


def rank_info(ep: dict) -> RankInfo:
    return RankInfo(dp_rank=0, dp_size=1, rank_ip="127.0.0.1", rank_port=ep["port"], page_size=PAGE_SIZE,
                    kv_cache_dtype="float32", load_balance_method="auto", fingerprint=FP, endpoint=ep,
                    transfer_backend="fake")


@pytest.fixture
def boot(request):
    """A prefill's bootstrap service (dp 1, nothing registered yet); /fail_room lands in `failed`."""
    failed: queue.Queue = queue.Queue()
    server = ThreadedBootstrap(BootstrapTable(dp_size=1), on_room_failed=lambda room, why: failed.put((room, why)))
    request.addfinalizer(server.stop)
    server.failed = failed
    return server


def new_link(request) -> PrefillLink:
    """A link whose heartbeat thread sleeps (tests call `heartbeat.beat_all()` themselves)."""
    plink = PrefillLink(LinkSettings(topology_timeout=TOPOLOGY_S, query_timeout=2.0, heartbeat_interval=3600.0),
                        BootstrapClient(timeout=TOPOLOGY_S))
    request.addfinalizer(plink.close)
    return plink


@pytest.fixture
def wired(request, boot) -> tuple[Link, PrefillLink]:
    """The harness's sender and receiver, the receiver on a real PrefillLink, the prefill's rank
    registered with `boot`."""
    plink = new_link(request)
    lk = make_link(prefills=plink)
    request.addfinalizer(lk.close)
    boot.table.register_rank(rank_info(lk.p_local["endpoint"]))
    return lk, plink


def deliver_when_resolved(lk: Link) -> None:
    """Poll the decode until its kv_req reaches the prefill, and hand it over."""
    end = time.monotonic() + WAIT_S
    while not (got := lk.prefill_be.recv(0.01)):
        assert lk.receiver.poll() == []
        assert time.monotonic() < end, "the decode never sent its kv_req"
    for sender, msg in got:
        lk.sender.on_message(sender, msg)


def next_event(inbox: Inbox, kind: type):
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        got = [ev for ev in inbox.drain() if isinstance(ev, kind)]
        if got:
            return got[0]
        time.sleep(0.005)
    raise AssertionError(f"no {kind.__name__} within {WAIT_S}s")


# ---- effects in, events out --------------------------------------------------------------------
def test_effects_are_carried_out_and_answers_come_back_as_typed_events(request, boot):
    plink = new_link(request)
    inbox = Inbox()
    plink.bind(inbox)
    with pytest.raises(RuntimeError):
        plink.bind(Inbox())  # one receiver per link
    boot.table.register_rank(rank_info({"backend": "fake", "ip": "127.0.0.1", "port": 1234}))
    plink.execute(Resolve(boot.addr, 7, None))
    ev = next_event(inbox, RankResolved)
    res = ev.result
    assert (res.room, res.addr, res.rank, res.path, res.error) == (7, boot.addr, 0, "single", None)
    assert res.instance_id == boot.table.instance_id and ev.now == 0.0  # the receiver stamps `now`
    assert plink.snapshot(boot.addr).topology is not None
    plink.execute(Invalidate(boot.addr))
    assert plink.snapshot(boot.addr).topology is None and plink.snapshot(boot.addr).endpoints == {}
    plink.execute(GiveUp(boot.addr, 7, "no pages"))  # /fail_room, in the background
    room, why = boot.failed.get(timeout=WAIT_S)
    assert room == 7 and why.startswith("the decode side gave up the room") and why.endswith("no pages")
    boot.table.record(8, 0)
    plink.drop_room(boot.addr, 8, "prefilled here")  # /drop_room: the service forgets the room
    end = time.monotonic() + WAIT_S
    while boot.table.lookup([8]) != ({}, {}):
        assert time.monotonic() < end, "the room was never dropped"
        time.sleep(0.01)
    plink.watch("a:1"), plink.watch("a:1"), plink.watch("b:1")
    plink.unwatch("a:1")
    assert plink.watched() == {"a:1", "b:1"}
    plink.unwatch("a:1"), plink.unwatch("b:1")
    assert plink.watched() == set()


def test_a_handoff_through_the_link_and_the_watch_it_keeps(wired, boot):
    lk, plink = wired
    lk.sender.accept(1, "p-1", PROMPT)
    lk.sender.prefill_done(1, SRC, AUX)
    lk.receiver.accept(1, "d-1", boot.addr, PROMPT, None)
    assert plink.watched() == {boot.addr}
    deliver_when_resolved(lk)
    assert lk.prefill_done()[0].ok
    lk.to_decode()
    [done] = lk.decode_done()
    assert done.ok and done.meta["dp_rank_path"] == "single"
    assert plink.watched() == set()


# ---- issue 27's regression: a prefill known gone fails new rooms at once -----------------------
def test_a_prefill_the_heartbeats_gave_up_fails_a_new_room_at_once_naming_it_gone(request, wired, boot):
    lk, plink = wired
    lk.receiver.accept(1, "d-1", boot.addr, PROMPT, None)  # waits for KV that will never come
    deliver_when_resolved(lk)
    lk.wait_decode_state(1, S.WAITING_FOR_INPUT)
    plink.heartbeat.beat_all()
    assert lk.receiver.poll() == []
    boot.stop()  # the prefill server is killed
    plink.heartbeat.beat_all()
    plink.heartbeat.beat_all()  # the second miss: gone
    [first] = poll_until(lk.receiver.poll)
    assert not first.ok and "missed 2 heartbeats" in first.reason and "prefill server is gone" in first.reason
    t0 = time.monotonic()
    lk.receiver.accept(2, "d-2", boot.addr, PROMPT, None)
    [late] = poll_until(lk.receiver.poll)
    took = time.monotonic() - t0
    assert took < GONE_WITHIN_S, took
    assert not late.ok and late.room == 2 and "room 2" in late.reason
    assert f"prefill bootstrap {boot.addr} missed 2 heartbeats" in late.reason
    assert "prefill server is gone" in late.reason
    # it answers again (restarted on the same port): used again
    table = BootstrapTable(dp_size=1)
    table.register_rank(rank_info(lk.p_local["endpoint"]))
    again = ThreadedBootstrap(table, port=boot.port)
    request.addfinalizer(again.stop)
    lk.receiver.accept(3, "d-3", again.addr, PROMPT, None)
    deliver_when_resolved(lk)
    lk.wait_decode_state(3, S.WAITING_FOR_INPUT)
    assert not plink.snapshot(again.addr).gone


def test_a_prefill_never_reached_is_retried_until_the_topology_deadline(wired):
    """Servers start in any order: missed heartbeats of a prefill never heard from fail the rooms
    waiting on it (as they always did), but do not make it 'gone': a new room still retries it
    until its topology deadline."""
    lk, plink = wired
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens there
    lk.receiver.accept(1, "d-1", nowhere, PROMPT, None)
    plink.heartbeat.beat_all()
    plink.heartbeat.beat_all()
    [first] = poll_until(lk.receiver.poll)
    assert not first.ok and "missed 2 heartbeats" in first.reason
    assert not plink.snapshot(nowhere).gone
    t0 = time.monotonic()
    lk.receiver.accept(2, "d-2", nowhere, PROMPT, None)
    [late] = poll_until(lk.receiver.poll, timeout=TOPOLOGY_S + WAIT_S)
    took = time.monotonic() - t0
    assert took >= TOPOLOGY_S - 0.1, took  # retried, not failed at once
    assert not late.ok and f"no success within {TOPOLOGY_S}s" in late.reason and "room 2" in late.reason
