"""The prefill handoff machine (disagg/prefill_machine.py) stepped by hand: no threads, no
backend, no clock. Every step's effects are asserted exactly (types and fields); times are the
ones the events carry."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from pdserve.core.failures import FailureCause
from pdserve.core.kv_layout import KVLayout
from pdserve.core.page_keys import prefix_key
from pdserve.disagg import wire
from pdserve.disagg.handoff import TRANSITIONS as HANDOFF_TRANSITIONS
from pdserve.disagg.handoff import HandoffDone, HandoffState, IllegalTransition, Side, Tick
from pdserve.disagg.local_facts import LocalFacts
from pdserve.disagg.prefill_events import (
    Drop,
    Fail,
    FromDecode,
    Malformed,
    MarkFailed,
    PrefillAccept,
    PrefillDone,
    PrefillFacts,
    PrefillReport,
    RoomRouted,
    Send,
    StartWrite,
    WriteReturned,
)
from pdserve.disagg.prefill_machine import PrefillHandoffs
from pdserve.disagg.prefill_rooms import TRANSITIONS, RoomState
from pdserve.transfer.base import WriteResult

R = RoomState
C = FailureCause
FP = {"architecture": "LlamaForCausalLM", "num_layers": 2, "num_kv_heads": 2, "head_dim": 4}
LOCAL = LocalFacts.of("fake", KVLayout(base_ptr=0, num_regions=4, num_pages=16, page_bytes=64, region_stride=1024,
                                       page_size=4, dtype="float32"),
                      FP, {"backend": "fake", "ip": "10.0.0.1", "port": 7000})
DEC = {"backend": "fake", "ip": "10.0.0.2", "port": 7001}  # the decode's endpoint
OTHER = {"backend": "fake", "ip": "10.0.0.9", "port": 7009}  # some other sender
HOLDER = {"backend": "fake", "ip": "10.0.0.3", "port": 7002}  # the rank that holds a forwarded room
LAYOUT = KVLayout(base_ptr=0, num_regions=4, num_pages=16, page_bytes=64, region_stride=1024, page_size=4,
                  dtype="float32")  # the decode's
ROOM, PROMPT = 7, 10  # 10 tokens -> 3 pages of 4
IDS = list(range(100, 110))
SRC, DST = [1, 2, 5], [9, 3, 4]
AUX = PrefillFacts(first_token=42, first_logprob=-0.25, input_logprobs=None, prompt_len=PROMPT)
DONE = wire.KvDone(room=ROOM, prefill_rank=0, first_token=42, first_logprob=-0.25, prompt_len=PROMPT)
FACTS = WriteResult(bytes=3072, started_at=1103.5, finished_at=1104.0, num_writes=3)
T0 = 100.0
WALL = 1000.0  # wall = WALL + now in every event here
ABORTED_BY_DECODE = f"room {ROOM}: decode dp_rank 1 aborted it: client went away"
CONFLICT = "follow_bootstrap_room conflict: dispatched to dp_rank 1 but bootstrap_room 7 implies dp_rank 0."


# ---- helpers ----------------------------------------------------------------------------------
def machine(**kw) -> PrefillHandoffs:
    return PrefillHandoffs(0, LOCAL, **{"bootstrap_timeout": 30.0, "failed_ttl": 600.0, "instance_id": "inst-1",
                                        **kw})


def at(t: float) -> dict:
    return {"now": t, "wall": WALL + t}


def kv_req(**kw) -> wire.KvReq:
    fields = dict(room=ROOM, dst_pages=list(DST), prompt_len=PROMPT, layout=LAYOUT, endpoint=DEC, page_size=4,
                  kv_dtype="float32", fingerprint=FP, backend="fake", decode_rank=1, prefill_rank=0,
                  prefill_instance="inst-1")
    return wire.KvReq(**{**fields, **kw})


def kv_abort(endpoint: dict | None = DEC) -> wire.KvAbort:
    return wire.KvAbort(room=ROOM, reason="client went away", decode_rank=1, endpoint=endpoint)


def kv_fail(reason: str, cause: FailureCause, peer: dict = DEC, room: int = ROOM) -> Send:
    return Send(peer, wire.KvFail(room=room, prefill_rank=0, reason=reason, cause=cause.value))


def write(src=SRC, dst=DST, done=DONE) -> StartWrite:
    return StartWrite(ROOM, DEC, LAYOUT, list(src), list(dst), done)


def accept(m, t=T0, prompt_len=PROMPT, ids=IDS, room=ROOM):
    return m.step(PrefillAccept(room, "p-1", prompt_len, ids, **at(t)))


def prefilled(m, t=T0, pages=SRC, aux=AUX, room=ROOM):
    return m.step(PrefillDone(room, list(pages), aux, **at(t)))


def deliver(m, msg=None, t=T0, sender=DEC):
    return m.step(FromDecode(sender, kv_req() if msg is None else msg, **at(t)))


def abort(m, t=T0, sender=DEC, endpoint: dict | None = DEC):
    return m.step(FromDecode(sender, kv_abort(endpoint), **at(t)))


def returned(m, t=T0, error=None, facts=FACTS):
    return m.step(WriteReturned(ROOM, error, facts if error is None else None, **at(t)))


def tick(m, t=T0):
    return m.step(Tick(**at(t)))


def state(m, room=ROOM) -> RoomState:
    return m.rooms[room].state


def report(effects) -> HandoffDone:
    [eff] = effects
    assert isinstance(eff, PrefillReport)
    return eff.done


def drive(m, to: RoomState, t=T0) -> None:
    """Accept ROOM and step it to `to` by legal events only."""
    if to is R.FAILING:
        drive(m, R.TRANSFERRING, t)
        assert m.step(Fail(ROOM, "prefill request aborted", **at(t))) == []
    elif to is R.FAILED_UNHEARD:
        drive(m, R.PREFILLED, t)
        assert m.step(Fail(ROOM, "prefill request aborted", **at(t))) == []
    elif to is R.SUCCESS:
        drive(m, R.TRANSFERRING, t)
        assert returned(m, t) == []
    else:
        assert accept(m, t) == []
        if to in (R.PREFILLED, R.TRANSFERRING):
            assert prefilled(m, t) == []
        if to in (R.WAITING_FOR_INPUT, R.TRANSFERRING):
            assert deliver(m, t=t) == ([write()] if to is R.TRANSFERRING else [])
    assert state(m) is to


# ---- the table --------------------------------------------------------------------------------
def test_the_table_covers_every_state_and_only_moves_forward():
    assert set(TRANSITIONS) == set(RoomState)
    for s in (R.SUCCESS, R.FAILED, R.DROPPED):
        assert TRANSITIONS[s] == frozenset()
    handoff_moves = HANDOFF_TRANSITIONS[Side.PREFILL]
    order = [HandoffState.BOOTSTRAPPING, HandoffState.WAITING_FOR_INPUT, HandoffState.TRANSFERRING]
    for a, targets in TRANSITIONS.items():
        for b in targets:
            ha, hb = a.handoff, b.handoff
            # the reporting Handoff follows: the same state, one legal move, or a forward path
            assert ha == hb or hb in handoff_moves[ha] or (ha in order and hb in order
                                                           and order.index(ha) < order.index(hb)), (a, b)
    seen, todo = {R.BOOTSTRAPPING}, [R.BOOTSTRAPPING]
    while todo:
        for b in TRANSITIONS[todo.pop()] - seen:
            seen.add(b)
            todo.append(b)
    assert seen == set(RoomState), "every state is reachable"


@pytest.mark.parametrize("a,b", [(a, b) for a, b in itertools.product(RoomState, RoomState)
                                 if b not in TRANSITIONS[a]])
def test_every_move_outside_the_table_raises(a, b):
    m = machine()
    assert accept(m) == []
    r = m.rooms[ROOM]
    r.state = a  # placed there directly: only the table check is under test
    with pytest.raises(IllegalTransition, match=f"illegal move {a.value} -> {b.value}"):
        r.move(b, T0)
    assert r.state is a


def test_a_write_returning_with_no_write_out_raises():
    m = machine()
    drive(m, R.PREFILLED)
    with pytest.raises(IllegalTransition, match="has none out"):
        returned(m)
    assert state(m) is R.PREFILLED
    assert machine().step(WriteReturned(ROOM, None, FACTS)) == []  # an unknown room: nothing


def test_a_second_write_result_raises():
    m = machine()
    drive(m, R.SUCCESS)
    with pytest.raises(IllegalTransition):
        returned(m)


def test_not_an_event_raises():
    with pytest.raises(TypeError, match="not a prefill handoff event"):
        machine().step(object())


# ---- happy paths ------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["req_first", "request_first", "prefilled_first"])
def test_happy_path_in_each_order(order):
    m = machine()
    if order == "req_first":
        assert deliver(m, t=T0 - 1) == []
        assert m.notes.early[ROOM].req == kv_req() and m.notes.early[ROOM].since == T0 - 1 and not m.rooms
        assert accept(m) == [] and state(m) is R.WAITING_FOR_INPUT and not m.notes.early
        assert prefilled(m, T0 + 1) == [write()]
    elif order == "request_first":
        assert accept(m) == [] and state(m) is R.BOOTSTRAPPING
        assert deliver(m, t=T0 + 1) == [] and state(m) is R.WAITING_FOR_INPUT
        assert prefilled(m, T0 + 2) == [write()]
    else:
        assert accept(m) == []
        assert prefilled(m, T0 + 1) == [] and state(m) is R.PREFILLED
        assert m.rooms[ROOM].handoff.state is HandoffState.BOOTSTRAPPING
        assert deliver(m, t=T0 + 2) == [write()]
    assert state(m) is R.TRANSFERRING and m.rooms[ROOM].handoff.state is HandoffState.TRANSFERRING
    assert returned(m, T0 + 3) == [] and state(m) is R.SUCCESS
    done = report(tick(m, T0 + 4))
    assert done.ok and done.room == ROOM and done.rid == "p-1" and done.reason == "" and not done.dropped
    assert done.aux == AUX and done.meta["kv_bytes"] == FACTS.bytes
    assert not m.rooms and not m.notes.doomed and not m.notes.early
    assert tick(m, T0 + 5) == []


def test_a_success_reports_its_meta_and_stages():
    m = machine()
    accept(m, T0)
    deliver(m, t=T0 + 1)
    prefilled(m, T0 + 3)
    returned(m, T0 + 4)
    assert tick(m, T0 + 4.5)[0].done.meta == {
        "prefill_bootstrapping_s": 1.0, "prefill_waiting_for_input_s": 2.0, "prefill_transferring_s": 1.0,
        "prefill_total_s": 4.0, "bootstrap_room": ROOM, "prefill_dp_rank": 0, "decode_dp_rank": 1,
        "kv_bytes": 3072, "kv_transfer_s": 0.5, "kv_gbps": 3072 / 0.5 / 1e9}
    m2 = machine()
    accept(m2, T0)
    deliver(m2, t=T0 + 1)
    prefilled(m2, T0 + 3)
    returned(m2, T0 + 4)
    assert report(tick(m2, T0 + 5)).stages == {"metadata_received": WALL + T0 + 1, "prefill_done": WALL + T0 + 3,
                                               "first_kv_byte": 1103.5, "last_kv_byte": 1104.0}


def test_a_kv_req_finding_the_prefill_done_passes_waiting_for_input_at_once():
    m = machine()
    accept(m, T0)
    prefilled(m, T0 + 1)
    deliver(m, t=T0 + 3)
    assert m.rooms[ROOM].handoff.entered == {HandoffState.BOOTSTRAPPING: T0, HandoffState.WAITING_FOR_INPUT: T0 + 3,
                                             HandoffState.TRANSFERRING: T0 + 3}
    returned(m, T0 + 4)
    meta = report(tick(m, T0 + 5)).meta
    assert (meta["prefill_bootstrapping_s"], meta["prefill_waiting_for_input_s"], meta["prefill_transferring_s"],
            meta["prefill_total_s"]) == (3.0, 0.0, 1.0, 4.0)


def test_a_prefill_done_for_an_unknown_room_is_ignored():
    m = machine()
    assert prefilled(m) == [] and not m.rooms


def test_a_prompt_the_decode_holds_whole_writes_no_pages():
    m = machine()
    ids = IDS[:8]
    accept(m, prompt_len=8, ids=ids)
    req = kv_req(dst_pages=[], prompt_len=8, reused_pages=2, reused_key=prefix_key(ids, 4, 2))
    assert deliver(m, req) == []
    done = wire.KvDone(room=ROOM, prefill_rank=0, first_token=42, prompt_len=8)
    assert prefilled(m, pages=SRC[:2], aux=PrefillFacts(first_token=42, prompt_len=8)) == [write([], [], done)]


def test_reused_pages_are_not_written():
    m = machine()
    accept(m)
    assert deliver(m, kv_req(dst_pages=[3, 4], reused_pages=1, reused_key=prefix_key(IDS, 4, 1))) == []
    assert prefilled(m) == [write(SRC[1:], [3, 4])]


def test_steps_are_deterministic():
    def script():
        m, out = machine(), []
        out += deliver(m, t=T0 - 1)
        out += accept(m)
        out += prefilled(m, T0 + 2)
        out += returned(m, T0 + 3)
        out += tick(m, T0 + 4)
        return out
    assert script() == script()


# ---- failures on the prefill: fail() ----------------------------------------------------------
@pytest.mark.parametrize("start,to", [(R.BOOTSTRAPPING, R.FAILED_UNHEARD), (R.PREFILLED, R.FAILED_UNHEARD),
                                      (R.WAITING_FOR_INPUT, R.FAILED), (R.TRANSFERRING, R.FAILING)])
def test_fail_in_each_live_state(start, to):
    m = machine()
    drive(m, start)
    why = f"room {ROOM}: prefill request aborted (client gone)"
    told = [kv_fail(why, C.ABORTED)] if start is R.WAITING_FOR_INPUT else []  # only a decode that spoke
    assert m.step(Fail(ROOM, why, **at(T0 + 1))) == told
    assert state(m) is to and m.rooms[ROOM].handoff.state is HandoffState.FAILED
    if to is R.FAILING:  # a write still reads the pages: kept, even past every deadline
        assert tick(m, T0 + 1000) == [] and state(m) is R.FAILING
        assert returned(m, T0 + 1001) == [] and state(m) is R.FAILED
    done = report(tick(m, T0 + 1002))
    assert not done.ok and done.reason == why and done.meta["failure_cause"] == "aborted"
    assert done.meta["prefill_total_s"] == 1.0  # until it failed, not until its write returned
    assert m.notes.doomed[ROOM].reason == why and m.notes.doomed[ROOM].since == T0 + 1002  # a late KvReq fails at once


@pytest.mark.parametrize("end", [R.SUCCESS, R.FAILED_UNHEARD, R.FAILING])
def test_fail_after_the_end_changes_nothing(end):
    m = machine()
    drive(m, end)
    before = m.rooms[ROOM].reason
    assert m.step(Fail(ROOM, "later", **at(T0 + 1))) == []
    assert m.step(MarkFailed(ROOM, "later", **at(T0 + 1))) == []
    assert state(m) is end and m.rooms[ROOM].reason == before


def test_a_prefill_done_after_a_failure_is_recorded_not_acted_on():
    m = machine()
    accept(m)
    m.step(Fail(ROOM, "aborted", **at(T0)))
    assert prefilled(m, T0 + 1) == [] and state(m) is R.FAILED_UNHEARD
    assert m.rooms[ROOM].pages == SRC
    assert report(tick(m, T0 + 2)).aux == AUX


def test_a_prefill_without_a_first_token_fails_instead_of_writing():
    m = machine()
    drive(m, R.WAITING_FOR_INPUT)
    why = (f"room {ROOM}: KV transfer from prefill dp_rank 0 to decode fake://10.0.0.2:7001 failed: "
           "Missing required argument 'first_token'")
    assert prefilled(m, aux=PrefillFacts(first_token=None, prompt_len=PROMPT)) == [kv_fail(why, C.TRANSFER)]
    assert state(m) is R.FAILED


# ---- failures on the prefill: the write -------------------------------------------------------
def test_a_write_failure_fails_the_room_and_tells_the_decode():
    m = machine()
    drive(m, R.TRANSFERRING)
    why = f"room {ROOM}: KV transfer from prefill dp_rank 0 to decode fake://10.0.0.2:7001 failed: boom"
    assert returned(m, error="boom") == [kv_fail(why, C.TRANSFER)]
    assert state(m) is R.FAILED
    done = report(tick(m))
    assert not done.ok and done.reason == why and done.meta["failure_cause"] == "transfer"
    assert "kv_bytes" not in done.meta and "first_kv_byte" not in done.stages


@pytest.mark.parametrize("outcome", ["ok", "error"])
def test_a_write_returning_after_an_abort(outcome):
    m = machine()
    drive(m, R.TRANSFERRING)
    assert abort(m) == [] and state(m) is R.FAILING  # not answered yet: a write may still land
    if outcome == "ok":  # its KvDone went out: that is the decode's answer
        assert returned(m) == []
    else:  # the first reason and cause win
        assert returned(m, error="boom") == [kv_fail(ABORTED_BY_DECODE, C.ABORTED)]
    assert state(m) is R.FAILED
    done = report(tick(m))
    assert not done.ok and done.reason == ABORTED_BY_DECODE
    assert ("kv_bytes" in done.meta) == (outcome == "ok")


# ---- the decode's KvAbort, in each state ------------------------------------------------------
@pytest.mark.parametrize("where", ["unknown", "queued", R.BOOTSTRAPPING, R.PREFILLED, R.WAITING_FOR_INPUT,
                                   R.TRANSFERRING, R.FAILING, R.SUCCESS, R.FAILED_UNHEARD])
def test_a_decode_abort_in_each_state(where):
    """Always answered (KvFail now, or the write's KvDone / KvFail once it returns)."""
    m = machine()
    if where == "queued":
        deliver(m)
    elif where != "unknown":
        drive(m, where)
    # the abort names no endpoint and comes from OTHER: the answer goes to the best-known peer
    effects = abort(m, T0 + 1, sender=OTHER, endpoint=None)
    if where in ("unknown", "queued"):
        assert effects == [kv_fail(ABORTED_BY_DECODE, C.ABORTED, DEC if where == "queued" else OTHER)]
        assert not m.notes.early and m.notes.doomed[ROOM].reason == ABORTED_BY_DECODE
        assert accept(m, T0 + 2) == [] and state(m) is R.FAILED_UNHEARD  # the request after it: fails
        assert m.rooms[ROOM].reason == ABORTED_BY_DECODE
    elif where in (R.BOOTSTRAPPING, R.PREFILLED):
        assert effects == [kv_fail(ABORTED_BY_DECODE, C.ABORTED, OTHER)]
        assert state(m) is R.FAILED and m.rooms[ROOM].peer == OTHER
        assert deliver(m) == []  # its KvReq overtaken by the abort: nothing more
    elif where is R.WAITING_FOR_INPUT:
        assert effects == [kv_fail(ABORTED_BY_DECODE, C.ABORTED)] and state(m) is R.FAILED
    elif where is R.TRANSFERRING:
        assert effects == [] and state(m) is R.FAILING
    elif where is R.FAILING:
        assert effects == [] and m.rooms[ROOM].reason == "prefill request aborted"
    elif where is R.SUCCESS:  # ended, not yet reported: answered again (its KvDone went out before)
        assert effects == [kv_fail(ABORTED_BY_DECODE, C.INTERNAL)] and state(m) is R.SUCCESS
    else:  # failed before its decode spoke: the answer goes to the abort's sender
        assert effects == [kv_fail("prefill request aborted", C.ABORTED, OTHER)]
        assert state(m) is R.FAILED_UNHEARD


def test_an_abort_naming_an_endpoint_is_answered_there():
    """A forwarded abort comes from the home rank; the answer goes to the decode it names."""
    m = machine()
    drive(m, R.PREFILLED)
    assert abort(m, sender=OTHER, endpoint=DEC) == [kv_fail(ABORTED_BY_DECODE, C.ABORTED, DEC)]


# ---- deadlines --------------------------------------------------------------------------------
@pytest.mark.parametrize("start,what", [(R.BOOTSTRAPPING, "the decode's metadata (kv_req)"),
                                        (R.PREFILLED, "the decode's metadata (kv_req)"),
                                        (R.WAITING_FOR_INPUT, "the prefill to finish"),
                                        (R.TRANSFERRING, "the KV write")])
def test_the_bootstrap_deadline(start, what):
    m = machine()
    drive(m, start)
    assert tick(m, T0 + 30.0) == [] and state(m) is start
    why = f"room {ROOM}: prefill dp_rank 0 waited 30s for {what} (PDSERVE_BOOTSTRAP_TIMEOUT)"
    effects = tick(m, T0 + 30.5)
    if start is R.TRANSFERRING:  # the decode hears when the write returns
        assert effects == [] and state(m) is R.FAILING and m.rooms[ROOM].cause is C.TIMEOUT
        return
    told = [kv_fail(why, C.TIMEOUT)] if start is R.WAITING_FOR_INPUT else []
    assert effects[:-1] == told
    done = report(effects[-1:])
    assert not done.ok and done.reason == why and done.meta["failure_cause"] == "timeout"
    assert done.meta["prefill_total_s"] == 30.5


def test_a_queued_kv_req_expires_and_dooms_the_room():
    m = machine()
    deliver(m, t=T0)
    assert tick(m, T0 + 30.0) == [] and ROOM in m.notes.early
    why = f"room {ROOM}: prefill dp_rank 0 never received its request within 30s (PDSERVE_BOOTSTRAP_TIMEOUT)"
    assert tick(m, T0 + 30.5) == [kv_fail(why, C.TIMEOUT)]
    assert not m.notes.early and m.notes.doomed[ROOM].reason == why
    assert accept(m, T0 + 31) == [] and state(m) is R.FAILED_UNHEARD  # too late: fails at once
    done = report(tick(m, T0 + 31))
    assert not done.ok and done.reason == why


def test_doomed_and_dropped_notes_last_failed_ttl():
    m = machine()
    m.step(MarkFailed(ROOM, CONFLICT, **at(T0)))
    m.step(Drop(ROOM + 1, "local prefill", **at(T0)))
    assert tick(m, T0 + 600.0) == [] and ROOM in m.notes.doomed and ROOM + 1 in m.notes.dropped
    assert tick(m, T0 + 600.5) == [] and not m.notes.doomed and not m.notes.dropped
    assert accept(m, T0 + 601) == [] and state(m) is R.BOOTSTRAPPING  # a fresh start
    assert accept(m, T0 + 601, room=ROOM + 1) == [] and state(m, ROOM + 1) is R.BOOTSTRAPPING


def test_routes_and_forwards_last_the_bootstrap_deadline():
    m = machine()
    m.step(RoomRouted(ROOM, 1, HOLDER, **at(T0)))
    deliver(m, t=T0)
    assert ROOM in m.notes.routes and ROOM in m.notes.forwarded
    assert tick(m, T0 + 30.0) == [] and ROOM in m.notes.routes
    assert tick(m, T0 + 30.5) == [] and not m.notes.routes and not m.notes.forwarded


# ---- rooms the front failed -------------------------------------------------------------------
@pytest.mark.parametrize("when", ["before_kv_req", "after_kv_req"])
def test_a_room_marked_failed_refuses_its_kv_req(when):
    m = machine()
    if when == "before_kv_req":
        assert m.step(MarkFailed(ROOM, CONFLICT, **at(T0))) == []
        assert deliver(m) == [kv_fail(CONFLICT, C.CONFLICT)]
    else:
        assert deliver(m) == []
        assert m.step(MarkFailed(ROOM, CONFLICT, **at(T0))) == [kv_fail(CONFLICT, C.CONFLICT)]
    assert not m.notes.early and m.notes.doomed[ROOM].cause is C.CONFLICT
    assert accept(m, T0 + 1) == [] and state(m) is R.FAILED_UNHEARD
    assert report(tick(m, T0 + 1)).reason == CONFLICT


@pytest.mark.parametrize("start", [R.PREFILLED, R.WAITING_FOR_INPUT])
def test_a_room_in_progress_marked_failed_ends_now(start):
    m = machine()
    drive(m, start)
    gave_up = f"the decode side gave up the room: room {ROOM}: other transfer backend"
    told = [kv_fail(gave_up, C.REJECTED)] if start is R.WAITING_FOR_INPUT else []
    assert m.step(MarkFailed(ROOM, gave_up, **at(T0))) == told
    done = report(tick(m))
    assert not done.ok and done.reason == gave_up and done.meta["failure_cause"] == "rejected"


def test_a_failed_unreaped_room_answers_its_kv_req_once():
    m = machine()
    drive(m, R.FAILED_UNHEARD)
    assert deliver(m) == [kv_fail("prefill request aborted", C.ABORTED)]
    assert state(m) is R.FAILED and m.rooms[ROOM].peer == DEC
    assert deliver(m) == []  # a duplicate now


# ---- KvReqs that cannot be served -------------------------------------------------------------
@pytest.mark.parametrize("when", ["before_request", "after_request"])
def test_an_incompatible_kv_req_fails_naming_both_values(when):
    m = machine()
    why = (f"room {ROOM}: decode dp_rank 1 cannot use prefill dp_rank 0: kv_dtype mismatch: prefill has "
           "'float32', decode has 'bfloat16'")
    if when == "after_request":
        accept(m)
    assert deliver(m, kv_req(kv_dtype="bfloat16")) == [kv_fail(why, C.INCOMPATIBLE)]
    if when == "before_request":  # remembered: the request fails at once
        assert not m.notes.early and m.notes.doomed[ROOM].reason == why
        assert accept(m) == [] and state(m) is R.FAILED_UNHEARD
    else:
        assert state(m) is R.FAILED
    assert report(tick(m)).reason == why


def malformed(m, room=ROOM, kind=wire.KV_REQ, error="Expected `int`, got `str` - at `$.prompt_len`",
              endpoint: dict | None = DEC, t=T0):
    return m.step(Malformed(room, kind, error, endpoint, **at(t)))


@pytest.mark.parametrize("when", ["before_request", "after_request"])
def test_a_kv_req_that_does_not_parse_is_refused_naming_the_room(when):
    """Answered at once (KvFail to the endpoint it names), not dropped for the decode to time out."""
    m = machine()
    why = (f"room {ROOM}: prefill dp_rank 0 cannot read the decode's kv_req: Expected `int`, got `str` - "
           "at `$.prompt_len`")
    if when == "after_request":
        accept(m)
    assert malformed(m) == [kv_fail(why, C.INCOMPATIBLE)]
    if when == "before_request":  # remembered: the request fails at once
        assert m.notes.doomed[ROOM].reason == why
        assert accept(m) == [] and state(m) is R.FAILED_UNHEARD
    else:
        assert state(m) is R.FAILED and m.rooms[ROOM].cause is C.INCOMPATIBLE
    assert report(tick(m)).reason == why


def test_a_malformed_kv_req_of_a_routed_room_tells_the_holder_too():
    m = machine()
    m.step(RoomRouted(ROOM, 1, HOLDER, **at(T0)))
    why = f"room {ROOM}: prefill dp_rank 0 cannot read the decode's kv_req: bad"
    assert malformed(m, error="bad") == [Send(HOLDER, wire.KvAbort(room=ROOM, reason=why)),
                                         kv_fail(why, C.INCOMPATIBLE)]


def test_only_a_kv_req_naming_room_and_endpoint_is_answered_when_it_does_not_parse():
    m = machine()
    accept(m)
    assert malformed(m, kind=wire.KV_ABORT) == [] and malformed(m, room=None) == []
    assert malformed(m, endpoint=None) == []
    assert state(m) is R.BOOTSTRAPPING and not m.notes.doomed
    deliver(m)  # the room has its decode: a malformed duplicate changes nothing
    assert malformed(m) == [] and state(m) is R.WAITING_FOR_INPUT


def test_a_kv_req_of_another_bootstrap_instance_is_refused():
    m = machine()
    why = (f"room {ROOM}: the decode resolved prefill dp_rank 0 on bootstrap instance inst-0, but this server "
           "is instance inst-1: the prefill restarted and lost the room")
    assert deliver(m, kv_req(prefill_instance="inst-0")) == [kv_fail(why, C.PEER_GONE)]
    assert not m.notes.early and m.notes.doomed[ROOM].cause is C.PEER_GONE


@pytest.mark.parametrize("mine,theirs", [("", "inst-0"), ("inst-1", "")])
def test_the_instance_is_checked_only_when_both_are_known(mine, theirs):
    m = machine(instance_id=mine)
    assert deliver(m, kv_req(prefill_instance=theirs)) == [] and ROOM in m.notes.early


def _reuse_problem(req: wire.KvReq, ids=IDS) -> list:
    m = machine()
    accept(m, ids=ids)
    effects = deliver(m, req)
    assert state(m) is R.FAILED and m.rooms[ROOM].cause is C.INCOMPATIBLE
    return effects


@pytest.mark.parametrize("decode_len", [PROMPT + 1, PROMPT + 3])
def test_a_prompt_length_mismatch_fails_both(decode_len):
    why = (f"room {ROOM}: decode sent 3 pages (reusing 0) for {decode_len} tokens, prefill has {PROMPT} "
           "tokens (3 pages): the two legs got different prompts")
    assert _reuse_problem(kv_req(prompt_len=decode_len)) == [kv_fail(why, C.INCOMPATIBLE)]


def test_a_reuse_claim_beyond_the_full_pages_is_refused():
    why = f"room {ROOM}: decode claims 3 reused pages of a 10-token prompt (2 full pages)"
    assert _reuse_problem(kv_req(dst_pages=[], reused_pages=3, reused_key="00")) == [kv_fail(why, C.INCOMPATIBLE)]


@pytest.mark.parametrize("ids", ["other_prompt", "no_prompt_ids"])
def test_a_prefix_key_mismatch_is_refused(ids):
    key = prefix_key([7] * PROMPT, 4, 1)
    why = (f"room {ROOM}: decode dp_rank 1 holds 1 pages of another prefix (key {key[:16]}...) than this "
           "prompt's: prefix hash mismatch")
    req = kv_req(dst_pages=[3, 4], reused_pages=1, reused_key=key)
    assert _reuse_problem(req, IDS if ids == "other_prompt" else None) == [kv_fail(why, C.INCOMPATIBLE)]


def test_a_duplicate_kv_req_is_ignored():
    m = machine()
    drive(m, R.WAITING_FOR_INPUT)
    assert deliver(m, kv_req(dst_pages=[0])) == [] and m.rooms[ROOM].req.dst_pages == DST
    assert prefilled(m) == [write()]
    assert deliver(m, kv_req(dst_pages=[0])) == [] and state(m) is R.TRANSFERRING


def test_other_messages_are_ignored():
    m = machine()
    drive(m, R.WAITING_FOR_INPUT)
    assert m.step(FromDecode(DEC, DONE, **at(T0))) == [] and state(m) is R.WAITING_FOR_INPUT


def test_a_room_accepted_twice_is_refused_and_the_first_kept():
    m = machine()
    accept(m)
    with pytest.raises(ValueError, match=f"room {ROOM} is already in progress on prefill dp_rank 0"):
        m.step(PrefillAccept(ROOM, "p-2", PROMPT + 4, None, **at(T0)))
    assert m.rooms[ROOM].rid == "p-1" and m.rooms[ROOM].prompt_len == PROMPT


# ---- dropped rooms (the decode prefilled it itself) -------------------------------------------
def _assert_dropped(m) -> None:
    done = report(tick(m, T0 + 1))
    assert not done.ok and done.dropped and done.reason == f"room {ROOM}: dropped: local prefill"
    assert done.meta["disaggregation"] == "dropped" and "failure_cause" not in done.meta
    assert ROOM not in m.notes.doomed  # not a failure: a later request is served


def test_a_drop_before_the_request():
    m = machine()
    assert m.step(Drop(ROOM, "local prefill", **at(T0))) == [] and ROOM in m.notes.dropped
    assert accept(m) == [] and state(m) is R.DROPPED_UNHEARD and not m.notes.dropped
    _assert_dropped(m)


@pytest.mark.parametrize("start", [R.BOOTSTRAPPING, R.PREFILLED, R.WAITING_FOR_INPUT, R.TRANSFERRING])
def test_a_drop_after_the_request(start):
    m = machine()
    drive(m, start)
    assert m.step(Drop(ROOM, "local prefill", **at(T0))) == []
    if start in (R.WAITING_FOR_INPUT, R.TRANSFERRING):  # its KvReq came: being served, left alone
        assert state(m) is start
        return
    assert state(m) is R.DROPPED_UNHEARD
    _assert_dropped(m)


def test_a_kv_req_for_a_dropped_room_is_answered_once():
    m = machine()
    drive(m, R.PREFILLED)
    m.step(Drop(ROOM, "local prefill", **at(T0)))
    assert deliver(m) == [kv_fail(f"room {ROOM}: dropped: local prefill", C.ABORTED)]
    assert state(m) is R.DROPPED
    assert deliver(m) == []
    _assert_dropped(m)


# ---- forwarding (zero-round-trip rendezvous) --------------------------------------------------
def forwarded(req: wire.KvReq | None = None) -> Send:
    req = req or kv_req()
    why = f"room {ROOM}: prefill dp_rank 0 could not forward the KV request to dp_rank 1 that holds the room"
    return Send(HOLDER, msgspec.structs.replace(req, forwarded_by=0),
                on_sent=Send(DEC, wire.KvMoved(room=ROOM, prefill_rank=1, endpoint=HOLDER)),
                on_error=kv_fail(why, C.TRANSFER))


@pytest.mark.parametrize("order", ["route_first", "kv_req_first"])
def test_a_kv_req_for_a_routed_room_is_forwarded(order):
    m = machine()
    if order == "route_first":
        assert m.step(RoomRouted(ROOM, 1, HOLDER, **at(T0))) == []
        assert deliver(m) == [forwarded()]
    else:
        assert deliver(m) == [] and ROOM in m.notes.early
        assert m.step(RoomRouted(ROOM, 1, HOLDER, **at(T0))) == [forwarded()]
    assert not m.notes.early and not m.rooms and m.notes.forwarded[ROOM].holder == HOLDER


def test_an_unreachable_holder_fails_the_decode_from_the_home():
    send = forwarded()
    why = (f"room {ROOM}: prefill dp_rank 0 could not forward the KV request to dp_rank 1 that holds the "
           "room: connection refused")
    assert send.failed("connection refused") == kv_fail(why, C.TRANSFER)
    assert kv_fail("x", C.ABORTED).failed("boom") is None  # a plain send is only logged


def test_a_kv_req_already_forwarded_is_not_forwarded_again():
    m = machine()
    m.step(RoomRouted(ROOM, 1, HOLDER, **at(T0)))
    assert deliver(m, kv_req(forwarded_by=1)) == [] and ROOM in m.notes.early


@pytest.mark.parametrize("via", ["forwarded", "route"])
def test_a_decode_abort_follows_the_room_to_its_holder(via):
    m = machine()
    m.step(RoomRouted(ROOM, 1, HOLDER, **at(T0)))
    if via == "forwarded":
        deliver(m)
    assert abort(m, endpoint=None) == [Send(HOLDER, kv_abort(DEC))]  # the holder answers the decode
    assert ROOM not in m.notes.doomed


def test_a_room_the_decode_gave_up_at_the_home_is_aborted_on_the_holder():
    m = machine()
    deliver(m)
    assert abort(m) == [kv_fail(ABORTED_BY_DECODE, C.ABORTED)]
    assert m.step(RoomRouted(ROOM, 1, HOLDER, **at(T0))) == [
        Send(HOLDER, wire.KvAbort(room=ROOM, reason=ABORTED_BY_DECODE))]


def test_the_holder_reports_who_forwarded_the_kv_req():
    m = machine()  # the holder, here rank 0
    accept(m)
    deliver(m, kv_req(forwarded_by=1), sender=OTHER)
    prefilled(m)
    returned(m)
    assert report(tick(m)).meta["kv_req_forwarded_by"] == 1
