"""Zero-round-trip rendezvous for any prefill DP method, step by step: a decode sends its KvReq
to the room's home rank (room % dp_size); the front told the home where the room went
(RoomRoutedNotice -> PrefillSender.room_routed); the home forwards the KvReq and later aborts
to the holder and tells the decode (KvMoved). Also the instance check of a KvReq (a prefill
that restarted since the decode resolved refuses at once). Three FakeBackends on one
FakeFabric, no processes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from pdserve.core.failures import FailureCause
from pdserve.disagg import wire
from pdserve.disagg.bootstrap_table import RankInfo
from pdserve.disagg.decode_events import Resolved
from pdserve.disagg.handoff import HandoffState
from pdserve.disagg.kv_receiver import DecodeReceiver, ReceiverLimits
from pdserve.disagg.kv_sender import PrefillSender
from pdserve.disagg.local_facts import LocalFacts
from pdserve.transfer.fake import FakeBackend, FakeFabric
from tests.harness.handoff_harness import (
    AUX,
    FP,
    PAGE_SIZE,
    PROMPT,
    SRC,
    FakePrefillLink,
    PagePool,
    make_memory,
    pages_of,
    poll_until,
    pump,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_stray_threads")]
S = HandoffState
ADDR = "127.0.0.1:8998"
ROOM = 10  # home: rank 0 of 2
HOLDER = 1


@dataclass
class Trio:
    home_be: FakeBackend
    holder_be: FakeBackend
    decode_be: FakeBackend
    home: PrefillSender
    holder: PrefillSender
    receiver: DecodeReceiver
    prefills: FakePrefillLink
    holder_mem: np.ndarray
    decode_mem: np.ndarray
    holder_ep: dict
    pool: PagePool

    def resolved(self, room: int = ROOM, instance: str = "inst-1") -> Resolved:
        """What the decode's resolver answers on the forward path: the home rank's endpoint."""
        ep = self.home_be.endpoint
        info = RankInfo(dp_rank=room % 2, dp_size=2, rank_ip=ep["ip"], rank_port=ep["port"], page_size=PAGE_SIZE,
                        kv_cache_dtype="float32", load_balance_method="round_robin", fingerprint=FP,
                        endpoint=ep, transfer_backend="fake")
        return Resolved(room, ADDR, room % 2, "forward", info, instance)

    def decode_sends(self, room: int = ROOM, instance: str = "inst-1") -> None:
        self.receiver.accept(room, f"d-{room}", ADDR, PROMPT, None)
        self.prefills.resolved(self.resolved(room, instance))
        assert self.receiver.poll() == []

    def to_home(self, n: int = 1) -> list[dict]:
        return pump(self.home_be, self.home.on_message, n)

    def to_holder(self, n: int = 1) -> list[dict]:
        return pump(self.holder_be, self.holder.on_message, n)

    def to_decode(self, n: int = 1) -> list[dict]:
        return pump(self.decode_be, self.receiver.on_message, n)

    def close(self) -> None:
        for x in (self.home, self.holder, self.receiver):
            x.close(wait=True)
        for be in (self.home_be, self.holder_be, self.decode_be):
            be.close()


@pytest.fixture
def trio(request) -> Trio:
    fabric = FakeFabric()
    mems = [make_memory(seed=7), make_memory(seed=8), make_memory(seed=None)]
    bes = [FakeBackend(fabric) for _ in mems]
    eps = [be.start(layout) for be, (_, layout) in zip(bes, mems)]
    local = [LocalFacts.of("fake", layout, FP, ep) for (_, layout), ep in zip(mems, eps)]
    home = PrefillSender(bes[0], 0, local[0], bootstrap_timeout=30.0, instance_id="inst-1")
    holder = PrefillSender(bes[1], HOLDER, local[1], bootstrap_timeout=30.0, instance_id="inst-1")
    pool = PagePool([9, 3, 4, 12, 13, 14])
    prefills = FakePrefillLink()
    receiver = DecodeReceiver(bes[2], 0, local[2], link=prefills, reserve=pool,
                              limits=ReceiverLimits(waiting_timeout=30.0, abort_grace=5.0))
    t = Trio(bes[0], bes[1], bes[2], home, holder, receiver, prefills, mems[1][0], mems[2][0], eps[1], pool)
    request.addfinalizer(t.close)
    return t


def holder_prefills(t: Trio) -> None:
    t.holder.accept(ROOM, "p-1", PROMPT)
    t.holder.prefill_done(ROOM, SRC, AUX)


def assert_success(t: Trio) -> None:
    [pdone] = poll_until(t.holder.poll)
    assert pdone.ok and pdone.meta["kv_req_forwarded_by"] == 0
    [done_msg] = t.to_decode()
    assert done_msg["t"] == wire.KV_DONE and done_msg["prefill_rank"] == HOLDER
    [ddone] = poll_until(t.receiver.poll)
    assert ddone.ok and ddone.meta["prefill_dp_rank"] == HOLDER and ddone.meta["dp_rank_path"] == "forward"
    dst = t.pool.held[f"d-{ROOM}"]
    for s, d in zip(SRC, dst):
        assert np.array_equal(pages_of(t.decode_mem)[:, d], pages_of(t.holder_mem)[:, s])
    assert t.home.inflight() == 0 and not t.home.early and t.holder.inflight() == 0


@pytest.mark.parametrize("order", ["route_first", "kv_req_first"])
def test_a_kv_req_at_the_home_reaches_the_holder(trio, order):
    if order == "route_first":
        trio.home.room_routed(ROOM, HOLDER, trio.holder_ep)
        trio.decode_sends()
        trio.to_home()
    else:
        trio.decode_sends()
        trio.to_home()
        assert ROOM in trio.home.early  # the front has not said where the room went yet
        trio.home.room_routed(ROOM, HOLDER, trio.holder_ep)
    [fwd] = trio.to_holder()
    assert fwd["t"] == wire.KV_REQ and fwd["forwarded_by"] == 0
    [moved] = trio.to_decode()
    assert moved["t"] == wire.KV_MOVED and moved["prefill_rank"] == HOLDER
    assert trio.receiver.rooms[ROOM].resolved.rank == HOLDER  # aborts now go straight there
    holder_prefills(trio)
    assert_success(trio)


def test_a_decode_abort_at_the_home_is_forwarded_and_answered_by_the_holder(trio):
    trio.home.room_routed(ROOM, HOLDER, trio.holder_ep)
    holder_prefills(trio)
    trio.decode_sends()
    trio.to_home()
    trio.to_holder()
    abort = wire.to_wire(wire.KvAbort(room=ROOM, reason="client left", decode_rank=0,
                                      endpoint=trio.decode_be.endpoint))
    trio.home.on_message(trio.decode_be.endpoint, abort)
    [fwd_abort] = trio.to_holder()
    assert fwd_abort["t"] == wire.KV_ABORT
    [pdone] = poll_until(trio.holder.poll)
    assert not pdone.ok and "client left" in pdone.reason
    msgs = trio.to_decode(2)  # KvMoved, then the holder's answer (the transfer may have won)
    assert {m["t"] for m in msgs} <= {wire.KV_MOVED, wire.KV_FAIL, wire.KV_DONE}


def test_an_unreachable_holder_fails_the_decode_at_once(trio):
    gone = {**trio.holder_ep, "port": 1, "instance": "nobody"}
    trio.home.room_routed(ROOM, HOLDER, gone)
    trio.decode_sends()
    trio.to_home()
    [fail] = trio.to_decode()
    assert fail["t"] == wire.KV_FAIL and "could not forward" in fail["reason"]
    [ddone] = poll_until(trio.receiver.poll)
    assert not ddone.ok and f"room {ROOM}" in ddone.reason


def test_a_room_the_decode_gave_up_at_the_home_is_freed_on_the_holder(trio):
    trio.decode_sends()
    trio.to_home()
    abort = wire.to_wire(wire.KvAbort(room=ROOM, reason="client left", decode_rank=0,
                                      endpoint=trio.decode_be.endpoint))
    trio.home.on_message(trio.decode_be.endpoint, abort)  # before the front's notice
    trio.to_decode()  # the home answers the decode
    holder_prefills(trio)
    trio.home.room_routed(ROOM, HOLDER, trio.holder_ep)
    trio.to_holder()  # the home passes the abort on
    [pdone] = poll_until(trio.holder.poll)
    assert not pdone.ok and "client left" in pdone.reason  # its pages are released by the role


def test_a_kv_req_resolved_against_another_instance_is_refused_at_once(trio):
    """Issue 14 item 5: the prefill restarted since the decode resolved; the new worker does not
    hold the room and will never get it, so it must not wait for its bootstrap deadline."""
    trio.receiver.accept(ROOM, "d-1", ADDR, PROMPT, None)
    res = trio.resolved(instance="inst-0")
    ep = trio.holder_be.endpoint  # address the holder directly this time
    info = RankInfo(dp_rank=HOLDER, dp_size=2, rank_ip=ep["ip"], rank_port=ep["port"], page_size=PAGE_SIZE,
                    kv_cache_dtype="float32", load_balance_method="follow_bootstrap_room", fingerprint=FP,
                    endpoint=ep, transfer_backend="fake")
    trio.prefills.resolved(Resolved(ROOM, ADDR, HOLDER, "fast", info, res.instance_id))
    assert trio.receiver.poll() == []
    trio.to_holder()
    assert ROOM not in trio.holder.early
    [fail] = trio.to_decode()
    assert fail["t"] == wire.KV_FAIL and fail["cause"] == FailureCause.PEER_GONE.value
    assert "instance inst-0" in fail["reason"] and "restarted" in fail["reason"]
