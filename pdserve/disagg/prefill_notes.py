"""What a prefill rank does with a decode's KvReq besides moving a room: the notes it keeps on
rooms it holds no request for, and the checks a KvReq must pass.

Notes, not rooms: `early` (a KvReq that came before its request), `doomed` (rooms that cannot
succeed here, remembered for failed_ttl), `dropped` (a drop that came before the request),
`routes` (rooms homed here that the front sent to another rank) and `forwarded` (KvReqs passed
on to their holder, so later aborts follow them). The machine (prefill_machine) writes and reads
them.

Checks: that a KvReq fits this rank (transfer backend, page size, KV dtype, model), names this
server's instance and a room that can still succeed here (not doomed); then, once its room is
here, that both legs got the same prompt (page counts, the key of the prefix the decode reuses).
Each says what is wrong in words, or None.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..core.failures import FailureCause
from ..core.page_keys import prefix_key
from ..transfer.base import Endpoint
from . import wire
from .local_facts import LocalFacts, compat_problem
from .prefill_rooms import PrefillRoom


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


# ---- the checks a KvReq must pass ---------------------------------------------------------
def kv_req_problem(msg: wire.KvReq, local: LocalFacts, dp_rank: int, instance_id: str,
                   doomed: dict[int, Doomed]) -> tuple[str | None, FailureCause]:
    """Why this rank cannot take `msg` at all, and the failure's cause; (None, INTERNAL) if it can.
    `instance_id` "" skips the instance check."""
    room = msg.room
    problem = compat_problem(local, msg)
    if problem is not None:
        return (f"room {room}: decode dp_rank {msg.decode_rank} cannot use prefill dp_rank "
                f"{dp_rank}: {problem}"), FailureCause.INCOMPATIBLE
    if instance_id and msg.prefill_instance and msg.prefill_instance != instance_id:
        return (f"room {room}: the decode resolved prefill dp_rank {dp_rank} on bootstrap "
                f"instance {msg.prefill_instance}, but this server is instance {instance_id}: "
                "the prefill restarted and lost the room"), FailureCause.PEER_GONE
    if room in doomed:
        return doomed[room].reason, doomed[room].cause
    return None, FailureCause.INTERNAL


def prompt_problem(r: PrefillRoom, req: wire.KvReq, page: int) -> str | None:
    """Why `req` does not fit room `r`'s prompt (`page`: tokens a page); None if it does."""
    need = -(-r.prompt_len // page) - req.reused_pages
    if len(req.dst_pages) != need or req.prompt_len != r.prompt_len:
        return (f"room {r.room}: decode sent {len(req.dst_pages)} pages (reusing "
                f"{req.reused_pages}) for {req.prompt_len} tokens, prefill has {r.prompt_len} "
                f"tokens ({need + req.reused_pages} pages): the two legs got different prompts")
    if req.reused_pages and not 0 < req.reused_pages <= r.prompt_len // page:
        return (f"room {r.room}: decode claims {req.reused_pages} reused pages of a "
                f"{r.prompt_len}-token prompt ({r.prompt_len // page} full pages)")
    if req.reused_pages and (r.prompt_ids is None or
                             prefix_key(r.prompt_ids, page, req.reused_pages) != req.reused_key):
        return (f"room {r.room}: decode dp_rank {req.decode_rank} holds {req.reused_pages} pages of "
                f"another prefix (key {req.reused_key[:16]}...) than this prompt's: prefix hash "
                "mismatch")
    return None
