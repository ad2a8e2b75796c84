"""Decode side: watch the bootstrap /health of every prefill server with rooms in flight.

Each beat goes through PrefillPeers, which records the answer (instance, gone ranks, load) or
counts a miss. A server that misses `max_failures` beats in a row is marked gone there (new
rooms naming it then fail at once) and posted as PeerGone; DP ranks whose worker died (its
/health lists them) as PeerGone with those ranks. Every answer is posted as PeerAlive with the
instance id: the decode machine knows which instance each room was resolved against, so a
restart fails exactly the rooms the old instance held, however long the decode was idle.
Part of the decode's PrefillLink (prefill_link.py).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from .decode_events import PeerAlive, PeerGone
from .handoff import Event
from .prefill_peers import PrefillPeers

log = logging.getLogger(__name__)
BEAT_TIMEOUT_S = 5.0  # one /health call waits at most this long (or the interval, if shorter)


class Heartbeat:
    """One thread beating every `watched()` address each `interval` seconds until close()."""

    def __init__(self, peers: PrefillPeers, *, interval: float, max_failures: int,
                 watched: Callable[[], set[str]], post: Callable[[Event], None]):
        self.peers = peers
        self.interval = interval
        self.max_failures = max(1, max_failures)
        self.watched = watched  # thread-safe snapshot of addresses with rooms in flight
        self.post = post  # where PeerGone / PeerAlive go (the receiver's inbox)
        self._watched_before: set[str] = set()
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="pd-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop_event.wait(self.interval):
            try:
                self.beat_all()
            except Exception:  # noqa: BLE001 - a bad beat must not stop the watch
                log.exception("heartbeat round failed")

    def beat_all(self) -> None:
        """One beat to every watched address; an address no longer watched starts from 0 misses."""
        addrs = self.watched()
        for addr in addrs:
            self.beat(addr)
        self._watched_before, unwatched = addrs, self._watched_before - addrs
        for addr in unwatched:
            self.peers.reset_misses(addr)

    def beat(self, addr: str) -> None:
        health = self.peers.beat(addr, timeout=min(self.interval, BEAT_TIMEOUT_S))
        if health is None:
            n = self.peers.misses(addr)
            if n >= self.max_failures:
                self.peers.reset_misses(addr)
                reason = (f"prefill bootstrap {addr} missed {n} heartbeats ({self.interval:.1f}s apart): "
                          "prefill server is gone")
                self.peers.mark_gone(addr, reason)
                self.post(PeerGone(addr, reason))
            return
        self.post(PeerAlive(addr, health.instance_id))
        gone = health.gone_ranks
        if gone:
            self.post(PeerGone(addr, "; ".join(f"prefill {addr} dp_rank {rank} is gone: {why}"
                                               for rank, why in sorted(gone.items())),
                               ranks=frozenset(gone)))

    def close(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=2)
