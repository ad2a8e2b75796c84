"""PrefillSender step by step: two FakeBackends on one FakeFabric over numpy KV pools, a
DecodeReceiver on the other side fed by hand (fake resolver and `reserve`), no processes.

The harness is tests/harness/handoff_harness.py (fixtures in conftest.py). Deadlines are driven by an explicit
`now`; waits for background sends and writes have deadlines of their own.
"""

from __future__ import annotations

import pytest

from pdserve.disagg import wire
from pdserve.disagg.handoff import HandoffState
from tests.harness.handoff_harness import (
    ADDR,
    AUX,
    FP,
    PAGE_BYTES,
    PROMPT,
    REGIONS,
    ROOM,
    SRC,
    WAIT_S,
    assert_idle,
    assert_pages_landed,
    facts_of,
    make_link,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_stray_threads")]
S = HandoffState


# ---- happy path -------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["req_first", "request_first", "prefilled_first"])
def test_happy_path_pages_land_in_dst_pages(link, order):
    """kv_req before the prefill request, between request and prefill end, or after both."""
    if order == "req_first":
        link.deliver_req()
        assert ROOM in link.sender.early and link.sender.inflight() == 0
        link.sender.accept(ROOM, "p-1", PROMPT)
        assert link.sender.rooms[ROOM].handoff.state is S.WAITING_FOR_INPUT
        link.sender.prefill_done(ROOM, SRC, AUX)
    else:
        link.sender.accept(ROOM, "p-1", PROMPT)
        if order == "prefilled_first":
            link.sender.prefill_done(ROOM, SRC, AUX)
            assert link.sender.rooms[ROOM].handoff.state is S.BOOTSTRAPPING
        link.deliver_req()
        if order == "request_first":
            assert link.sender.rooms[ROOM].handoff.state is S.WAITING_FOR_INPUT
            link.sender.prefill_done(ROOM, SRC, AUX)
    [pdone] = link.prefill_done()
    assert pdone.ok and pdone.rid == "p-1" and pdone.reason == ""
    [msg] = link.to_decode()
    assert msg["t"] == wire.KV_DONE
    [ddone] = link.decode_done()
    assert ddone.ok and ddone.rid == f"d-{ROOM}" and ddone.room == ROOM
    dst = link.pool.held[f"d-{ROOM}"]
    assert dst == [9, 3, 4]
    assert_pages_landed(link, SRC, dst)
    assert facts_of(ddone.aux) == AUX
    nbytes = len(SRC) * REGIONS * PAGE_BYTES
    assert pdone.meta["kv_bytes"] == nbytes == ddone.meta["kv_bytes"]
    assert pdone.meta["prefill_dp_rank"] == 0 and pdone.meta["bootstrap_room"] == ROOM
    assert pdone.meta["prefill_total_s"] >= 0 and pdone.meta["kv_transfer_s"] >= 0
    assert ddone.meta["prefill_dp_rank"] == 0 and ddone.meta["decode_dp_rank"] == 1
    assert ddone.meta["bootstrap_s"] >= 0 and ddone.meta["waiting_s"] >= 0
    assert ddone.meta["dp_rank_path"] == "single"
    assert "prefill" in link.wakes and "decode" in link.wakes
    assert_idle(link)


def test_write_job_wakes_loop_and_counts_inflight(link):
    link.sender.accept(ROOM, "p-1", PROMPT)
    link.deliver_req()
    assert link.sender.inflight() == 1
    link.prefill_be.gate.clear()
    link.sender.prefill_done(ROOM, SRC, AUX)
    assert link.prefill_be.writing.wait(WAIT_S)
    assert link.sender.poll() == [] and link.sender.inflight() == 1
    link.prefill_be.gate.set()
    assert link.prefill_done()[0].ok
    assert link.wakes.count("prefill") >= 1


# ---- rooms the front rejected -----------------------------------------------------------------
CONFLICT = "follow_bootstrap_room conflict: dispatched to dp_rank 1 but bootstrap_room 7 implies dp_rank 0."


@pytest.mark.parametrize("when", ["before_kv_req", "after_kv_req"])
def test_room_marked_failed_fails_decode_at_once(link, when):
    if when == "before_kv_req":
        link.sender.mark_failed(ROOM, CONFLICT)
        link.deliver_req()
    else:
        link.deliver_req()
        assert ROOM in link.sender.early
        link.sender.mark_failed(ROOM, CONFLICT)
    assert ROOM not in link.sender.early
    [msg] = link.to_decode()
    assert msg["t"] == wire.KV_FAIL and msg["reason"] == CONFLICT
    [ddone] = link.decode_done()
    assert not ddone.ok and CONFLICT in ddone.reason and f"room {ROOM}" in ddone.reason
    assert not link.d_mem.any()
    assert link.sender.poll() == [] and link.sender.inflight() == 0
    # should the request reach this worker anyway, it fails at once instead of timing out
    link.sender.accept(ROOM, "p-late", PROMPT)
    [pdone] = link.sender.poll()
    assert not pdone.ok and pdone.reason == CONFLICT


def test_room_in_progress_marked_failed_ends_now_and_frees(link):
    """The decode gave the room up through the bootstrap service (no kv_req will ever come):
    the prefill's room ends at once with that reason, not at its bootstrap deadline."""
    gave_up = f"the decode side gave up the room: room {ROOM}: other transfer backend"
    link.sender.accept(ROOM, "p-1", PROMPT)
    link.sender.prefill_done(ROOM, SRC, AUX)
    assert link.sender.poll() == [] and link.sender.inflight() == 1
    link.sender.mark_failed(ROOM, gave_up)
    [pdone] = link.sender.poll()
    assert not pdone.ok and pdone.reason == gave_up
    assert link.sender.inflight() == 0


# ---- incompatible legs ------------------------------------------------------------------------
@pytest.mark.parametrize("key,value", [("page_size", 8), ("kv_dtype", "bfloat16"),
                                       ("fingerprint", {**FP, "num_layers": 3})])
def test_compat_mismatch_fails_both_sides_naming_both_values(request, key, value):
    lk = make_link(decode_local={key: value})
    request.addfinalizer(lk.close)
    lk.sender.accept(ROOM, "p-1", PROMPT)
    lk.deliver_req()
    [pdone] = lk.sender.poll()
    mine = lk.p_local[key]
    assert not pdone.ok and f"{key} mismatch" in pdone.reason and f"room {ROOM}" in pdone.reason
    assert repr(mine) in pdone.reason and repr(value) in pdone.reason
    [msg] = lk.to_decode()
    assert msg["t"] == wire.KV_FAIL
    [ddone] = lk.decode_done()
    assert not ddone.ok and f"{key} mismatch" in ddone.reason
    assert repr(mine) in ddone.reason and repr(value) in ddone.reason
    assert not lk.d_mem.any()
    assert_idle(lk)


def test_backend_mismatch_fails_the_decode_at_resolution(request):
    """A prefill registered with another transfer backend is refused before any kv_req."""
    lk = make_link(decode_local={"backend": "tcp"})
    request.addfinalizer(lk.close)
    lk.receiver.accept(ROOM, f"d-{ROOM}", ADDR, PROMPT, None)
    lk.prefills.resolved(lk.resolved(ROOM))
    [ddone] = lk.receiver.poll()
    assert not ddone.ok and f"room {ROOM}" in ddone.reason
    assert "'fake'" in ddone.reason and "'tcp'" in ddone.reason
    assert lk.prefill_be.recv(0.2) == []  # nothing reached the prefill
    assert_idle(lk)


def test_compat_mismatch_before_request_is_remembered(request):
    lk = make_link(decode_local={"kv_dtype": "bfloat16"})
    request.addfinalizer(lk.close)
    lk.deliver_req()
    assert lk.to_decode()[0]["t"] == wire.KV_FAIL
    assert not lk.decode_done()[0].ok
    lk.sender.accept(ROOM, "p-1", PROMPT)
    [pdone] = lk.sender.poll()
    assert not pdone.ok and "kv_dtype mismatch" in pdone.reason


@pytest.mark.parametrize("decode_len", [PROMPT + 1, PROMPT + 3])
def test_prompt_length_mismatch_fails_both(link, decode_len):
    """PROMPT + 1 still needs 3 pages: the token count alone must catch it."""
    link.sender.accept(ROOM, "p-1", PROMPT)
    link.deliver_req(prompt_len=decode_len)
    [pdone] = link.sender.poll()
    assert not pdone.ok
    assert f"{decode_len} tokens" in pdone.reason and f"{PROMPT} tokens" in pdone.reason
    assert f"room {ROOM}" in pdone.reason
    assert link.to_decode()[0]["t"] == wire.KV_FAIL
    [ddone] = link.decode_done()
    assert not ddone.ok and "different prompts" in ddone.reason
    assert_idle(link)


# ---- deadlines --------------------------------------------------------------------------------
def test_bootstrap_timeout_without_kv_req(link):
    link.sender.accept(ROOM, "p-1", PROMPT)
    link.sender.prefill_done(ROOM, SRC, AUX)
    t0 = link.sender.rooms[ROOM].handoff.created
    assert link.sender.poll(now=t0 + 29.9) == []
    [pdone] = link.sender.poll(now=t0 + 30.1)
    assert not pdone.ok and "PDSERVE_BOOTSTRAP_TIMEOUT" in pdone.reason
    assert f"room {ROOM}" in pdone.reason and "dp_rank 0" in pdone.reason
    assert "kv_req" in pdone.reason
    assert link.sender.inflight() == 0


def test_queued_kv_req_expires_when_request_never_comes(link):
    link.deliver_req()
    t = link.sender.early[ROOM][2]
    assert link.sender.poll(now=t + 29.9) == [] and ROOM in link.sender.early
    assert link.sender.poll(now=t + 30.1) == []
    [msg] = link.to_decode()
    assert msg["t"] == wire.KV_FAIL and "never received" in msg["reason"]
    [ddone] = link.decode_done()
    assert not ddone.ok and "PDSERVE_BOOTSTRAP_TIMEOUT" in ddone.reason
    link.sender.accept(ROOM, "p-late", PROMPT)  # too late: fails at once
    assert not link.sender.poll()[0].ok


# ---- aborts on the prefill side ---------------------------------------------------------------
@pytest.mark.parametrize("state", [S.BOOTSTRAPPING, S.WAITING_FOR_INPUT])
def test_prefill_abort_before_transfer(link, state):
    link.sender.accept(ROOM, "p-1", PROMPT)
    if state is S.WAITING_FOR_INPUT:
        link.deliver_req()
    assert link.sender.rooms[ROOM].handoff.state is state
    link.sender.fail(ROOM, f"room {ROOM}: prefill request aborted (client gone)")
    [pdone] = link.sender.poll()
    assert not pdone.ok and "client gone" in pdone.reason
    if state is S.WAITING_FOR_INPUT:  # the decode is waiting: it is told
        assert link.to_decode()[0]["t"] == wire.KV_FAIL
        [ddone] = link.decode_done()
        assert not ddone.ok and "client gone" in ddone.reason
    link.sender.prefill_done(ROOM, SRC, AUX)  # the engine finishing late changes nothing
    assert link.sender.poll() == []
    assert not link.d_mem.any()


def test_prefill_abort_while_writing_keeps_pages_until_the_write_returns(link):
    link.sender.accept(ROOM, "p-1", PROMPT)
    link.deliver_req()
    link.prefill_be.gate.clear()
    link.sender.prefill_done(ROOM, SRC, AUX)
    assert link.prefill_be.writing.wait(WAIT_S)
    link.sender.fail(ROOM, "prefill request aborted")
    assert link.sender.rooms[ROOM].handoff.state is S.FAILED
    t0 = link.sender.rooms[ROOM].handoff.created
    assert link.sender.poll(now=t0 + 1000) == []  # a write still reads our pages
    assert link.sender.inflight() == 1
    link.prefill_be.gate.set()
    [pdone] = link.prefill_done()
    assert not pdone.ok and "aborted" in pdone.reason
    [msg] = link.to_decode()  # the write finished, so its kv_done went out: the decode has its KV
    assert msg["t"] == wire.KV_DONE
    assert link.decode_done()[0].ok


# ---- transfer failures ------------------------------------------------------------------------
def test_write_failure_fails_both_sides(link):
    link.prefill_be.faults.fail_writes = 1
    link.sender.accept(ROOM, "p-1", PROMPT)
    link.deliver_req()
    link.sender.prefill_done(ROOM, SRC, AUX)
    [pdone] = link.prefill_done()
    assert not pdone.ok and "injected write failure" in pdone.reason and f"room {ROOM}" in pdone.reason
    [msg] = link.to_decode()
    assert msg["t"] == wire.KV_FAIL
    [ddone] = link.decode_done()
    assert not ddone.ok and "injected write failure" in ddone.reason
    assert not link.d_mem.any()
    assert_idle(link)


def test_kv_done_send_failure_fails_both_sides(link):
    """The pages landed but the kv_done could not be sent: the decode must hear kv_fail."""
    link.sender.accept(ROOM, "p-1", PROMPT)
    link.deliver_req()
    link.prefill_be.faults.fail_sends = 1
    link.sender.prefill_done(ROOM, SRC, AUX)
    [pdone] = link.prefill_done()
    assert not pdone.ok and "injected send failure" in pdone.reason
    assert link.to_decode()[0]["t"] == wire.KV_FAIL
    assert not link.decode_done()[0].ok


def test_write_failure_after_abort_still_tells_the_decode(link):
    link.sender.accept(ROOM, "p-1", PROMPT)
    link.deliver_req()
    link.prefill_be.gate.clear()
    link.prefill_be.faults.fail_writes = 1
    link.sender.prefill_done(ROOM, SRC, AUX)
    assert link.prefill_be.writing.wait(WAIT_S)
    link.sender.fail(ROOM, "prefill request aborted")
    assert link.sender.poll() == []
    link.prefill_be.gate.set()
    [pdone] = link.prefill_done()
    assert not pdone.ok and pdone.reason == "prefill request aborted"  # the first reason wins
    [msg] = link.to_decode()
    assert msg["t"] == wire.KV_FAIL and msg["reason"] == "prefill request aborted"
    assert not link.decode_done()[0].ok


# ---- kv_abort from the decode, at each prefill state ------------------------------------------
def _abort_msg(room: int = ROOM) -> dict:
    return {"t": wire.KV_ABORT, "room": room, "reason": "client went away", "decode_rank": 1}


@pytest.mark.parametrize("state", ["unknown", "queued", S.BOOTSTRAPPING, S.WAITING_FOR_INPUT])
def test_decode_abort_is_answered_and_fails_the_room(link, state):
    if state == "queued":
        link.deliver_req()
    elif state is S.WAITING_FOR_INPUT:
        link.sender.accept(ROOM, "p-1", PROMPT)
        link.deliver_req()
    elif state is S.BOOTSTRAPPING:
        link.sender.accept(ROOM, "p-1", PROMPT)
    link.sender.on_message(link.d_local["endpoint"], _abort_msg())
    [msg] = link.to_decode()  # always answered, so the decode may free its pages
    assert msg["t"] == wire.KV_FAIL and "decode dp_rank 1 aborted" in msg["reason"]
    assert ROOM not in link.sender.early
    if state in ("unknown", "queued"):
        link.sender.accept(ROOM, "p-1", PROMPT)  # the request arrives after the abort
    [pdone] = link.sender.poll()
    assert not pdone.ok and "client went away" in pdone.reason and f"room {ROOM}" in pdone.reason
    link.sender.prefill_done(ROOM, SRC, AUX)
    assert link.sender.poll() == [] and not link.d_mem.any()


def test_decode_abort_overtaking_its_kv_req_is_never_served(link):
    link.sender.accept(ROOM, "p-1", PROMPT)
    link.sender.prefill_done(ROOM, SRC, AUX)
    link.sender.on_message(link.d_local["endpoint"], _abort_msg())
    assert not link.sender.poll()[0].ok
    link.deliver_req()  # arrives late: refused, nothing written
    assert [m["t"] for m in link.to_decode(2)] == [wire.KV_FAIL, wire.KV_FAIL]
    assert not link.decode_done()[0].ok
    assert not link.d_mem.any() and link.sender.inflight() == 0


def test_decode_abort_during_write_answered_after_the_write(link):
    link.sender.accept(ROOM, "p-1", PROMPT)
    link.deliver_req()
    link.prefill_be.gate.clear()
    link.sender.prefill_done(ROOM, SRC, AUX)
    assert link.prefill_be.writing.wait(WAIT_S)
    link.sender.on_message(link.d_local["endpoint"], _abort_msg())
    assert link.sender.poll() == []
    link.prefill_be.gate.set()
    [pdone] = link.prefill_done()
    assert not pdone.ok and "client went away" in pdone.reason
    assert [m["t"] for m in link.to_decode()] == [wire.KV_DONE]  # the answer: pages landed


def test_messages_without_room_or_endpoint_are_ignored(link):
    link.sender.accept(ROOM, "p-1", PROMPT)
    link.sender.on_message(link.d_local["endpoint"], {"t": wire.KV_REQ, "room": "x"})
    link.sender.on_message(link.d_local["endpoint"], {"t": wire.KV_REQ, "room": ROOM})
    link.sender.on_message(link.d_local["endpoint"], {"t": "bogus", "room": ROOM})
    assert link.sender.rooms[ROOM].handoff.state is S.BOOTSTRAPPING
    assert link.sender.poll() == [] and not link.sender.early


BAD_KV_REQS = [  # (what is changed, the value, what the error says)
    ("prompt_len", "ten", "Expected `int`, got `str` - at `$.prompt_len`"),
    ("layout", "pages", "Expected `object`, got `str` - at `$.layout`"),
    ("layout.dtype", "bf17", "Invalid enum value 'bf17' - at `$.layout.dtype`"),
    ("layout.num_pages", -1, "KV layout num_pages=-1 is not a non-negative integer - at `$.layout`"),
    ("layout.page_bytes", None, "Object missing required field `page_bytes` - at `$.layout`"),
    ("kv_dtype", "bf16", "Invalid enum value 'bf16' - at `$.kv_dtype`"),
    ("backend", "rdma", "Invalid enum value 'rdma' - at `$.backend`"),
]


def spoil(req: dict, what: str, value) -> dict:
    """`req` with field `what` (or "layout.<field>") set to `value`, or removed for None."""
    top, _, sub = what.partition(".")
    inner = {**req[top], sub: value} if sub else value
    if sub and value is None:
        del inner[sub]
    return {**req, top: inner}


@pytest.mark.parametrize("request_first", [True, False])
@pytest.mark.parametrize("what,value,error", BAD_KV_REQS)
def test_a_kv_req_that_does_not_parse_fails_both_legs_naming_the_room(link, request_first, what, value, error):
    """A malformed layout, dtype or backend on the wire is refused at once, naming the room."""
    if request_first:
        link.sender.accept(ROOM, "p-1", PROMPT)
    req = link.decode_sends_req()
    link.sender.on_message(link.d_local["endpoint"], spoil(req, what, value))
    [msg] = link.to_decode()
    assert msg["t"] == wire.KV_FAIL and msg["cause"] == "incompatible"
    [ddone] = link.decode_done()
    assert not ddone.ok and ddone.reason.endswith(
        f"room {ROOM}: prefill dp_rank 0 cannot read the decode's kv_req: {error}")
    if not request_first:
        link.sender.accept(ROOM, "p-1", PROMPT)
    [pdone] = link.sender.poll()
    assert not pdone.ok and pdone.reason == f"room {ROOM}: prefill dp_rank 0 cannot read the decode's kv_req: {error}"
    assert not link.d_mem.any()
    assert_idle(link)


def test_duplicate_kv_req_is_ignored(link):
    link.sender.accept(ROOM, "p-1", PROMPT)
    req = link.decode_sends_req()
    link.sender.on_message(link.d_local["endpoint"], req)
    assert link.sender.rooms[ROOM].handoff.state is S.WAITING_FOR_INPUT
    link.sender.on_message(link.d_local["endpoint"], {**req, "dst_pages": [0]})
    assert link.sender.rooms[ROOM].req.dst_pages == req["dst_pages"]
    link.sender.prefill_done(ROOM, SRC, AUX)
    assert link.prefill_done()[0].ok


def test_a_room_accepted_twice_is_refused_and_the_first_one_kept(link):
    """Issue 14 item 1: a second request on a live room must not take over its entry and pages."""
    link.sender.accept(ROOM, "p-1", PROMPT)
    assert link.sender.holds(ROOM)
    with pytest.raises(ValueError, match=f"room {ROOM} is already in progress"):
        link.sender.accept(ROOM, "p-2", PROMPT + 4)
    link.deliver_req()
    link.sender.prefill_done(ROOM, SRC, AUX)
    [done] = link.prefill_done()
    assert done.ok and done.rid == "p-1"
    link.to_decode()
    [got] = link.decode_done()
    assert got.ok and got.aux.first_token == AUX.first_token
    assert_pages_landed(link, SRC, [9, 3, 4])  # the pool's first free pages
    assert_idle(link)
