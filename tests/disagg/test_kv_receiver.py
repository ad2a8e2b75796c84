"""DecodeReceiver step by step against a PrefillSender (tests/harness/handoff_harness.py), plus the
Heartbeat that fails a gone prefill's rooms and one full handoff through a real PrefillLink
(resolver, heartbeat) and a ThreadedBootstrap on 127.0.0.1."""

from __future__ import annotations

import time

import msgspec
import pytest

from pdserve.disagg import wire
from pdserve.disagg.bootstrap_client import BootstrapClient, Health
from pdserve.disagg.bootstrap_server import ThreadedBootstrap
from pdserve.disagg.bootstrap_table import BootstrapTable, RankInfo
from pdserve.disagg.decode_rooms import DecodeState
from pdserve.disagg.handoff import HandoffState
from pdserve.disagg.heartbeat import Heartbeat
from pdserve.disagg.prefill_link import LinkSettings, PrefillLink
from pdserve.disagg.prefill_peers import PrefillPeers
from tests.harness.handoff_harness import (
    ADDR,
    AUX,
    FP,
    PAGE_SIZE,
    PROMPT,
    ROOM,
    SRC,
    WAIT_S,
    Link,
    assert_idle,
    assert_pages_landed,
    make_link,
    pump,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_stray_threads")]

S = HandoffState
D = DecodeState
ADDR_B = "127.0.0.2:8998"


@pytest.fixture
def link(request) -> Link:
    lk = make_link()
    request.addfinalizer(lk.close)
    return lk


def accept(lk: Link, room: int = ROOM, addr: str = ADDR, prompt_len: int = PROMPT) -> None:
    lk.receiver.accept(room, f"d-{room}", addr, prompt_len, None)


def kv_done(room: int = ROOM) -> dict:
    return {"t": wire.KV_DONE, "room": room, "prefill_rank": 0, **msgspec.to_builtins(AUX),
            "write": {"bytes": 1, "started_at": 5.0, "finished_at": 5.0, "num_writes": 1}}


# ---- happy path details -----------------------------------------------------------------------
def test_accept_asks_the_resolver_and_watches_the_address(link):
    link.receiver.accept(ROOM, "d-1", ADDR, PROMPT, 1)
    assert link.resolves == [(ADDR, ROOM, 1)]
    assert link.prefills.watched() == {ADDR}
    assert link.receiver.rooms[ROOM].handoff.state is S.BOOTSTRAPPING
    assert link.receiver.poll() == [] and link.pool.calls == []  # nothing reserved before resolution


def test_kv_req_carries_dst_pages_and_compat_facts(link):
    req = link.decode_sends_req()
    assert req["dst_pages"] == [9, 3, 4] and req["prompt_len"] == PROMPT and req["decode_rank"] == 1
    for key in ("page_size", "kv_dtype", "fingerprint", "backend", "layout", "endpoint"):
        assert req[key] == link.d_local[key]
    link.wait_decode_state(ROOM, S.WAITING_FOR_INPUT)


def test_pages_are_reserved_between_two_steps_not_inside_one(link):
    """A Reserve is a round trip: the reserve function runs after the step that asked returned,
    and its answer is the next step (no machine step is ever nested in another)."""
    machine, depth, seen = link.receiver.machine, [0], []
    step = machine.step

    def counted(ev):
        depth[0] += 1
        try:
            return step(ev)
        finally:
            depth[0] -= 1

    machine.step = counted
    pool = link.receiver.reserve
    link.receiver.reserve = lambda rid, n: (seen.append(depth[0]), pool(rid, n))[1]
    link.decode_sends_req()
    assert seen == [0] and link.pool.calls == [(f"d-{ROOM}", PROMPT)]
    link.wait_decode_state(ROOM, S.WAITING_FOR_INPUT)


def test_kv_done_before_the_sent_event_is_handled(link):
    """The prefill can answer before the decode loop saw its own send complete."""
    link.sender.accept(ROOM, "p-1", PROMPT)
    link.sender.prefill_done(ROOM, SRC, AUX)
    accept(link)
    link.prefills.resolved(link.resolved())
    assert link.receiver.poll() == []
    link.to_prefill()
    assert link.prefill_done()[0].ok
    assert link.receiver.rooms[ROOM].handoff.state is S.BOOTSTRAPPING  # "sent" not polled yet
    link.to_decode()
    [ddone] = link.decode_done()
    assert ddone.ok
    assert_pages_landed(link, SRC, [9, 3, 4])
    assert_idle(link)


def test_kv_done_without_first_token_fails(link):
    link.decode_sends_req()
    link.wait_decode_state(ROOM, S.WAITING_FOR_INPUT)
    link.receiver.on_message({}, {"t": wire.KV_DONE, "room": ROOM, "prefill_rank": 0})
    [ddone] = link.decode_done()
    assert not ddone.ok and "first_token" in ddone.reason


@pytest.mark.parametrize("write,error", [
    ({"bytes": "1", "started_at": 5.0, "finished_at": 5.0}, "Expected `int`, got `str` - at `$.write.bytes`"),
    ({"bytes": 1, "started_at": 5.0}, "Object missing required field `finished_at` - at `$.write`"),
])
def test_kv_done_with_a_malformed_write_fails_naming_the_room(link, write, error):
    link.decode_sends_req()
    link.wait_decode_state(ROOM, S.WAITING_FOR_INPUT)
    link.receiver.on_message({}, {**kv_done(), "write": write})
    [ddone] = link.decode_done()
    assert not ddone.ok and ddone.reason.startswith(f"room {ROOM}: prefill {ADDR} sent a bad kv_done: ")
    assert ddone.reason.endswith(error) and ddone.meta["failure_cause"] == "transfer"


def test_kv_done_before_kv_req_is_ignored(link):
    accept(link)
    link.receiver.on_message({}, kv_done())
    assert link.receiver.rooms[ROOM].handoff.state is S.BOOTSTRAPPING
    link.receiver.on_message({}, {"t": wire.KV_DONE, "room": 999})  # unknown room
    assert link.receiver.poll() == []


# ---- resolution, reservation, sending ---------------------------------------------------------
def test_resolution_error_fails_without_contacting_the_prefill(link):
    accept(link)
    link.prefills.resolved(link.resolved(error=f"room {ROOM}: prefill {ADDR}: unreachable"))
    [ddone] = link.receiver.poll()
    assert not ddone.ok and "unreachable" in ddone.reason
    assert link.pool.calls == [] and link.prefill_be.recv(0.05) == []
    assert link.cancels == [(ADDR, ROOM)]
    assert_idle(link)


def test_reserve_none_delays_kv_req_until_pages_free(request):
    lk = make_link(free=[0, 1])  # 2 free pages, the prompt needs 3
    request.addfinalizer(lk.close)
    accept(lk)
    lk.prefills.resolved(lk.resolved())
    for _ in range(3):
        assert lk.receiver.poll() == []
    room = lk.receiver.rooms[ROOM]
    assert len(lk.pool.calls) == 3 and room.state is D.RESERVING and room.reservation is None
    assert lk.prefill_be.recv(0.05) == []  # no kv_req without pages
    lk.pool.free.append(5)  # another request finished
    assert lk.receiver.poll() == []
    [req] = pump(lk.prefill_be, lk.sender.on_message)
    assert req["dst_pages"] == [0, 1, 5]
    lk.sender.accept(ROOM, "p-1", PROMPT)
    lk.sender.prefill_done(ROOM, SRC, AUX)
    assert lk.prefill_done()[0].ok
    lk.to_decode()
    [ddone] = lk.decode_done()
    assert ddone.ok and ddone.meta["prealloc_wait_s"] >= 0
    assert_pages_landed(lk, SRC, [0, 1, 5])


def test_reserve_waits_count_against_the_waiting_timeout(request):
    lk = make_link(free=[])
    request.addfinalizer(lk.close)
    accept(lk)
    lk.prefills.resolved(lk.resolved())
    assert lk.receiver.poll() == []
    t0 = lk.receiver.rooms[ROOM].handoff.created
    [ddone] = lk.receiver.poll(now=t0 + 30.1)
    assert not ddone.ok and "PDSERVE_WAITING_TIMEOUT" in ddone.reason and "bootstrapping" in ddone.reason
    # no pages here, so it is reported at once; the prefill still hears of it and frees its own
    [(_, msg)] = lk.prefill_be.recv(WAIT_S)
    assert msg["t"] == wire.KV_ABORT and "PDSERVE_WAITING_TIMEOUT" in msg["reason"]


def test_kv_req_send_failure_fails_naming_room_and_prefill(link):
    link.decode_be.faults.fail_sends = 1
    accept(link)
    link.prefills.resolved(link.resolved())
    [ddone] = link.decode_done()
    assert not ddone.ok and f"room {ROOM}" in ddone.reason and ADDR in ddone.reason
    assert "injected send failure" in ddone.reason and "dp_rank 0" in ddone.reason


def test_kv_fail_from_prefill_fails_with_its_reason(link):
    link.decode_sends_req()
    link.receiver.on_message({}, {"t": wire.KV_FAIL, "room": ROOM, "prefill_rank": 0,
                                  "reason": "prefill exploded"})
    [ddone] = link.decode_done()
    assert not ddone.ok and "prefill exploded" in ddone.reason and "dp_rank 0" in ddone.reason
    assert f"room {ROOM}" in ddone.reason and ADDR in ddone.reason


# ---- deadlines and aborts ---------------------------------------------------------------------
def test_waiting_timeout_sends_kv_abort_and_prefill_fails_the_room(link):
    link.sender.accept(ROOM, "p-1", PROMPT)  # the prefill never finishes the prompt
    link.deliver_req()
    t = link.receiver.rooms[ROOM].handoff.entered[S.WAITING_FOR_INPUT]
    assert link.receiver.poll(now=t + 29.9) == []
    assert link.receiver.poll(now=t + 30.1) == []  # failed, but its pages wait for the answer
    room = link.receiver.rooms[ROOM]
    assert room.handoff.state is S.FAILED and "PDSERVE_WAITING_TIMEOUT" in room.handoff.reason
    [abort] = link.to_prefill()
    assert abort["t"] == wire.KV_ABORT and abort["decode_rank"] == 1
    [pdone] = link.sender.poll()
    assert not pdone.ok and "PDSERVE_WAITING_TIMEOUT" in pdone.reason
    assert link.to_decode()[0]["t"] == wire.KV_FAIL  # the prefill's answer frees the pages
    [ddone] = link.receiver.poll(now=t + 30.2)
    assert not ddone.ok and ddone.reason == room.handoff.reason
    assert f"room {ROOM}" in ddone.reason and "decode dp_rank 1" in ddone.reason
    assert "prefill 127.0.0.1:8998 dp_rank 0" in ddone.reason
    assert_idle(link)


def test_unanswered_abort_keeps_pages_until_grace(link):
    link.decode_sends_req()  # the prefill drops it: it will never answer
    link.wait_decode_state(ROOM, S.WAITING_FOR_INPUT)
    link.receiver.abort(ROOM, "client went away")
    assert link.receiver.poll() == [] and link.receiver.inflight() == 1
    room = link.receiver.rooms[ROOM]
    assert room.state is D.ABORTING  # kv_abort sent, pages held
    t = room.entered[D.ABORTING]
    assert link.receiver.poll(now=t + 4.9) == []
    [ddone] = link.receiver.poll(now=t + 5.1)  # the client is told; the pages stay quarantined
    assert not ddone.ok and ddone.reason == "client went away"
    assert link.receiver.holds(ROOM) and link.receiver.inflight() == 1 and link.receiver.released() == []
    assert pump(link.prefill_be, lambda s, m: None)[0]["t"] == wire.KV_ABORT


def test_decode_abort_before_resolution(link):
    accept(link)
    link.receiver.abort(ROOM, "client went away")
    [ddone] = link.receiver.poll()
    assert not ddone.ok and ddone.reason == "client went away"
    assert link.cancels == [(ADDR, ROOM)]
    link.prefills.resolved(link.resolved())  # a late answer is dropped
    assert link.receiver.poll() == [] and link.pool.calls == []
    assert link.prefill_be.recv(0.05) == []


def test_decode_abort_while_waiting_for_pages(request):
    lk = make_link(free=[])
    request.addfinalizer(lk.close)
    accept(lk)
    lk.prefills.resolved(lk.resolved())
    assert lk.receiver.poll() == []
    lk.receiver.abort(ROOM, "client went away")
    [ddone] = lk.receiver.poll()  # at once: no pages of ours that a write could reach
    assert not ddone.ok
    [(_, msg)] = lk.prefill_be.recv(WAIT_S)  # the prefill frees its pages now, not at its deadline
    assert msg["t"] == wire.KV_ABORT and msg["reason"] == "client went away"


@pytest.mark.parametrize("prefill_has_request", [False, True])
def test_decode_abort_after_kv_req(link, prefill_has_request):
    if prefill_has_request:
        link.sender.accept(ROOM, "p-1", PROMPT)
    link.deliver_req()
    link.receiver.abort(ROOM, "client went away")
    assert link.receiver.poll() == []  # held until the prefill answers
    [abort] = link.to_prefill()
    assert abort["t"] == wire.KV_ABORT and abort["reason"] == "client went away"
    link.to_decode()
    [ddone] = link.decode_done()
    assert not ddone.ok and ddone.reason == "client went away"
    if not prefill_has_request:
        link.sender.accept(ROOM, "p-1", PROMPT)
    [pdone] = link.sender.poll()
    assert not pdone.ok and "client went away" in pdone.reason
    link.sender.prefill_done(ROOM, SRC, AUX)
    assert link.sender.poll() == [] and not link.d_mem.any()
    assert_idle(link)


def test_abort_after_success_or_unknown_room_is_a_no_op(link):
    link.receiver.abort(424242, "nothing here")
    link.sender.accept(ROOM, "p-1", PROMPT)
    link.deliver_req()
    link.sender.prefill_done(ROOM, SRC, AUX)
    link.to_decode()
    [ddone] = link.decode_done()
    assert ddone.ok
    link.receiver.abort(ROOM, "too late")
    assert link.receiver.poll() == [] and link.prefill_be.recv(0.05) == []


# ---- a prefill server that went away ----------------------------------------------------------
def test_on_gone_fails_only_that_address_rooms(link):
    accept(link, 1, ADDR)
    accept(link, 2, ADDR_B)
    accept(link, 3, ADDR)
    assert link.prefills.watched() == {ADDR, ADDR_B}
    link.prefills.gone(ADDR, "prefill server is gone")
    done = link.receiver.poll()
    assert sorted(d.room for d in done) == [1, 3]
    assert all(not d.ok and "prefill server is gone" in d.reason for d in done)
    assert link.prefills.watched() == {ADDR_B}
    assert link.receiver.rooms[2].handoff.state is S.BOOTSTRAPPING


def test_on_gone_releases_a_room_waiting_for_an_abort_answer(link):
    link.decode_sends_req()
    link.wait_decode_state(ROOM, S.WAITING_FOR_INPUT)
    link.receiver.abort(ROOM, "client went away")
    assert link.receiver.poll() == []
    link.prefills.gone(ADDR, "prefill server is gone")
    [ddone] = link.receiver.poll()
    assert ddone.reason == "client went away"


class StubHealth:
    """A BootstrapClient stand-in for PrefillPeers: per-address instance ids, None = no answer."""

    timeout = 1.0

    def __init__(self, answers: dict[str, str | None]):
        self.answers = answers
        self.calls: list[str] = []

    def health(self, addr: str, *, timeout: float | None = None) -> Health | None:
        self.calls.append(addr)
        inst = self.answers.get(addr)
        return None if inst is None else Health(inst, {})


@pytest.fixture
def heartbeat_of(request):
    def make(client, lk: Link, max_failures: int = 2) -> Heartbeat:
        """A heartbeat over `client` posting into `lk`'s receiver, beaten by hand (`beat_all`)."""
        hb = Heartbeat(PrefillPeers(client), interval=3600.0, max_failures=max_failures,
                       watched=lk.prefills.watched, post=lk.receiver.inbox.post)
        request.addfinalizer(hb.close)
        return hb
    return make


def test_heartbeat_misses_fail_only_the_silent_prefill(link, heartbeat_of):
    client = StubHealth({ADDR: None, ADDR_B: "b-1"})
    hb = heartbeat_of(client, link)
    accept(link, 1, ADDR)
    accept(link, 2, ADDR_B)
    hb.beat_all()
    assert link.receiver.poll() == []  # one miss is not enough
    hb.beat_all()
    [ddone] = link.receiver.poll()
    assert ddone.room == 1 and not ddone.ok
    assert ADDR in ddone.reason and "missed 2 heartbeats" in ddone.reason and "room 1" in ddone.reason
    assert sorted(client.calls) == sorted([ADDR, ADDR_B] * 2)
    hb.beat_all()
    assert client.calls[-1] == ADDR_B  # no rooms left on ADDR: no longer watched
    assert link.receiver.poll() == []


def test_heartbeat_miss_count_resets_on_an_answer(link, heartbeat_of):
    client = StubHealth({ADDR: None})
    hb = heartbeat_of(client, link)
    accept(link)
    hb.beat_all()
    client.answers[ADDR] = "a-1"
    hb.beat_all()
    client.answers[ADDR] = None
    hb.beat_all()
    assert link.receiver.poll() == []


def test_heartbeat_restarted_prefill_fails_its_rooms(link, heartbeat_of):
    client = StubHealth({ADDR: "inst-1"})
    hb = heartbeat_of(client, link)
    accept(link)
    link.prefills.resolved(link.resolved())  # resolved against instance inst-1
    hb.beat_all()
    assert link.receiver.poll() == []
    client.answers[ADDR] = "inst-2"
    hb.beat_all()
    [ddone] = link.decode_done()
    assert not ddone.ok and "restarted (instance inst-1 -> inst-2)" in ddone.reason


def test_heartbeat_after_an_idle_restart_spares_the_new_rooms(link, heartbeat_of):
    """Issue 14 item 4: the prefill restarted while this decode had nothing in flight; a room
    still resolving against the new instance must not be failed as 'restarted'."""
    client = StubHealth({ADDR: "inst-1"})
    hb = heartbeat_of(client, link)
    accept(link, 1)
    link.prefills.resolved(link.resolved(1))
    hb.beat_all()
    link.prefills.gone(ADDR, "done")  # room 1 ends; nothing in flight
    link.decode_done()
    client.answers[ADDR] = "inst-2"  # restarted while idle
    accept(link, 2)  # resolving
    hb.beat_all()
    assert link.receiver.poll() == [] and not link.receiver.rooms[2].handoff.done


def test_heartbeat_thread_beats_on_its_own(link, request):
    client = StubHealth({ADDR: None})
    hb = Heartbeat(PrefillPeers(client), interval=0.01, max_failures=1, watched=link.prefills.watched,
                   post=link.receiver.inbox.post)
    request.addfinalizer(hb.close)
    accept(link)
    [ddone] = link.decode_done()
    assert not ddone.ok and "missed 1 heartbeats" in ddone.reason


# ---- through the real resolver and bootstrap service ------------------------------------------
@pytest.fixture
def bootstrap(request):
    table = BootstrapTable(dp_size=1)
    server = ThreadedBootstrap(table)
    request.addfinalizer(server.stop)
    client = BootstrapClient(timeout=2.0)
    request.addfinalizer(client.close)
    return table, server, client


def test_full_handoff_through_a_prefill_link(request, bootstrap):
    table, server, client = bootstrap
    plink = PrefillLink(LinkSettings(topology_timeout=2.0, query_timeout=2.0, heartbeat_interval=3600.0), client)
    request.addfinalizer(plink.close)
    lk = make_link(prefills=plink)
    request.addfinalizer(lk.close)
    ep = lk.p_local["endpoint"]
    table.register_rank(RankInfo(dp_rank=0, dp_size=1, rank_ip="127.0.0.1", rank_port=ep["port"],
                                 page_size=PAGE_SIZE, kv_cache_dtype="float32",
                                 load_balance_method="auto", fingerprint=FP, endpoint=ep,
                                 transfer_backend="fake"))
    lk.sender.accept(ROOM, "p-1", PROMPT)
    lk.sender.prefill_done(ROOM, SRC, AUX)
    lk.receiver.accept(ROOM, "d-1", server.addr, PROMPT, None)
    deliver_when_resolved(lk)
    assert lk.prefill_done()[0].ok
    lk.to_decode()
    [ddone] = lk.decode_done()
    assert ddone.ok and ddone.meta["dp_rank_path"] == "single" and ddone.meta["prefill_dp_rank"] == 0
    assert ddone.meta["resolve_s"] >= 0
    assert_pages_landed(lk, SRC, [9, 3, 4])
    # a second room, then the prefill's bootstrap service goes away: the heartbeat notices
    hb = plink.heartbeat
    lk.receiver.accept(ROOM + 1, "d-2", server.addr, PROMPT, None)
    deliver_when_resolved(lk)
    hb.beat_all()
    assert lk.receiver.poll() == []
    server.stop()
    hb.beat_all()
    hb.beat_all()
    [gone] = lk.receiver.poll()
    assert not gone.ok and gone.room == ROOM + 1 and server.addr in gone.reason
    assert "prefill server is gone" in gone.reason


def deliver_when_resolved(lk: Link) -> None:
    """Poll the decode until its kv_req reaches the prefill, and hand it over."""
    end = time.monotonic() + WAIT_S
    while True:
        assert lk.receiver.poll() == []
        got = lk.prefill_be.recv(0.01)
        if got:
            break
        assert time.monotonic() < end, "the decode never sent its kv_req"
    for sender, msg in got:
        lk.sender.on_message(sender, msg)
