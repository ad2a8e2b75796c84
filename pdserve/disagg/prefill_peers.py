"""Decode side: everything a decode worker knows about each prefill server, in one owner per
address: its topology, its ranks' endpoints, the instance id they came from, when it last
answered, missed heartbeats, the ranks whose worker died, and the load it last reported.

Thread-safe: the resolver's threads, the query batcher and the heartbeat share one PrefillPeers.
An answer with a new instance id (the prefill restarted on the same port) drops the topology
and endpoints learned from the old one. `topology(max_age_s=...)` first asks /health when the
server has been silent for longer, so a restart is noticed before stale endpoints are used; a
server the heartbeat gave up (`mark_gone`) fails new rooms at once unless it answers again, but
only one that answered before: a server never reached is retried until each room's deadline.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .bootstrap_client import BootstrapClient, BootstrapError, Health
from .bootstrap_table import RankInfo, Topology

GONE_RECHECK_S = 1.0  # a new room naming a prefill given up asks its /health this long, once


@dataclass
class PrefillPeer:
    """One prefill server as this decode knows it."""

    addr: str
    topology: Topology | None = None
    endpoints: dict[int, RankInfo] = field(default_factory=dict)
    instance_id: str = ""  # of the topology and endpoints held here
    heard: float = float("-inf")  # when it last answered (monotonic)
    misses: int = 0  # heartbeats in a row without an answer
    gone_ranks: dict[int, str] = field(default_factory=dict)  # from its last /health
    load_tokens: int | None = None  # prompt tokens queued or in flight there, from its last /health
    gone: str = ""  # why the heartbeat gave it up ("" = not given up, or heard from since)


class PrefillPeers:
    def __init__(self, client: BootstrapClient, clock: Callable[[], float] = time.monotonic):
        self.client = client
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: dict[str, PrefillPeer] = {}

    def _peer(self, addr: str) -> PrefillPeer:  # under the lock
        peer = self._peers.get(addr)
        if peer is None:
            peer = self._peers[addr] = PrefillPeer(addr)
        return peer

    def _answered(self, addr: str, instance_id: str) -> PrefillPeer:  # under the lock
        peer = self._peer(addr)
        if instance_id and peer.instance_id and instance_id != peer.instance_id:
            peer.topology, peer.endpoints = None, {}  # learned from an instance that is gone
        if instance_id:
            peer.instance_id = instance_id
        peer.heard, peer.misses, peer.gone = self._clock(), 0, ""
        return peer

    # ---- lookups (resolver threads) --------------------------------------------------------
    def topology(self, addr: str, *, deadline_s: float | None = None,
                 max_age_s: float | None = None) -> Topology:
        """The topology of `addr`, fetched on a miss (retrying on 503 until `deadline_s`). A
        server the heartbeat gave up is asked /health once first: if it still does not answer,
        BootstrapError at once with the heartbeat's reason, not a wait for the deadline (a server
        never reached is still retried: it may be starting)."""
        with self._lock:
            gone = self._peer(addr).gone
        if gone and self.beat(addr, timeout=min(self.client.timeout, GONE_RECHECK_S)) is None:
            raise BootstrapError(gone)
        with self._lock:
            peer = self._peer(addr)
            cached, silent = peer.topology, self._clock() - peer.heard
        if cached is not None and max_age_s is not None and silent > max_age_s:
            self.beat(addr, timeout=self.client.timeout if deadline_s is None else min(self.client.timeout,
                                                                                     deadline_s))
            with self._lock:
                cached = self._peer(addr).topology
        if cached is not None:
            return cached
        topo = self.client.fetch_topology(addr, deadline_s=deadline_s)
        with self._lock:
            self._answered(addr, topo.instance_id).topology = topo
        return topo

    def endpoint(self, addr: str, rank: int) -> RankInfo:
        """Rank `rank`'s registration at `addr` (its transfer endpoint), fetched on a miss."""
        with self._lock:
            cached = self._peer(addr).endpoints.get(rank)
        if cached is not None:
            return cached
        info, instance = self.client.fetch_rank(addr, rank)
        with self._lock:
            self._answered(addr, instance).endpoints[rank] = info
        return info

    def query_dp_ranks(self, addr: str, rooms: list[int]) -> tuple[dict[int, int], dict[int, str]]:
        found_failed = self.client.query_dp_ranks(addr, rooms)
        with self._lock:
            self._answered(addr, "")
        return found_failed

    def mark_gone(self, addr: str, reason: str) -> bool:
        """The heartbeat gave `addr` up: forget what it said, and fail new rooms naming it at
        once with `reason` until it answers again (topology). A server never heard from is not
        marked (-> False): it may still be starting, so new rooms retry it until their deadline."""
        with self._lock:
            peer = self._peer(addr)
            peer.topology, peer.endpoints = None, {}
            if peer.heard == float("-inf"):
                return False
            peer.gone = reason
            return True

    def invalidate(self, addr: str) -> None:
        """Forget the topology and endpoints of `addr` (e.g. a send to a cached endpoint failed)."""
        with self._lock:
            peer = self._peer(addr)
            peer.topology, peer.endpoints = None, {}

    # ---- liveness (heartbeat thread) -------------------------------------------------------
    def beat(self, addr: str, *, timeout: float | None = None) -> Health | None:
        """Ask /health once; -> its answer (recorded), or None after counting a miss."""
        health = self.client.health(addr, timeout=timeout)
        with self._lock:
            if health is None:
                self._peer(addr).misses += 1
                return None
            peer = self._answered(addr, health.instance_id)
            peer.gone_ranks = dict(health.gone_ranks)
            peer.load_tokens = health.load_tokens
        return health

    def misses(self, addr: str) -> int:
        with self._lock:
            return self._peer(addr).misses

    def reset_misses(self, addr: str) -> None:
        with self._lock:
            self._peer(addr).misses = 0

    def gone_ranks(self, addr: str) -> dict[int, str]:
        """DP ranks of `addr` whose worker died, as its last /health answer listed them."""
        with self._lock:
            return dict(self._peer(addr).gone_ranks)

    def load_tokens(self, addr: str) -> int | None:
        """Prompt tokens `addr` last reported queued or in flight (None if never heard)."""
        with self._lock:
            return self._peer(addr).load_tokens

    def snapshot(self, addr: str) -> PrefillPeer:
        """A copy of what is known of `addr` (for tests and server_info)."""
        with self._lock:
            p = self._peer(addr)
            return PrefillPeer(p.addr, p.topology, dict(p.endpoints), p.instance_id, p.heard, p.misses,
                               dict(p.gone_ranks), p.load_tokens, p.gone)
