"""Admission of decode handoffs waiting for KV pages: the queue's bounds (HandoffQueue) and its
bookkeeping (Admission), which picks the room asked for pages next and says who is refused;
the machine (decode_machine) makes the moves.

The RESERVING rooms are a queue in arrival order. A Tick asks the first for pages (Reserve);
each PagesReserved that got them asks the next, so a later room never takes pages an earlier
one is waiting for. The first that gets none (the reserve function decides what fits: prompt
pages plus a reserve for generation) stops the round: it and every room behind it is queued
(`queued_at`). A room that would make the queue longer than `max_queued`, or has been queued
longer than `timeout`, is refused: FAILED with cause no_pages and `refused` set (the worker
answers 429 and the router tries another decode), and the prefill is told `tell_prefill_after`
later (see `Admission.tell_later`); a DecodeAccept while the queue is full is refused at once,
before any resolution. A room's deadline check runs after its attempt, so a reservation is
always tried before the deadline is.
"""

from __future__ import annotations

from dataclasses import dataclass

from .decode_events import DecodeEffect, Reserve
from .decode_rooms import DecodeRoom, DecodeState

D = DecodeState


@dataclass(frozen=True)
class HandoffQueue:
    """Admission of handoffs waiting for KV pages: at most `max_queued` rooms wait (None: no
    bound; 0: a room that does not fit at once is refused), each at most `timeout` seconds
    (None: only the waiting deadline); `retry_after` is what a refusal tells the client."""

    max_queued: int | None = None
    timeout: float | None = None
    retry_after: int = 1
    tell_prefill_after: float = 0.5  # see Admission.tell_later


class Admission:
    """The admission queue of one decode machine: this tick's round (the RESERVING rooms not yet
    asked, in arrival order), the refusals so far, and the word refused rooms owe their prefill.
    It reads the machine's rooms and keeps their queue fields; only the machine moves them."""

    def __init__(self, queue: HandoffQueue, rooms: dict[int, DecodeRoom]):
        self.queue = queue
        self.rooms = rooms  # the machine's own dict
        self.refused: dict[str, int] = {"queue_full": 0, "timeout": 0}  # refusals since start, by why
        self._round: list[int] = []  # RESERVING rooms this tick's round has not asked yet, in order
        self._deferred: list[tuple[float, DecodeEffect]] = []  # (due, effect): refused rooms' word

    def queued(self) -> int:
        """Rooms in the admission queue (RESERVING, found no pages at least once)."""
        return sum(1 for r in self.rooms.values() if r.state is D.RESERVING and r.queued_at is not None)

    def full(self) -> bool:
        """A new room is refused before its resolution: rooms are queued, as many as the bound."""
        limit, waiting = self.queue.max_queued, self.queued()
        return limit is not None and waiting > 0 and waiting >= limit

    def due(self, now: float) -> list[DecodeEffect]:
        """The deferred effects whose time has come, each given once."""
        due = [e for t, e in self._deferred if t <= now]
        if due:
            self._deferred = [(t, e) for t, e in self._deferred if t > now]
        return due

    def start_round(self, rooms: list[int]) -> None:
        """A Tick: these RESERVING rooms, in arrival order, are asked for pages one at a time."""
        self._round = list(rooms)

    def ask_next(self) -> Reserve | None:
        """Pages for the first room of this round that is still RESERVING (None: round over)."""
        while self._round:
            r = self.rooms.get(self._round.pop(0))
            if r is not None and r.state is D.RESERVING:
                return Reserve(r.room, r.rid, r.prompt_len)
        return None

    def stop_round(self) -> list[DecodeRoom]:
        """A room found no pages: the round ends here; the rooms it had not asked, in order."""
        behind = [self.rooms[n] for n in self._round if n in self.rooms]
        self._round = []
        return behind

    def verdict(self, r: DecodeRoom, now: float) -> str | None:
        """`r` found no pages this round: None when it joins (or stays in) the queue, else why it
        is refused: "queue_full" (the queue is at its bound) or "timeout" (it waited too long)."""
        q = self.queue
        if r.queued_at is None:
            if q.max_queued is not None and self.queued() >= q.max_queued:
                return "queue_full"
            r.queued_at = now
        elif q.timeout is not None and now - r.queued_at > q.timeout:
            return "timeout"
        return None

    def refuse(self, r: DecodeRoom, why: str) -> str:
        """Count the refusal of `r` and mark it refused (a 429, not an error); returns the why in
        words for its client."""
        q = self.queue
        waiting = self.queued() - (r.queued_at is not None and r.state is D.RESERVING)
        if why == "queue_full":
            detail = (f"its admission queue is full ({waiting} handoffs waiting for KV pages, "
                      f"--max-queued-handoffs {q.max_queued})")
        else:
            detail = (f"no KV pages within {q.timeout:g}s (--handoff-queue-timeout; {waiting} more "
                      "handoffs waiting)")
        r.refused = why
        self.refused[why] += 1
        return detail

    def tell_later(self, now: float, tell: DecodeEffect) -> None:
        """Carry out `tell` (a refused room's word to its prefill) `tell_prefill_after` from now,
        so that a router hears this decode's 429 and retries on another pair before the
        prefill's echo of it (a 5xx) arrives; a router cancels the prefill leg itself anyway."""
        self._deferred.append((now + self.queue.tell_prefill_after, tell))
