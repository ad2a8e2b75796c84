"""Handoff state machines: every (side, from, to) move is checked against the expected table."""

from __future__ import annotations

import itertools

import pytest

from pdserve.disagg.handoff import TRANSITIONS, Handoff, HandoffState, IllegalTransition, Side

B, W, T, OK, F = (HandoffState.BOOTSTRAPPING, HandoffState.WAITING_FOR_INPUT,
                  HandoffState.TRANSFERRING, HandoffState.SUCCESS, HandoffState.FAILED)

# Written out independently of the module's table, so a wrong table fails here.
EXPECTED_FORWARD = {
    Side.PREFILL: {(B, W), (W, T), (T, OK)},
    Side.DECODE: {(B, W), (W, OK)},
}
NON_TERMINAL = (B, W, T)
LIVE = {Side.PREFILL: (B, W, T), Side.DECODE: (B, W)}  # states each side can be in before the end


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def handoff_at(side: Side, state: HandoffState, clock: FakeClock | None = None) -> Handoff:
    """A handoff driven to `state` through legal moves only."""
    h = Handoff(room=7, side=side, clock=clock or FakeClock())
    path = {B: [], W: [W], T: [W, T], OK: [W, T, OK] if side is Side.PREFILL else [W, OK], F: []}[state]
    for s in path:
        h.advance(s)
    if state is F:
        h.fail("boom")
    assert h.state is state
    return h


ALL_MOVES = [(side, a, b) for side in Side for a, b in itertools.product(HandoffState, repeat=2)
             if not (side is Side.DECODE and a is T)]  # a decode never transfers


@pytest.mark.parametrize("side,src,dst", ALL_MOVES, ids=lambda v: getattr(v, "value", v))
def test_advance_follows_the_table(side, src, dst):
    h = handoff_at(side, src)
    if dst is F:
        with pytest.raises(IllegalTransition, match="fail"):
            h.advance(dst)  # Failed needs a reason: fail()
        return
    if (src, dst) in EXPECTED_FORWARD[side]:
        h.advance(dst)
        assert h.state is dst
    else:
        with pytest.raises(IllegalTransition) as e:
            h.advance(dst)
        assert "room 7" in str(e.value) and side.value in str(e.value)
        assert h.state is src


def test_table_matches_expectation_exactly():
    for side in Side:
        table = TRANSITIONS[side]
        assert set(table) == set(HandoffState)
        moves = {(a, b) for a, targets in table.items() for b in targets}
        assert moves == EXPECTED_FORWARD[side] | {(s, F) for s in LIVE[side]}


@pytest.mark.parametrize("side,src", [(side, s) for side in Side for s in LIVE[side]])
def test_fail_from_any_non_terminal_state(side, src):
    h = handoff_at(side, src)
    assert h.fail("peer gone") is True
    assert h.state is F and h.reason == "peer gone" and h.done


@pytest.mark.parametrize("side", list(Side))
def test_failed_is_sticky_and_keeps_first_reason(side):
    h = handoff_at(side, F)
    assert h.fail("second") is False
    assert h.reason == "boom"
    for dst in (B, W, T, OK):
        with pytest.raises(IllegalTransition):
            h.advance(dst)
    assert h.state is F


@pytest.mark.parametrize("side", list(Side))
def test_nothing_leaves_success(side):
    h = handoff_at(side, OK)
    with pytest.raises(IllegalTransition, match="cannot fail after success"):
        h.fail("late timeout")
    assert h.state is OK and h.reason == ""


def test_durations_from_entry_times():
    clock = FakeClock()
    h = Handoff(room=1, side=Side.PREFILL, clock=clock)
    assert h.created == 100.0 and h.durations() == {}
    clock.t = 100.5
    h.advance(W)
    clock.t = 101.0
    h.advance(T)
    assert h.durations() == {"bootstrapping": 0.5, "waiting_for_input": 0.5}
    clock.t = 103.0
    h.advance(OK)
    assert h.durations() == {"bootstrapping": 0.5, "waiting_for_input": 0.5, "transferring": 2.0,
                             "total": 3.0}
    assert h.entered[OK] == 103.0


def test_decode_can_skip_transferring():
    h = handoff_at(Side.DECODE, W)
    h.advance(OK)
    assert h.done and h.state is OK
