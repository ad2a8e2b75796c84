"""What a prefill rank remembers about rooms it holds no request for: notes, not rooms.

`early` (a KvReq that came before its request), `doomed` (rooms that cannot succeed here,
remembered for failed_ttl), `dropped` (a drop that came before the request), `routes` (rooms
homed here that the front sent to another rank) and `forwarded` (KvReqs passed on to their
holder, so later aborts follow them). The machine (prefill_machine) writes and reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..core.failures import FailureCause
from ..transfer.base import Endpoint
from . import wire


class Early(NamedTuple):
    """A KvReq that came before its request."""

    peer: Endpoint
    req: wire.KvReq
    since: float


class Doomed(NamedTuple):
    """A room that cannot succeed here, remembered for `failed_ttl`."""

    reason: str
    since: float
    cause: FailureCause


class Dropped(NamedTuple):
    """A drop that came before the room's request."""

    reason: str
    since: float


class Route(NamedTuple):
    """Where the front sent a room whose home is this rank."""

    rank: int
    endpoint: Endpoint
    since: float


class Forwarded(NamedTuple):
    """A KvReq this rank passed on to the holder; later aborts for the room follow it."""

    holder: Endpoint
    since: float


@dataclass
class RoomNotes:
    """The five kinds of note of one prefill rank, by room."""

    early: dict[int, Early] = field(default_factory=dict)
    doomed: dict[int, Doomed] = field(default_factory=dict)
    dropped: dict[int, Dropped] = field(default_factory=dict)
    routes: dict[int, Route] = field(default_factory=dict)
    forwarded: dict[int, Forwarded] = field(default_factory=dict)

    def holder(self, room: int) -> dict[str, Any] | None:
        """The endpoint of the rank that holds a room with no request here: where its KvReq
        was forwarded, else where the front routed it; None when neither is known."""
        if room in self.forwarded:
            return self.forwarded[room].holder
        return self.routes[room].endpoint if room in self.routes else None

    def overdue(self, now: float, bootstrap_timeout: float) -> list[int]:
        """Rooms whose early KvReq has waited longer than `bootstrap_timeout` for the request."""
        return [room for room, early in self.early.items() if now - early.since > bootstrap_timeout]

    def expire(self, now: float, bootstrap_timeout: float, failed_ttl: float) -> None:
        """Forget doomed and dropped rooms after `failed_ttl`, routes and forwards after
        `bootstrap_timeout` (by then the room has started its write or failed)."""
        tables: tuple[tuple[dict[int, Any], float], ...] = (
            (self.doomed, failed_ttl), (self.dropped, failed_ttl),
            (self.routes, bootstrap_timeout), (self.forwarded, bootstrap_timeout))
        for table, ttl in tables:
            for room, note in list(table.items()):
                if now - note.since > ttl:
                    del table[room]
