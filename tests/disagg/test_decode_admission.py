"""Decode admission control, step by step and with no processes: the admission queue of the
decode machine (arrival order, bound, timeout, refusals as back-pressure) and the page
arithmetic of worker/admission.py on a real engine with a tiny model."""

from __future__ import annotations

import pytest

from pdserve.core.kv_layout import KVLayout
from pdserve.disagg.bootstrap_table import RankInfo
from pdserve.disagg.decode_events import (
    CancelResolve,
    DecodeAccept,
    DecodeReport,
    GiveUp,
    PagesReserved,
    RankResolved,
    Reservation,
    Reserve,
    Resolve,
    Resolved,
    SendAbort,
    SendKvReq,
)
from pdserve.disagg.decode_machine import DecodeHandoffs
from pdserve.disagg.decode_rooms import DecodeState, HandoffQueue
from pdserve.disagg.handoff import Tick
from pdserve.disagg.local_facts import LocalFacts

D = DecodeState
ADDR = "10.0.0.1:8998"
PROMPT = 10
EP = {"backend": "fake", "ip": "10.0.0.1", "port": 9000}
LOCAL = LocalFacts.of("fake", KVLayout(base_ptr=0, num_regions=4, num_pages=16, page_bytes=64, region_stride=1024,
                                       page_size=4, dtype="float32"),
                      {}, {"backend": "fake", "ip": "10.0.0.2", "port": 7000})
A, B, C, E = 1, 2, 3, 4


def machine(**queue) -> DecodeHandoffs:
    return DecodeHandoffs(0, LOCAL, waiting_timeout=100.0, queue=HandoffQueue(**queue))


def resolve(m: DecodeHandoffs, room: int, now: float = 0.0) -> None:
    """Accept `room` and resolve it: it is RESERVING, asked for pages from the next tick."""
    assert m.step(DecodeAccept(room, f"d-{room}", ADDR, PROMPT, None, now=now)) == [Resolve(ADDR, room, None)]
    info = RankInfo(dp_rank=0, dp_size=1, rank_ip=EP["ip"], rank_port=EP["port"], page_size=4,
                    kv_cache_dtype="float32", load_balance_method="auto", fingerprint={}, endpoint=EP,
                    transfer_backend="fake")
    res = Resolved(room, ADDR, 0, "single", instance_id="i", seconds=0.0, topology_at=0.0, resolved_at=0.0,
                   info=info)
    assert m.step(RankResolved(res, now=now)) == []
    assert m.rooms[room].state is D.RESERVING


def reserves(effects) -> list[int]:
    return [e.room for e in effects if isinstance(e, Reserve)]


def reports(effects) -> list[DecodeReport]:
    return [e for e in effects if isinstance(e, DecodeReport)]


def answer(m: DecodeHandoffs, effects, free: int, now: float) -> tuple[list[int], list]:
    """Answer every Reserve the way a pool with `free` one-room slots would: -> (rooms that got
    pages, every effect of the round)."""
    got, out, todo = [], list(effects), reserves(effects)
    while todo:
        room = todo.pop(0)
        ok = free > 0
        free -= ok
        eff = m.step(PagesReserved(room, got=Reservation([room]) if ok else None, now=now, wall=now))
        got += [room] if ok else []
        out += eff
        todo += reserves(eff)
    return got, out


def test_rooms_get_pages_in_arrival_order_and_the_first_that_does_not_fit_stops_the_round():
    m = machine()
    for room in (A, B, C):
        resolve(m, room)
    assert reserves(m.step(Tick(now=1.0))) == [A]  # one at a time: the answer asks the next
    eff = m.step(PagesReserved(A, got=Reservation([5]), now=1.0, wall=1.0))
    assert isinstance(eff[0], SendKvReq) and reserves(eff) == [B]
    assert m.step(PagesReserved(B, now=1.0, wall=1.0)) == []  # no pages: C is not even asked
    assert m.rooms[B].queued_at == 1.0 and m.rooms[C].queued_at == 1.0 and m.queued() == 2
    # next tick: B, the oldest, is asked first; C may not overtake it while B does not fit
    assert reserves(m.step(Tick(now=2.0))) == [B]
    assert m.step(PagesReserved(B, now=2.0, wall=2.0)) == []
    got, _ = answer(m, m.step(Tick(now=3.0)), free=2, now=3.0)
    assert got == [B, C] and m.queued() == 0
    assert m.rooms[B].queued_at == 1.0  # it stays the time it waited from (meta: prealloc_wait_s)


def test_an_accept_while_the_queue_is_full_is_refused_at_once_before_any_resolution():
    m = machine(max_queued=2)
    for room in (A, B):
        resolve(m, room)
    answer(m, m.step(Tick(now=1.0)), free=0, now=1.0)
    assert m.queued() == 2
    assert m.step(DecodeAccept(C, f"d-{C}", ADDR, PROMPT, None, now=1.5)) == [CancelResolve(ADDR, C)]
    eff = m.step(Tick(now=1.6))
    [rep] = reports(eff)  # reported (its 429) at once ...
    reason = rep.done.reason
    assert "decode dp_rank 0 cannot take it now" in reason and "--max-queued-handoffs 2" in reason
    assert f"room {C}" in reason and "2 handoffs waiting" in reason
    assert not [e for e in eff if isinstance(e, GiveUp)]
    # ... the prefill hears of it (/fail_room: no resolution) tell_prefill_after later, so that a
    # router sees this decode's 429 before the prefill's echo of it
    assert [e for e in m.step(Tick(now=1.9)) if isinstance(e, GiveUp)] == []
    assert [e for e in m.step(Tick(now=2.0)) if isinstance(e, GiveUp)] == [GiveUp(ADDR, C, reason)]
    assert not rep.done.ok and rep.done.room == C
    assert rep.done.meta["failure_cause"] == "no_pages" and rep.done.meta["admission"] == "refused"
    assert rep.done.meta["admission_refused"] == "queue_full" and rep.done.meta["retry_after_s"] == 1
    assert m.refused == {"queue_full": 1, "timeout": 0}
    assert set(m.rooms) == {A, B}  # the queued ones are untouched


def test_a_room_that_would_overflow_the_queue_is_refused_when_it_finds_no_pages():
    m = machine(max_queued=1)
    for room in (A, B, C):
        resolve(m, room)
    got, eff = answer(m, m.step(Tick(now=1.0)), free=1, now=1.0)
    assert got == [A] and m.queued() == 1 and m.rooms[B].queued_at == 1.0
    [rep] = reports(eff)
    assert rep.done.room == C and rep.done.meta["admission_refused"] == "queue_full"
    assert not [e for e in eff if isinstance(e, SendAbort)]
    [abort] = [e for e in m.step(Tick(now=1.5)) if isinstance(e, SendAbort)]  # resolved: a kv_abort
    assert abort.room == C and "admission queue is full (1 handoffs waiting" in abort.msg.reason


def test_no_queue_refuses_a_room_the_pool_cannot_hold_now():
    m = machine(max_queued=0)
    resolve(m, A)
    got, eff = answer(m, m.step(Tick(now=1.0)), free=0, now=1.0)
    assert got == [] and [r.done.room for r in reports(eff)] == [A]
    assert reports(eff)[0].done.meta["admission"] == "refused"
    resolve(m, B, now=2.0)  # an empty queue never refuses an accept
    got, _ = answer(m, m.step(Tick(now=2.0)), free=1, now=2.0)
    assert got == [B]


def test_a_queued_room_is_refused_after_the_queue_timeout_and_the_next_one_moves_up():
    m = machine(timeout=5.0)
    for room in (A, B):
        resolve(m, room)
    answer(m, m.step(Tick(now=1.0)), free=0, now=1.0)
    _, eff = answer(m, m.step(Tick(now=6.0)), free=0, now=6.0)  # waited 5 s: not more than 5
    assert reports(eff) == [] and m.queued() == 2
    _, eff = answer(m, m.step(Tick(now=6.5)), free=0, now=6.5)
    refused = reports(eff)
    assert [r.done.room for r in refused] == [A, B]  # both queued at 1.0: A asked, B checked behind it
    assert all(r.done.meta["admission_refused"] == "timeout" for r in refused)
    assert "no KV pages within 5s (--handoff-queue-timeout" in refused[0].done.reason
    assert m.rooms == {} and m.refused["timeout"] == 2


def test_the_waiting_deadline_still_applies_to_rooms_behind_a_blocked_head():
    m = DecodeHandoffs(0, LOCAL, waiting_timeout=10.0, queue=HandoffQueue())
    for room in (A, B):
        resolve(m, room)
    answer(m, m.step(Tick(now=1.0)), free=0, now=1.0)
    _, eff = answer(m, m.step(Tick(now=10.5)), free=0, now=10.5)
    done = reports(eff)
    assert [r.done.room for r in done] == [A, B]
    assert all(r.done.meta["failure_cause"] == "timeout" and "admission" not in r.done.meta for r in done)


def test_a_reservation_error_moves_the_round_on():
    m = machine()
    for room in (A, B):
        resolve(m, room)
    assert reserves(m.step(Tick(now=1.0))) == [A]
    eff = m.step(PagesReserved(A, error="rid in use", now=1.0, wall=1.0))
    assert reserves(eff) == [B] and [r.done.room for r in reports(eff)] == [A]
    assert "admission" not in reports(eff)[0].done.meta  # a failure, not back-pressure


def test_a_refusal_makes_room_for_the_next_accept():
    m = machine(max_queued=1)
    resolve(m, A)
    answer(m, m.step(Tick(now=1.0)), free=0, now=1.0)
    assert reports(m.step(DecodeAccept(B, f"d-{B}", ADDR, PROMPT, None, now=1.5))) == []  # refused
    answer(m, m.step(Tick(now=2.0)), free=1, now=2.0)  # A admitted, B reported
    assert m.queued() == 0
    resolve(m, E, now=3.0)
    got, _ = answer(m, m.step(Tick(now=3.0)), free=1, now=3.0)
    assert got == [E]


# ---- the page arithmetic on a real engine ---------------------------------------------------
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pdserve.core.sampling import SamplingParams  # noqa: E402
from pdserve.engine.engine import Engine, EngineConfig  # noqa: E402
from pdserve.engine.kv_pool import KVPool  # noqa: E402
from pdserve.engine.loader import load_model  # noqa: E402
from pdserve.engine.sequence import EngineRequest  # noqa: E402
from pdserve.worker.admission import GenerationReserve, PoolArithmetic  # noqa: E402
from tests.harness.tiny_model import make_tiny_model  # noqa: E402

PAGE = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model(str(tmp_path_factory.mktemp("admission_tiny"))), torch.float32, "cpu")


def engine(model, num_pages: int) -> Engine:
    m, cfg = model
    pool = KVPool(cfg.num_layers, num_pages, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    return Engine(m, pool, EngineConfig(num_pages=num_pages, page_size=PAGE, max_context=512,
                                        vocab_size=cfg.vocab_size, eos_token_ids=(2,)))


def test_a_handoff_is_admitted_only_with_its_generation_reserve(model):
    eng = engine(model, 10)
    pool = PoolArithmetic(eng, PAGE, GenerationReserve(8))  # 2 pages per request
    prompt = list(range(3, 15))  # 12 tokens: 3 pages
    assert pool.admit("a", prompt, 100, {}) is not None  # 3 + 2 of 10
    held = {"a": (12, 100)}
    assert pool.admit("b", list(range(20, 32)), 100, held) is not None  # 6 + 4 of 10
    held["b"] = (12, 100)
    free_before = pool.available()
    assert pool.admit("c", list(range(40, 44)), 100, held) is None  # 1 + 2 + 4 > 4 left
    assert pool.available() == free_before and "c" not in eng.held  # nothing kept
    # a short answer needs a short reserve: 1 page of prompt, 1 of output
    assert pool.admit("d", list(range(40, 44)), 1, held) is None  # still 1 + 1 + 4 > 4
    eng.release("b")
    del held["b"]
    assert pool.admit("c", list(range(40, 44)), 100, held) is not None


def test_running_requests_count_what_they_may_still_generate(model):
    eng = engine(model, 24)
    for i in range(2):
        eng.add(EngineRequest(f"run{i}", list(range(3 + 10 * i, 11 + 10 * i)),
                              SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)))
    eng.step()  # both prefilled: 8 tokens and a first one each, 39 more to come each
    assert len(eng.scheduler.running) == 2
    prompt = list(range(60, 64))  # 1 page, and 1 for its 4 new tokens
    # each running one may take ~10 more pages for 39 tokens: 2 + 2 x ~10 > the ~19 left
    assert PoolArithmetic(eng, PAGE, GenerationReserve(40)).admit("h", prompt, 4, {}) is None
    assert PoolArithmetic(eng, PAGE, GenerationReserve(8)).admit("h", prompt, 4, {}) is not None  # 2 + 2x~3
    eng.release("h")
    assert PoolArithmetic(eng, PAGE, GenerationReserve(0)).admit("h", prompt, 4, {}) is not None
