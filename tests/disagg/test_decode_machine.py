"""The decode side of the handoff as a pure machine (disagg/decode_machine.py), stepped by hand:
no threads, no backend, no clock. Every test feeds events and asserts the effects exactly."""

from __future__ import annotations

import logging

import msgspec
import pytest

from pdserve.core.kv_layout import KVLayout
from pdserve.disagg import wire
from pdserve.disagg.bootstrap_table import RankInfo
from pdserve.disagg.decode_events import (
    Abort,
    CancelResolve,
    DecodeAccept,
    DecodeReport,
    FromPrefill,
    GiveUp,
    Invalidate,
    KvReqSent,
    Log,
    Malformed,
    PagesReserved,
    PeerAlive,
    PeerGone,
    RankResolved,
    Release,
    Reservation,
    Reserve,
    Resolve,
    Resolved,
    SendAbort,
    SendKvReq,
)
from pdserve.disagg.decode_machine import DecodeHandoffs
from pdserve.disagg.decode_rooms import DECODE_TRANSITIONS, DecodeState
from pdserve.disagg.handoff import TRANSITIONS, HandoffDone, HandoffState, IllegalTransition, Side, Tick
from pdserve.disagg.local_facts import LocalFacts
from pdserve.transfer.base import WriteResult

D, H = DecodeState, HandoffState
ADDR, ADDR_B = "10.0.0.1:8998", "10.0.0.9:8998"
ROOM, RID, PROMPT = 77, "d-77", 10
FP = {"architecture": "LlamaForCausalLM", "num_layers": 2}
P_EP = {"backend": "fake", "ip": "10.0.0.1", "port": 9000}  # prefill rank 0
HOLDER_EP = {"backend": "fake", "ip": "10.0.0.3", "port": 9100}  # prefill rank 1
LOCAL = LocalFacts.of("fake", KVLayout(base_ptr=0, num_regions=4, num_pages=16, page_bytes=64, region_stride=1024,
                                       page_size=4, dtype="float32"),
                      FP, {"backend": "fake", "ip": "10.0.0.2", "port": 7000})
PAGES = Reservation([9, 3, 4])
RESOLVED_STAGES = {"topology_lookup": 100.0, "rank_resolution": 100.5}
WAITING_STAGES = {**RESOLVED_STAGES, "preallocation": 200.0, "metadata_sent": 300.0}
DONE = wire.KvDone(room=ROOM, prefill_rank=0, first_token=42, first_logprob=-0.25, prompt_len=PROMPT,
                   write=WriteResult(bytes=4096, started_at=301.0, finished_at=301.5, num_writes=2))


@pytest.fixture
def m() -> DecodeHandoffs:
    return DecodeHandoffs(1, LOCAL, waiting_timeout=30.0, abort_grace=5.0, quarantine=60.0)


def info(rank: int = 0, backend: str = "fake", ep: dict = P_EP) -> RankInfo:
    return RankInfo(dp_rank=rank, dp_size=2, rank_ip=ep["ip"], rank_port=ep["port"], page_size=4,
                    kv_cache_dtype="float32", load_balance_method="auto", fingerprint=FP, endpoint=ep,
                    transfer_backend=backend)


def resolved(room: int = ROOM, rank: int = 0, instance: str = "inst-1", addr: str = ADDR, **kw) -> Resolved:
    kw.setdefault("info", info(rank))
    return Resolved(room, addr, rank, "single", instance_id=instance, seconds=0.5, topology_at=100.0,
                    resolved_at=100.5, **kw)


def kv_req(room: int = ROOM, got: Reservation = PAGES, rank: int = 0, instance: str = "inst-1") -> wire.KvReq:
    return wire.KvReq(room=room, dst_pages=got.pages[got.reused_pages:], prompt_len=PROMPT,
                      layout=LOCAL.layout,
                      endpoint=LOCAL.endpoint, page_size=4, kv_dtype="float32", fingerprint=FP, backend="fake",
                      decode_rank=1, prefill_rank=rank, prefill_instance=instance,
                      reused_pages=got.reused_pages, reused_key=got.reused_key)


def send_abort(reason: str, room: int = ROOM, peer: dict = P_EP) -> SendAbort:
    return SendAbort(room, peer, wire.KvAbort(room=room, reason=reason, decode_rank=1, endpoint=LOCAL.endpoint))


def fin(room: int = ROOM, ok: bool = False, reason: str = "", aux: wire.KvDone | None = None,
        stages: dict | None = None, addr: str = ADDR, held: bool = False, **meta) -> DecodeReport:
    return DecodeReport(HandoffDone(room, f"d-{room}", ok, reason, aux,
                              {"bootstrap_room": room, "decode_dp_rank": 1, **meta}, stages or {}), addr, held)


def resolved_meta(rank: int = 0, path: str = "single") -> dict:
    return {"prefill_dp_rank": rank, "dp_rank_path": path, "resolve_s": 0.5}


def paged_meta(got: Reservation = PAGES, wait: float = 1.0) -> dict:
    return {"prealloc_wait_s": wait, "kv_reused_pages": got.reused_pages,
            "kv_transferred_pages": len(got.pages) - got.reused_pages}


# ---- driving a room to a state (accepted at 0, resolved at 1, pages at 2, sent at 3) ---------
def accept(m: DecodeHandoffs, room: int = ROOM, addr: str = ADDR, hint: int | None = None, now: float = 0.0):
    assert m.step(DecodeAccept(room, f"d-{room}", addr, PROMPT, hint, now=now)) == [Resolve(addr, room, hint)]
    assert m.rooms[room].state is D.RESOLVING


def to_reserving(m: DecodeHandoffs, room: int = ROOM, **kw) -> None:
    accept(m, room, kw.get("addr", ADDR))
    assert m.step(RankResolved(resolved(room, **kw), now=1.0)) == []
    assert m.rooms[room].state is D.RESERVING


def to_sending(m: DecodeHandoffs, room: int = ROOM, got: Reservation = PAGES, **kw) -> None:
    to_reserving(m, room, **kw)
    assert m.step(Tick(now=2.0)) == [Reserve(room, f"d-{room}", PROMPT)]
    r = m.rooms[room]
    assert m.step(PagesReserved(room, got=got, now=2.0, wall=200.0)) == [
        SendKvReq(room, r.resolved, kv_req(room, got, r.resolved.rank, r.resolved.instance_id))]
    assert r.state is D.SENDING


def to_waiting(m: DecodeHandoffs, room: int = ROOM, **kw) -> None:
    to_sending(m, room, **kw)
    assert m.step(KvReqSent(room, 300.0, now=3.0)) == []
    assert m.rooms[room].state is D.WAITING


def to_aborting(m: DecodeHandoffs, reason: str = "client went away", now: float = 4.0) -> None:
    to_waiting(m)
    assert m.step(Abort(ROOM, reason, now=now)) == [CancelResolve(ADDR, ROOM), send_abort(reason)]
    assert m.rooms[ROOM].state is D.ABORTING


DRIVE = {D.RESOLVING: accept, D.RESERVING: to_reserving, D.SENDING: to_sending, D.WAITING: to_waiting}


# ---- the table ------------------------------------------------------------------------------
def test_the_table_refines_the_decode_handoff_table():
    assert set(DECODE_TRANSITIONS) == set(D)
    decode = TRANSITIONS[Side.DECODE]
    for a, targets in DECODE_TRANSITIONS.items():
        for b in targets:
            assert b.phase is a.phase or b.phase in decode[a.phase], (a, b)
    assert {s.phase for s in D} == {s for s, t in decode.items() if t or s.terminal}  # no Transferring
    assert [s for s in D if not DECODE_TRANSITIONS[s]] == [D.DONE, D.FAILED]
    assert DECODE_TRANSITIONS[D.ABORTING] == {D.QUARANTINED, D.FAILED} and D.ABORTING.phase is H.FAILED
    assert DECODE_TRANSITIONS[D.QUARANTINED] == {D.FAILED} and D.QUARANTINED.phase is H.FAILED
    assert [s for s in D if s.live] == [D.RESOLVING, D.RESERVING, D.SENDING, D.WAITING]
    assert [s for s in D if s.holding] == [D.ABORTING, D.QUARANTINED]
    assert not any(s.terminal for s in D if s.holding)  # never reported as freed while holding


def test_an_illegal_move_raises(m):
    accept(m)
    with pytest.raises(IllegalTransition, match="resolving -> done"):
        m.rooms[ROOM].move(D.DONE, 1.0)


# ---- the happy path ---------------------------------------------------------------------------
def test_a_room_from_accept_to_its_report(m):
    assert m.step(DecodeAccept(ROOM, RID, ADDR, PROMPT, 1, now=0.0)) == [Resolve(ADDR, ROOM, 1)]
    assert m.step(Tick(now=0.5)) == []  # nothing is reserved before the resolution
    res = resolved()
    assert m.step(RankResolved(res, now=1.0)) == []
    r = m.rooms[ROOM]
    assert r.state is D.RESERVING and r.resolved is res and r.stages == RESOLVED_STAGES
    assert m.step(Tick(now=2.0)) == [Reserve(ROOM, RID, PROMPT)]
    assert m.step(PagesReserved(ROOM, got=PAGES, now=2.0, wall=200.0)) == [SendKvReq(ROOM, res, kv_req())]
    assert r.state is D.SENDING and r.reservation is PAGES
    assert m.step(Tick(now=2.5)) == []  # no new reservation once it has pages
    assert m.step(KvReqSent(ROOM, 300.0, now=3.0)) == []
    assert r.state is D.WAITING and r.handoff.state is H.WAITING_FOR_INPUT
    assert m.step(FromPrefill(DONE, now=4.0)) == []
    assert r.state is D.DONE and r.handoff.state is H.SUCCESS and r.handoff.done
    stages = {**WAITING_STAGES, "first_kv_byte": 301.0, "last_kv_byte": 301.5}
    assert m.step(Tick(now=4.5)) == [fin(ok=True, aux=DONE, stages=stages,
                                     **resolved_meta(), **paged_meta(), bootstrap_s=3.0, waiting_s=1.0,
                                     kv_bytes=4096, kv_transfer_s=0.5, kv_gbps=4096 / 0.5 / 1e9)]
    assert m.rooms == {}


def test_the_handoff_view_follows_the_room(m):
    to_waiting(m)
    h = m.rooms[ROOM].handoff
    assert (h.side, h.state, h.created, h.done) == (Side.DECODE, H.WAITING_FOR_INPUT, 0.0, False)
    assert h.entered == {H.BOOTSTRAPPING: 0.0, H.WAITING_FOR_INPUT: 3.0}
    m.step(Abort(ROOM, "gone", now=4.0))
    h = m.rooms[ROOM].handoff
    assert (h.state, h.reason, h.done) == (H.FAILED, "gone", True)  # aborting is failed for the handoff
    m.step(Tick(now=10.0))  # grace passed: reported, pages held
    assert m.rooms[ROOM].state is D.QUARANTINED and m.rooms[ROOM].handoff.state is H.FAILED
    m.step(FromPrefill(wire.KvFail(room=ROOM, prefill_rank=0, reason="aborted"), now=11.0))
    assert m.step(Tick(now=11.0)) == [Release(ROOM, RID, ADDR)] and m.rooms == {}


def test_kv_done_before_the_sent_event(m):
    """The prefill can answer before our own send job reported back."""
    to_sending(m)
    assert m.step(FromPrefill(DONE, now=3.0)) == []
    r = m.rooms[ROOM]
    assert r.state is D.DONE and r.entered[D.WAITING] == r.entered[D.DONE] == 3.0
    assert m.step(KvReqSent(ROOM, 300.0, now=3.5)) == []  # late: only its stage is kept
    assert r.state is D.DONE and r.stages["metadata_sent"] == 300.0
    [f] = m.step(Tick(now=4.0))
    assert f.done.ok and f.done.meta["bootstrap_s"] == 3.0 and f.done.meta["waiting_s"] == 0.0
    assert m.step(KvReqSent(ROOM, 300.0, now=4.5)) == []  # reported: unknown now


def test_reported_before_the_sent_event_still_has_its_metadata_stage(m):
    """kv_done and the report can both beat the send job's event: the issue time stands in."""
    to_sending(m)
    m.step(FromPrefill(DONE, now=3.0))
    [f] = m.step(Tick(now=3.0))
    assert f.done.ok and f.done.stages["metadata_sent"] == f.done.stages["preallocation"] == 200.0
    assert m.step(KvReqSent(ROOM, 300.0, now=3.5)) == []  # reported: unknown now


@pytest.mark.parametrize("state", [D.RESOLVING, D.RESERVING])
def test_kv_done_before_the_kv_req_is_ignored(m, state):
    DRIVE[state](m)
    assert m.step(FromPrefill(DONE, now=1.5)) == [
        Log(logging.WARNING, f"decode dp_rank 1: kv_done for room {ROOM} before its kv_req; ignored", ROOM)]
    assert m.rooms[ROOM].state is state


def test_messages_for_unknown_rooms_are_ignored(m):
    assert m.step(FromPrefill(DONE, now=0.0)) == []
    assert m.step(Malformed(ROOM, wire.KV_DONE, "bad", now=0.0)) == []
    assert m.step(KvReqSent(ROOM, 1.0, error="x", now=1.0)) == []
    assert m.step(PagesReserved(ROOM, got=PAGES, now=1.0, wall=1.0)) == []
    assert m.step(RankResolved(resolved(), now=1.0)) == []
    assert m.step(Abort(ROOM, "x", now=1.0)) == []


def test_same_events_same_effects():
    def run() -> list:
        m = DecodeHandoffs(1, LOCAL, waiting_timeout=30.0)
        evs = [DecodeAccept(ROOM, RID, ADDR, PROMPT, None, now=0.0), RankResolved(resolved(), now=1.0),
               Tick(now=2.0),
               PagesReserved(ROOM, got=PAGES, now=2.0, wall=200.0), KvReqSent(ROOM, 300.0, now=3.0),
               FromPrefill(DONE, now=4.0), Tick(now=5.0)]
        return [m.step(e) for e in evs]
    assert run() == run()


# ---- resolution -----------------------------------------------------------------------------
def test_a_resolution_error_fails_without_contacting_the_prefill(m):
    accept(m)
    err = Resolved(ROOM, ADDR, error=f"room {ROOM}: prefill {ADDR}: unreachable")
    assert m.step(RankResolved(err, now=1.0)) == [CancelResolve(ADDR, ROOM)]
    assert m.rooms[ROOM].state is D.FAILED
    assert m.step(Tick(now=1.5)) == [fin(reason=err.error, failure_cause="resolve")]


def test_a_backend_mismatch_gives_the_room_up_at_the_bootstrap_service(m):
    accept(m)
    reason = (f"room {ROOM}: prefill {ADDR} dp_rank 0 uses transfer backend 'tcp', this decode (dp_rank 1) "
              "uses 'fake': start both with the same --transfer-backend")
    assert m.step(RankResolved(resolved(info=info(backend="tcp")), now=1.0)) == [
        CancelResolve(ADDR, ROOM), GiveUp(ADDR, ROOM, reason)]
    assert m.step(Tick(now=1.5)) == [fin(reason=reason, failure_cause="incompatible")]


def test_a_late_resolution_of_an_aborted_room_is_dropped(m):
    accept(m)
    assert m.step(Abort(ROOM, "client went away", now=0.5)) == [
        CancelResolve(ADDR, ROOM), GiveUp(ADDR, ROOM, "client went away")]
    assert m.step(RankResolved(resolved(), now=1.0)) == []
    assert m.step(Tick(now=1.5)) == [fin(reason="client went away", failure_cause="aborted")]


# ---- reservation ----------------------------------------------------------------------------
def test_reservation_is_retried_every_tick_while_the_pool_is_full(m):
    to_reserving(m)
    for t in (2.0, 3.0, 4.0):
        assert m.step(Tick(now=t)) == [Reserve(ROOM, RID, PROMPT)]
        assert m.step(PagesReserved(ROOM, now=t, wall=100.0 + t)) == []
        assert m.rooms[ROOM].state is D.RESERVING and m.rooms[ROOM].reservation is None
    assert m.step(Tick(now=5.0)) == [Reserve(ROOM, RID, PROMPT)]
    assert m.step(PagesReserved(ROOM, got=PAGES, now=5.0, wall=205.0)) == [SendKvReq(ROOM, resolved(), kv_req())]
    assert m.rooms[ROOM].state is D.SENDING and m.step(Tick(now=6.0)) == []


def test_prealloc_wait_counts_from_the_resolution(m):
    to_reserving(m)
    m.step(Tick(now=2.0))
    m.step(PagesReserved(ROOM, now=2.0, wall=200.0))
    m.step(Tick(now=4.5))
    m.step(PagesReserved(ROOM, got=PAGES, now=4.5, wall=204.5))
    m.step(FromPrefill(DONE, now=5.0))
    [f] = m.step(Tick(now=5.0))
    assert f.done.meta["prealloc_wait_s"] == 3.5 and f.done.stages["preallocation"] == 204.5


def test_a_reserve_error_fails_and_tells_the_prefill(m):
    to_reserving(m)
    m.step(Tick(now=2.0))
    reason = f"room {ROOM}: decode dp_rank 1 cannot reserve pages: prompt needs 3 pages, the pool has 2"
    assert m.step(PagesReserved(ROOM, error="prompt needs 3 pages, the pool has 2", now=2.0, wall=200.0)) == [
        CancelResolve(ADDR, ROOM), send_abort(reason),
        fin(reason=reason, failure_cause="no_pages", stages=RESOLVED_STAGES, **resolved_meta())]
    assert m.rooms == {}


def test_a_room_without_an_endpoint_is_given_up_at_the_bootstrap_service(m):
    to_reserving(m, info=None)
    m.step(Tick(now=2.0))
    reason = f"room {ROOM}: decode dp_rank 1 cannot reserve pages: no"
    assert m.step(PagesReserved(ROOM, error="no", now=2.0, wall=200.0))[:2] == [
        CancelResolve(ADDR, ROOM), GiveUp(ADDR, ROOM, reason)]


def test_decode_side_reuse_fields_in_the_kv_req_and_meta(m):
    got = Reservation([11, 3, 4], 1, "k-1")
    to_waiting(m, got=got)  # asserts the KvReq: dst_pages [3, 4], reused_pages 1, reused_key "k-1"
    assert kv_req(got=got).dst_pages == [3, 4]
    m.step(FromPrefill(DONE, now=4.0))
    [f] = m.step(Tick(now=4.0))
    assert f.done.meta["kv_reused_pages"] == 1 and f.done.meta["kv_transferred_pages"] == 2


def test_a_prompt_held_whole_asks_for_no_pages(m):
    got = Reservation([11, 12], 2, "k-2")
    to_sending(m, got=got)  # asserts the KvReq
    assert kv_req(got=got).dst_pages == [] and m.rooms[ROOM].reservation is got


# ---- deadlines --------------------------------------------------------------------------------
def timeout_reason(phase: str, rank: int | None) -> str:
    return (f"room {ROOM}: decode dp_rank 1 waited 30s in {phase} for prefill {ADDR} dp_rank {rank} "
            "(PDSERVE_WAITING_TIMEOUT)")


def test_waiting_timeout_while_resolving(m):
    accept(m)
    assert m.step(Tick(now=30.0)) == []
    reason = timeout_reason("bootstrapping", None)
    assert m.step(Tick(now=30.1)) == [CancelResolve(ADDR, ROOM), GiveUp(ADDR, ROOM, reason),
                                  fin(reason=reason, failure_cause="timeout")]


def test_waiting_timeout_while_reserving_counts_from_accept(m):
    to_reserving(m)
    assert m.step(Tick(now=30.0)) == [Reserve(ROOM, RID, PROMPT)]
    assert m.step(PagesReserved(ROOM, now=30.0, wall=130.0)) == []
    assert m.step(Tick(now=30.1)) == [Reserve(ROOM, RID, PROMPT)]  # the attempt first, then the deadline
    reason = timeout_reason("bootstrapping", 0)
    assert m.step(PagesReserved(ROOM, now=30.1, wall=130.1)) == [  # no pages of ours: reported at once
        CancelResolve(ADDR, ROOM), send_abort(reason),
        fin(reason=reason, failure_cause="timeout", stages=RESOLVED_STAGES, **resolved_meta())]


def test_pages_got_on_the_deadline_tick_are_held_for_the_abort(m):
    to_reserving(m)
    m.step(Tick(now=30.1))
    reason = timeout_reason("bootstrapping", 0)
    assert m.step(PagesReserved(ROOM, got=PAGES, now=30.1, wall=130.1)) == [
        SendKvReq(ROOM, resolved(), kv_req()), CancelResolve(ADDR, ROOM), send_abort(reason)]
    assert m.rooms[ROOM].state is D.ABORTING


def test_waiting_timeout_while_sending(m):
    to_sending(m)
    assert m.step(Tick(now=30.0)) == []
    reason = timeout_reason("bootstrapping", 0)
    assert m.step(Tick(now=30.1)) == [CancelResolve(ADDR, ROOM), send_abort(reason)]
    assert m.rooms[ROOM].state is D.ABORTING and m.rooms[ROOM].entered[D.ABORTING] == 30.1


def test_waiting_timeout_while_waiting_counts_from_the_send(m):
    to_waiting(m)
    assert m.step(Tick(now=33.0)) == []
    reason = timeout_reason("waiting_for_input", 0)
    assert m.step(Tick(now=33.1)) == [CancelResolve(ADDR, ROOM), send_abort(reason)]
    assert m.rooms[ROOM].state is D.ABORTING
    assert m.step(FromPrefill(wire.KvFail(room=ROOM, prefill_rank=0, reason="aborted"), now=33.2)) == []
    assert m.step(Tick(now=33.3)) == [fin(reason=reason, failure_cause="timeout", stages=WAITING_STAGES,
                                      **resolved_meta(), **paged_meta(), bootstrap_s=3.0, waiting_s=33.1 - 3.0)]


# ---- sending --------------------------------------------------------------------------------
def test_a_send_failure_invalidates_the_address_and_fails(m):
    to_sending(m)
    err = f"room {ROOM}: sending metadata to prefill {ADDR} dp_rank 0 failed: injected"
    assert m.step(KvReqSent(ROOM, 300.0, error=err, now=3.0)) == [Invalidate(ADDR), CancelResolve(ADDR, ROOM)]
    assert m.rooms[ROOM].state is D.FAILED  # the kv_req never arrived: nothing to wait for
    assert m.step(Tick(now=3.0)) == [fin(reason=err, failure_cause="transfer", stages=WAITING_STAGES,
                                     **resolved_meta(), **paged_meta())]


def test_a_send_result_after_the_room_failed_is_only_a_stage(m):
    to_sending(m)
    m.step(Abort(ROOM, "client went away", now=2.5))
    assert m.step(KvReqSent(ROOM, 310.0, now=3.0)) == []  # it left: the prefill may write
    assert m.rooms[ROOM].state is D.ABORTING and m.rooms[ROOM].stages["metadata_sent"] == 310.0


def test_a_send_error_after_the_room_failed_frees_it_at_once(m):
    """The kv_req never left: no write can land, so the pages need not wait for an answer."""
    to_sending(m)
    m.step(Abort(ROOM, "client went away", now=2.5))
    assert m.step(KvReqSent(ROOM, 310.0, error="late", now=3.0)) == []
    assert m.rooms[ROOM].state is D.FAILED and m.rooms[ROOM].stages["metadata_sent"] == 310.0
    [f] = m.step(Tick(now=3.0))
    assert not f.held and f.done.reason == "client went away"


# ---- what the prefill says --------------------------------------------------------------------
@pytest.mark.parametrize("state", [D.RESOLVING, D.RESERVING, D.SENDING, D.WAITING])
def test_kv_fail_fails_the_room_with_its_reason_and_cause(m, state):
    DRIVE[state](m)
    msg = wire.KvFail(room=ROOM, prefill_rank=0, reason="prefix hash mismatch", cause="incompatible")
    assert m.step(FromPrefill(msg, now=5.0)) == [CancelResolve(ADDR, ROOM)]  # no kv_abort: it knows
    r = m.rooms[ROOM]
    assert r.state is D.FAILED and r.cause.value == "incompatible"
    assert r.reason == f"room {ROOM}: prefill {ADDR} dp_rank 0 failed it: prefix hash mismatch"


def test_a_bad_kv_done_fails_the_room(m):
    to_waiting(m)
    err = f"malformed 'kv_done' control message for room {ROOM}: Object missing required field `first_token`"
    assert m.step(Malformed(ROOM, wire.KV_DONE, err, now=4.0)) == [CancelResolve(ADDR, ROOM)]
    r = m.rooms[ROOM]
    assert r.state is D.FAILED and r.reason == f"room {ROOM}: prefill {ADDR} sent a bad kv_done: {err}"
    assert r.cause.value == "transfer"


def test_other_malformed_messages_are_logged_and_dropped(m):
    to_waiting(m)
    assert m.step(Malformed(ROOM, wire.KV_FAIL, "bad fail", now=4.0)) == [
        Log(logging.WARNING, "decode dp_rank 1: bad fail; ignored", ROOM)]
    assert m.step(Abort(ROOM, "x", now=4.5))[0] == CancelResolve(ADDR, ROOM)
    assert m.step(Malformed(ROOM, wire.KV_DONE, "bad done", now=5.0)) == [  # already failed
        Log(logging.WARNING, "decode dp_rank 1: bad done; ignored", ROOM)]
    assert m.rooms[ROOM].state is D.ABORTING


def test_kv_moved_points_the_room_at_the_holder(m):
    to_waiting(m)
    assert m.step(FromPrefill(wire.KvMoved(room=ROOM, prefill_rank=1, endpoint=HOLDER_EP), now=3.5)) == []
    res = m.rooms[ROOM].resolved
    assert (res.rank, res.info.dp_rank, res.info.endpoint) == (1, 1, HOLDER_EP)
    assert (res.info.rank_ip, res.info.rank_port, res.path) == ("10.0.0.3", 9100, "single")
    assert m.step(Abort(ROOM, "client left", now=4.0)) == [  # the abort goes to the holder
        CancelResolve(ADDR, ROOM), send_abort("client left", peer=HOLDER_EP)]


def test_kv_moved_before_the_resolution_or_after_failing_is_ignored(m):
    accept(m)
    moved = wire.KvMoved(room=ROOM, prefill_rank=1, endpoint=HOLDER_EP)
    assert m.step(FromPrefill(moved, now=0.5)) == [] and m.rooms[ROOM].resolved is None
    m.step(RankResolved(resolved(), now=1.0))
    m.step(Abort(ROOM, "x", now=1.5))
    assert m.step(FromPrefill(moved, now=2.0)) == [] and m.rooms[ROOM].resolved.rank == 0


def test_an_answer_from_another_rank_names_the_holder(m):
    to_waiting(m)
    assert m.step(FromPrefill(msgspec.structs.replace(DONE, prefill_rank=1), now=4.0)) == []
    [f] = m.step(Tick(now=4.0))
    assert f.done.ok and f.done.meta["prefill_dp_rank"] == 1


# ---- aborts -----------------------------------------------------------------------------------
def test_abort_while_resolving_gives_up_at_the_bootstrap_service(m):
    accept(m)
    assert m.step(Abort(ROOM, "client went away", now=0.5)) == [
        CancelResolve(ADDR, ROOM), GiveUp(ADDR, ROOM, "client went away")]
    assert m.step(Tick(now=0.5)) == [fin(reason="client went away", failure_cause="aborted")]


def test_abort_while_reserving_tells_the_rank_and_is_reported_at_once(m):
    to_reserving(m)
    assert m.step(Abort(ROOM, "client went away", now=1.5)) == [
        CancelResolve(ADDR, ROOM), send_abort("client went away")]
    assert m.rooms[ROOM].state is D.FAILED  # no pages a write could reach
    assert m.step(Tick(now=1.5)) == [fin(reason="client went away", failure_cause="aborted",
                                     stages=RESOLVED_STAGES, **resolved_meta())]


@pytest.mark.parametrize("state", [D.SENDING, D.WAITING])
@pytest.mark.parametrize("answer", [wire.KvFail(room=ROOM, prefill_rank=0, reason="aborted", cause="aborted"),
                                    DONE])
def test_abort_with_pages_holds_them_until_the_prefill_answers(m, state, answer):
    DRIVE[state](m)
    assert m.step(Abort(ROOM, "client went away", now=4.0)) == [
        CancelResolve(ADDR, ROOM), send_abort("client went away")]
    assert m.rooms[ROOM].state is D.ABORTING
    assert m.step(Tick(now=8.0)) == []  # a write may still land
    assert m.step(Abort(ROOM, "again", now=8.5)) == []
    assert m.step(FromPrefill(answer, now=9.0)) == []  # either answer: no write follows it
    r = m.rooms[ROOM]
    assert r.state is D.FAILED and r.reason == "client went away" and r.aux is None
    [f] = m.step(Tick(now=9.0))
    assert not f.done.ok and f.done.reason == "client went away" and f.done.meta["failure_cause"] == "aborted"
    if state is D.WAITING:
        assert f.done.meta["waiting_s"] == 1.0  # until it failed, not until the answer


def test_an_unanswered_abort_tells_the_client_after_the_grace_and_keeps_the_pages(m):
    to_aborting(m, now=4.0)
    assert m.step(Tick(now=9.0)) == []
    assert m.step(Tick(now=9.1)) == [
        Log(logging.INFO, f"decode dp_rank 1: prefill {ADDR} never answered kv_abort of room {ROOM} in 5s; "
                          "its pages stay quarantined", ROOM),
        fin(reason="client went away", failure_cause="aborted", stages=WAITING_STAGES, **resolved_meta(),
            **paged_meta(), bootstrap_s=3.0, waiting_s=1.0, held=True)]
    assert m.rooms[ROOM].state is D.QUARANTINED  # a slow write may still land
    assert m.step(Tick(now=60.0)) == []
    assert m.step(FromPrefill(DONE, now=61.0)) == []  # the write ended: no client to give it to
    assert m.step(Tick(now=61.0)) == [Release(ROOM, RID, ADDR)] and m.rooms == {}


def test_abort_after_done_or_failed_is_a_no_op(m):
    to_waiting(m)
    m.step(FromPrefill(DONE, now=4.0))
    assert m.step(Abort(ROOM, "too late", now=4.5)) == [] and m.rooms[ROOM].state is D.DONE
    to_reserving(m, 78)
    m.step(FromPrefill(wire.KvFail(room=78, reason="no"), now=5.0))
    assert m.step(Abort(78, "too late", now=5.5)) == [] and m.rooms[78].state is D.FAILED


# ---- prefill servers gone or restarted --------------------------------------------------------
def test_gone_fails_every_live_room_of_that_address(m):
    accept(m, 1)
    accept(m, 2, ADDR_B)
    to_waiting(m, 3)
    assert m.step(PeerGone(ADDR, "prefill server is gone", None, now=5.0)) == [
        CancelResolve(ADDR, 1), CancelResolve(ADDR, 3)]
    assert m.rooms[1].reason == "room 1: prefill server is gone"
    assert m.rooms[3].reason == "room 3 (prefill dp_rank 0): prefill server is gone"
    assert m.rooms[3].state is D.QUARANTINED  # an unheard prefill may be cut off, not dead
    assert m.rooms[2].state is D.RESOLVING
    assert [(f.done.room, f.held) for f in m.step(Tick(now=5.0))] == [(1, False), (3, True)]


def test_gone_ranks_fail_only_rooms_resolved_to_them(m):
    to_reserving(m, 1, rank=0)
    to_reserving(m, 2, rank=1)
    accept(m, 3)  # still resolving: its own lookup will find the rank gone
    reason = f"prefill {ADDR} dp_rank 1 is gone: died"
    assert m.step(PeerGone(ADDR, reason, frozenset({1}), now=5.0)) == [CancelResolve(ADDR, 2)]
    assert m.rooms[2].reason == f"room 2 (prefill dp_rank 1): {reason}" and m.rooms[2].cause.value == "peer_gone"
    assert [r.state for r in m.rooms.values()] == [D.RESERVING, D.FAILED, D.RESOLVING]


def test_gone_releases_an_aborting_room_of_that_rank_only(m):
    to_aborting(m)
    assert m.step(PeerGone(ADDR, "rank 1 died", frozenset({1}), now=5.0)) == []
    assert m.rooms[ROOM].state is D.ABORTING
    assert m.step(PeerGone(ADDR_B, "gone", None, now=5.0)) == []
    assert m.rooms[ROOM].state is D.ABORTING
    assert m.step(PeerGone(ADDR, "rank 0 died", frozenset({0}), now=5.5)) == []
    assert m.rooms[ROOM].state is D.FAILED and m.rooms[ROOM].reason == "client went away"


def test_a_restart_fails_only_rooms_resolved_against_another_instance(m):
    to_waiting(m, 2, instance="old")
    to_reserving(m, 1, instance="new")
    accept(m, 3)  # resolving: its resolution sees the new instance
    to_reserving(m, 4, instance="")  # the instance was not known: nothing to compare
    to_reserving(m, 5, instance="old", addr=ADDR_B)
    assert m.step(PeerAlive(ADDR, "new", now=5.0)) == [CancelResolve(ADDR, 2)]
    assert m.rooms[2].reason == (f"room 2 (prefill dp_rank 0): prefill server at {ADDR} restarted "
                                 "(instance old -> new); its rooms are lost")
    assert m.rooms[2].state is D.FAILED and m.rooms[2].cause.value == "peer_gone"
    assert [m.rooms[r].state for r in (1, 3, 4, 5)] == [D.RESERVING, D.RESOLVING, D.RESERVING, D.RESERVING]


def test_the_same_instance_is_no_news(m):
    to_waiting(m, instance="inst-1")
    assert m.step(PeerAlive(ADDR, "inst-1", now=5.0)) == [] and m.rooms[ROOM].state is D.WAITING


def test_a_restart_releases_an_aborting_room_of_the_old_instance(m):
    to_aborting(m)
    assert m.step(PeerAlive(ADDR, "inst-1", now=5.0)) == [] and m.rooms[ROOM].state is D.ABORTING
    assert m.step(PeerAlive(ADDR, "inst-2", now=5.5)) == []  # that instance writes nothing more
    assert m.rooms[ROOM].state is D.FAILED and m.rooms[ROOM].reason == "client went away"
    assert m.step(Tick(now=5.5))[0].done.meta["failure_cause"] == "aborted"


# ---- quarantine: an unheard prefill may still write ------------------------------------------
GONE = "prefill bootstrap 10.0.0.1:8998 missed 2 heartbeats (0.5s apart): prefill server is gone"
GONE_REASON = f"room {ROOM} (prefill dp_rank 0): {GONE}"


def to_quarantined(m: DecodeHandoffs, state: DecodeState = D.WAITING, now: float = 5.0) -> None:
    """`state` at 0..3, then its prefill unheard at `now`: the client is told, the pages stay."""
    if state is D.ABORTING:
        to_aborting(m)
        assert m.step(PeerGone(ADDR, GONE, None, now=now)) == []
    else:
        DRIVE[state](m)
        assert m.step(PeerGone(ADDR, GONE, None, now=now)) == [CancelResolve(ADDR, ROOM)]
    r = m.rooms[ROOM]
    assert r.state is D.QUARANTINED and r.entered[D.QUARANTINED] == now
    [f] = m.step(Tick(now=now))  # the client's answer at once
    assert f.held and not f.done.ok and f.addr == ADDR
    assert f.done.reason == ("client went away" if state is D.ABORTING else GONE_REASON)
    assert f.done.meta["failure_cause"] == ("aborted" if state is D.ABORTING else "peer_gone")
    assert m.rooms[ROOM] is r and m.quarantined() == 1  # its pages are still held
    assert m.step(Tick(now=now + 1.0)) == []  # reported once


@pytest.mark.parametrize("state", [D.SENDING, D.WAITING, D.ABORTING])
def test_an_unheard_prefill_fails_the_client_at_once_and_quarantines_the_pages(m, state):
    to_quarantined(m, state)
    assert m.step(Abort(ROOM, "client left", now=6.5)) == []  # not live: nothing more to fail
    assert m.step(Malformed(ROOM, wire.KV_DONE, "bad", now=6.6)) == [
        Log(logging.WARNING, "decode dp_rank 1: bad; ignored", ROOM)]
    assert m.step(Tick(now=64.9)) == [] and m.rooms[ROOM].state is D.QUARANTINED


def test_the_quarantined_reports_name_the_room_like_any_failure(m):
    to_waiting(m)
    m.step(PeerGone(ADDR, GONE, None, now=5.0))
    assert m.step(Tick(now=5.0)) == [fin(reason=GONE_REASON, failure_cause="peer_gone", stages=WAITING_STAGES,
                                     **resolved_meta(), **paged_meta(), bootstrap_s=3.0, waiting_s=2.0,
                                     held=True)]


@pytest.mark.parametrize("state", [D.RESOLVING, D.RESERVING])
def test_an_unheard_prefill_frees_rooms_that_sent_no_kv_req_at_once(m, state):
    DRIVE[state](m)
    assert m.step(PeerGone(ADDR, GONE, None, now=5.0)) == [CancelResolve(ADDR, ROOM)]
    assert m.rooms[ROOM].state is D.FAILED
    [f] = m.step(Tick(now=5.0))
    assert not f.held and m.rooms == {}


EXITS = {  # how a quarantined room learns that nothing more can land in its pages
    "kv_done": FromPrefill(DONE, now=7.0),  # the healed prefill finished the write
    "kv_fail": FromPrefill(wire.KvFail(room=ROOM, prefill_rank=0, reason="aborted", cause="aborted"), now=7.0),
    "another instance": PeerAlive(ADDR, "inst-2", now=7.0),  # the old process is gone
    "its rank died": PeerGone(ADDR, "prefill dp_rank 0 is gone: died", frozenset({0}), now=7.0),
}


@pytest.mark.parametrize("state", [D.SENDING, D.WAITING, D.ABORTING])
@pytest.mark.parametrize("exit_", list(EXITS))
def test_every_exit_from_quarantine_releases_the_pages_once(m, state, exit_):
    to_quarantined(m, state)
    assert m.step(EXITS[exit_]) == []
    r = m.rooms[ROOM]
    assert r.state is D.FAILED and r.aux is None  # a late kv_done is no success: its client was told
    assert m.step(Tick(now=7.5)) == [Release(ROOM, RID, ADDR)]
    assert m.rooms == {} and m.quarantined() == 0
    assert m.step(Tick(now=8.0)) == [] and m.step(EXITS[exit_]) == []


def test_a_quarantined_send_that_failed_frees_at_once(m):
    """Quarantined while its kv_req send was out: that send failing proves it never left."""
    to_quarantined(m, D.SENDING)
    assert m.step(KvReqSent(ROOM, 300.0, now=6.0, error="connect timed out")) == []
    assert m.step(Tick(now=6.0)) == [Release(ROOM, RID, ADDR)]


def test_a_quarantined_send_that_succeeded_stays(m):
    to_quarantined(m, D.SENDING)
    assert m.step(KvReqSent(ROOM, 300.0, now=6.0)) == []
    assert m.rooms[ROOM].state is D.QUARANTINED and m.step(Tick(now=6.0)) == []


def test_other_ranks_and_addresses_leave_a_quarantined_room_alone(m):
    to_quarantined(m)
    assert m.step(PeerGone(ADDR, "rank 1 died", frozenset({1}), now=6.0)) == []
    assert m.step(PeerGone(ADDR_B, "gone", None, now=6.0)) == []
    assert m.step(PeerAlive(ADDR_B, "inst-9", now=6.0)) == []
    assert m.step(FromPrefill(wire.KvFail(room=ROOM + 1, reason="x"), now=6.0)) == []
    assert m.rooms[ROOM].state is D.QUARANTINED and m.step(Tick(now=6.0)) == []


def test_the_same_instance_back_is_asked_with_a_kv_abort_and_answers(m):
    to_quarantined(m)
    assert m.step(PeerAlive(ADDR, "inst-1", now=6.0)) == [send_abort(GONE_REASON)]  # the link healed
    assert m.step(PeerAlive(ADDR, "inst-1", now=6.5)) == []  # asked once while it is heard
    assert m.step(Tick(now=6.5)) == [] and m.rooms[ROOM].state is D.QUARANTINED  # still waiting
    assert m.step(PeerGone(ADDR, GONE, None, now=7.0)) == []  # unheard again: that abort may be lost
    assert m.step(PeerAlive(ADDR, "inst-1", now=8.0)) == [send_abort(GONE_REASON)]
    assert m.step(FromPrefill(wire.KvFail(room=ROOM, prefill_rank=0, reason="aborted"), now=8.5)) == []
    assert m.step(Tick(now=8.5)) == [Release(ROOM, RID, ADDR)]


def test_a_quarantined_abort_goes_to_the_holder_rank(m):
    to_waiting(m)
    m.step(FromPrefill(wire.KvMoved(room=ROOM, prefill_rank=1, endpoint=HOLDER_EP), now=3.5))
    m.step(PeerGone(ADDR, GONE, None, now=5.0))
    m.step(Tick(now=5.0))
    reason = f"room {ROOM} (prefill dp_rank 1): {GONE}"
    assert m.step(PeerAlive(ADDR, "inst-1", now=6.0)) == [send_abort(reason, peer=HOLDER_EP)]


def test_the_quarantine_deadline_releases_the_pages_with_a_warning(m):
    to_quarantined(m, now=5.0)
    assert m.step(Tick(now=65.0)) == []
    assert m.step(Tick(now=65.1)) == [
        Log(logging.WARNING, f"decode dp_rank 1: room {ROOM} (prefill {ADDR} dp_rank 0, peer_gone: {GONE_REASON}): "
                             "no word from the prefill in 60s of quarantine; its pages are released "
                             "(PDSERVE_KV_QUARANTINE_TIMEOUT)", ROOM),
        Release(ROOM, RID, ADDR)]
    assert m.rooms == {}


def test_an_aborting_room_unheard_tells_its_client_without_waiting_for_the_grace(m):
    to_aborting(m, now=4.0)
    m.step(PeerGone(ADDR, GONE, None, now=4.5))
    [f] = m.step(Tick(now=4.5))  # not 9.0: no answer can come while it is unheard
    assert f.held and f.done.reason == "client went away"
    assert m.step(Tick(now=64.5)) == []  # the quarantine counts from 4.5
    assert m.step(Tick(now=64.6))[-1] == Release(ROOM, RID, ADDR)
