"""What a decode's receiver and its link to the prefill servers say to each other.

The receiver (kv_receiver.DecodeReceiver) owns an `Inbox`: events for its machine that come
from other threads, stepped on the worker loop thread. The link (prefill_link.PrefillLink, or a
test's stand-in) is a `PeerLink`: it carries out the machine's effects that concern the prefill
servers (Resolve, CancelResolve, Invalidate, GiveUp) without blocking the caller, and posts what
it learns (RankResolved, PeerGone, PeerAlive) into the inbox it was bound to. It also counts the
addresses with rooms in flight, which are the ones its heartbeat watches.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections import Counter
from typing import Callable, Union

from .decode_events import CancelResolve, GiveUp, Invalidate, Resolve
from .handoff import Event

LinkEffect = Union[Resolve, CancelResolve, Invalidate, GiveUp]
LINK_EFFECTS = (Resolve, CancelResolve, Invalidate, GiveUp)  # the effects a receiver hands its link


class Inbox:
    """Events for one decode machine from any thread, in order; each post wakes the loop. The
    poster leaves `now` unset: the receiver stamps it when it steps the event."""

    def __init__(self, wake: Callable[[], None] = lambda: None):
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._wake = wake

    def post(self, ev: Event) -> None:
        self._events.put(ev)
        self._wake()

    def drain(self) -> list[Event]:
        """Every event posted so far, oldest first."""
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out


class PeerLink(ABC):
    """A decode worker's link to the prefill servers it takes KV from.

    Contract: `bind` is called once, by the receiver built on the link, before any effect;
    `execute` returns at once (the work runs on the link's threads) and every Resolve gets
    exactly one RankResolved in the inbox unless it is cancelled first; `watch`/`unwatch` are
    counted per address (one watch per room accepted, one unwatch when its pages are free)."""

    def __init__(self) -> None:
        self._watch_lock = threading.Lock()
        self._watching: Counter[str] = Counter()

    @abstractmethod
    def bind(self, inbox: Inbox) -> None:
        """Where this link's events go from now on."""

    @abstractmethod
    def execute(self, effect: LinkEffect) -> None:
        """Carry out one of the machine's effects on the prefill side (non-blocking)."""

    def watch(self, addr: str) -> None:
        """A room waits on prefill `addr`: watch it (heartbeats) until the matching unwatch."""
        with self._watch_lock:
            self._watching[addr] += 1

    def unwatch(self, addr: str) -> None:
        with self._watch_lock:
            self._watching[addr] -= 1
            if self._watching[addr] <= 0:
                del self._watching[addr]

    def watched(self) -> set[str]:
        """The addresses with rooms in flight (thread-safe snapshot)."""
        with self._watch_lock:
            return set(self._watching)

    def close(self) -> None:
        """Stop the link's threads."""
