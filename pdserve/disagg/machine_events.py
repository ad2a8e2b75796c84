"""What both handoff machines share: the Event base and its clocks, Tick, and the one way a
machine dispatches an event (a table from event type to handler).

A machine is pure: `step(event) -> effects`, no threads, no I/O, no clock. Every event carries
the times it happened at, so one sequence of events always gives the same effects; tests step
the machines by hand, the drivers (kv_sender, kv_receiver) feed them from the worker loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Generic, Mapping, TypeVar

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
