"""What both handoff machines share: the Event base and its clocks, Tick, the one way a machine
dispatches an event (a table from event type to handler), and the reporting view of a room:
its handoff state per side with their transition tables, HandoffDone (what a finished room
tells its role) and a page write's meta_info and stages.

A machine is pure: `step(event) -> effects`, no threads, no I/O, no clock. Every event carries
the times it happened at, so one sequence of events always gives the same effects; tests step
the machines by hand, the drivers (kv_sender, kv_receiver) feed them from the worker loop. (The
one clock here is the default of a standalone Handoff; a machine's rooms pass their times in.)

Handoff states, as reported:
Prefill: Bootstrapping -> WaitingForInput (the decode's destination metadata arrived)
         -> Transferring (writing KV pages, then aux) -> Success.
Decode:  Bootstrapping (resolving the prefill rank and topology, preallocating pages, sending
         the KvReq) -> WaitingForInput (KvReq sent) -> Success (KvDone: the pages landed).
The decode never sees the bytes move (every backend writes straight into its pool and the
KvDone follows the bytes), so it has no Transferring state.

Failed is reachable from every non-terminal state. Success and Failed are terminal: nothing
leaves them. "Failed wins": a caller that learns of both a failure and a success in the same
step applies the failure; `fail()` on an already failed handoff keeps the first reason (abort,
timeout and peer failure often race), while any move out of Success raises IllegalTransition.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Generic, Mapping, TypeVar

from ..core.timeline import Stage
from ..transfer.base import WriteResult

# ---- what both machines share: events and their dispatch ------------------------------------
Effect = TypeVar("Effect")  # what one side's machine asks its driver to do


@dataclass(frozen=True, kw_only=True)
class Event:
    """Something that happened, and when: `now` (time.monotonic()) for deadlines and a room's
    state times, `wall` (time.time()) for the stage stamps a room reports."""

    now: float = 0.0
    wall: float = 0.0


@dataclass(frozen=True)
class Tick(Event):
    """Time passed: deadlines, retries, reports of finished rooms."""


# (machine, event, effects out): a handler appends the step's effects to the list it is given
Handler = Callable[[Any, Any, list[Any]], None]


class HandoffMachine(Generic[Effect]):
    """`step` finds the handler of the event's exact type in the class's HANDLERS table and
    returns the effects it appended; an event the table lacks raises TypeError."""

    SIDE: ClassVar[str]  # "prefill" or "decode", for messages
    HANDLERS: ClassVar[Mapping[type[Event], Handler]]

    def step(self, ev: Event) -> list[Effect]:
        handler = self.HANDLERS.get(type(ev))
        if handler is None:
            raise TypeError(f"not a {self.SIDE} handoff event: {ev!r}")
        out: list[Effect] = []
        handler(self, ev, out)
        return out


# ---- the reporting view: handoff states per side ----------------------------------------------
class HandoffState(str, enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (HandoffState.SUCCESS, HandoffState.FAILED)


class Side(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


S = HandoffState
_F = S.FAILED
TRANSITIONS: dict[Side, dict[HandoffState, frozenset[HandoffState]]] = {
    Side.PREFILL: {
        S.BOOTSTRAPPING: frozenset({S.WAITING_FOR_INPUT, _F}),
        S.WAITING_FOR_INPUT: frozenset({S.TRANSFERRING, _F}),
        S.TRANSFERRING: frozenset({S.SUCCESS, _F}),
        S.SUCCESS: frozenset(),
        S.FAILED: frozenset(),
    },
    Side.DECODE: {
        S.BOOTSTRAPPING: frozenset({S.WAITING_FOR_INPUT, _F}),
        S.WAITING_FOR_INPUT: frozenset({S.SUCCESS, _F}),
        S.TRANSFERRING: frozenset(),  # not a decode state
        S.SUCCESS: frozenset(),
        S.FAILED: frozenset(),
    },
}


class IllegalTransition(RuntimeError):
    """A move the side's transition table forbids; a bug in the caller, never bad input."""


@dataclass
class Handoff:
    """One room's handoff on one side, with the monotonic time each state was entered."""

    room: int
    side: Side
    state: HandoffState = HandoffState.BOOTSTRAPPING
    reason: str = ""
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)
    created: float = field(default=0.0)
    entered: dict[HandoffState, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.entered:
            self.created = self.clock()
            self.entered[self.state] = self.created

    def can_move(self, to: HandoffState) -> bool:
        return to in TRANSITIONS[self.side][self.state]

    def advance(self, to: HandoffState) -> None:
        """Move forward to `to`; use `fail()` for Failed (it needs a reason)."""
        if to is HandoffState.FAILED:
            raise IllegalTransition(f"room {self.room} ({self.side.value}): use fail(reason) to fail")
        if not self.can_move(to):
            raise IllegalTransition(
                f"room {self.room} ({self.side.value}): illegal move {self.state.value} -> {to.value}"
                + (f" (failed: {self.reason})" if self.reason else ""))
        self._enter(to)

    def fail(self, reason: str) -> bool:
        """Move to Failed with `reason`. Returns False (first reason kept) if already failed."""
        if self.state is HandoffState.FAILED:
            return False
        if not self.can_move(HandoffState.FAILED):
            raise IllegalTransition(
                f"room {self.room} ({self.side.value}): cannot fail after {self.state.value}: {reason}")
        self.reason = reason
        self._enter(HandoffState.FAILED)
        return True

    def _enter(self, to: HandoffState) -> None:
        self.state = to
        self.entered[to] = self.clock()

    @property
    def done(self) -> bool:
        return self.state.terminal

    def durations(self) -> dict[str, float]:
        """Seconds spent in each state already left, keyed by state value, plus `total` when done."""
        order = list(self.entered.items())  # insertion order = visit order: states move forward
        out = {a.value: t2 - t1 for (a, t1), (_, t2) in zip(order, order[1:])}
        if self.done:
            out["total"] = self.entered[self.state] - self.created
        return out


A = TypeVar("A")


@dataclass
class HandoffDone(Generic[A]):
    """A finished room, as the sender or receiver reports it to its worker: success or the
    failure reason, the aux data (the prefill's PrefillFacts, the decode's KvDone), timings for
    meta_info, and stage times."""

    room: int
    rid: str
    ok: bool
    reason: str
    aux: A | None
    meta: dict[str, Any]
    stages: dict[str, float] = field(default_factory=dict)
    dropped: bool = False  # prefill: the decode prefilled the room itself (not a failure)


def write_meta(w: WriteResult) -> dict[str, float | int | None]:
    """A page write's meta_info keys, the same on both sides: kv_bytes, kv_transfer_s, kv_gbps."""
    secs = w.seconds
    return {"kv_bytes": w.bytes, "kv_transfer_s": secs, "kv_gbps": w.bytes / secs / 1e9 if secs > 0 else None}


def write_stages(w: WriteResult | None) -> dict[str, float]:
    """A page write's first and last KV byte stages of the timeline (none without a write)."""
    if w is None:
        return {}
    return {Stage.FIRST_KV_BYTE.value: w.started_at, Stage.LAST_KV_BYTE.value: w.finished_at}
