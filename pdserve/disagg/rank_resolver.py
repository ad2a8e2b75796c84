"""Decode side: which prefill DP rank holds a room, and that rank's transfer endpoint.

Runs the resolution order of docs/architecture.md (DP-rank rules) on a pool thread per room;
rooms that need the query path join the QueryBatcher's rounds (query_batcher.py). Each room
resolved gets one Resolved (a rank and endpoint, or an error naming room, server and cause, with
the wall-clock times of the topology lookup and of the resolution) through `on_result`, from
those threads, unless it was cancelled. Part of the decode's PrefillLink (prefill_link.py).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, cast

from ..core.failures import FailureCause
from .decode_events import Resolved
from .dp_rules import resolve_prefill_rank
from .prefill_peers import PrefillPeers
from .query_batcher import QueryBatcher


class RankResolver:
    """Resolves rooms against the prefills in `peers`; thread-safe."""

    def __init__(self, peers: PrefillPeers, *, decode_force: bool, topology_timeout: float,
                 query_timeout: float, on_result: Callable[[Resolved], None], threads: int = 4,
                 revalidate_after: float | None = None):
        self.peers = peers
        self.decode_force = decode_force
        self.topology_timeout = topology_timeout
        # a topology cached longer than this without word from its server is checked (/health)
        # before use: the prefill may have restarted on the same port
        self.revalidate_after = revalidate_after
        self.query_timeout = query_timeout
        self.on_result = on_result
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="resolve")
        self.batcher = QueryBatcher(peers, self._on_query_answer)
        self._started: dict[tuple[str, int], float] = {}
        self._instances: dict[tuple[str, int], tuple[str, float]] = {}  # query path: (instance, topology_at)
        self._lock = threading.Lock()

    def resolve(self, addr: str, room: int, hint: int | None) -> None:
        with self._lock:
            self._started[(addr, room)] = time.monotonic()
        self.pool.submit(self._job, addr, room, hint)

    def cancel(self, addr: str, room: int) -> None:
        self.batcher.cancel(addr, room)
        with self._lock:
            self._started.pop((addr, room), None)
            self._instances.pop((addr, room), None)

    def _job(self, addr: str, room: int, hint: int | None) -> None:
        try:
            topo = self.peers.topology(addr, deadline_s=self.topology_timeout, max_age_s=self.revalidate_after)
            topology_at = time.time()
            res = resolve_prefill_rank(topology=topo, hint=hint, room=room,
                                       decode_force=self.decode_force)
        except Exception as e:  # noqa: BLE001 - every room gets an answer
            return self._finish(Resolved(room, addr, error=f"room {room}: prefill {addr}: "
                                         f"{getattr(e, 'message', e)}"))
        if res.rank is None:
            with self._lock:
                self._instances[(addr, room)] = (topo.instance_id, topology_at)
            self.batcher.add(addr, room, time.monotonic() + self.query_timeout)
            return
        self._lookup(addr, room, res.rank, res.path, topo.instance_id, topology_at)

    def _on_query_answer(self, addr: str, room: int, rank: int | None, error: str | None,
                         cause: FailureCause = FailureCause.RESOLVE) -> None:
        with self._lock:
            instance_id, topology_at = self._instances.pop((addr, room), ("", 0.0))
        if error is not None:
            return self._finish(Resolved(room, addr, path="query", instance_id=instance_id, error=error,
                                         cause=cause, topology_at=topology_at))
        try:
            self.pool.submit(self._lookup, addr, room, cast(int, rank), "query", instance_id, topology_at)
        except RuntimeError:  # closed
            pass

    def _lookup(self, addr: str, room: int, rank: int, path: str, instance_id: str,
                topology_at: float = 0.0) -> None:
        try:
            info = self.peers.endpoint(addr, rank)
        except Exception as e:  # noqa: BLE001 - every room gets an answer
            return self._finish(Resolved(room, addr, rank, path, instance_id=instance_id,
                                         error=f"room {room}: prefill {addr} dp_rank {rank}: "
                                               f"{getattr(e, 'message', e)}", topology_at=topology_at))
        self._finish(Resolved(room, addr, rank, path, info, instance_id, topology_at=topology_at,
                              resolved_at=time.time()))

    def _finish(self, r: Resolved) -> None:
        with self._lock:
            t0 = self._started.pop((r.addr, r.room), None)
        if t0 is None:
            return  # cancelled
        r.seconds = time.monotonic() - t0
        self.on_result(r)

    def close(self, wait: bool = False) -> None:
        """Stop the query thread and the lookup threads; `wait` joins the latter."""
        self.batcher.close()
        self.pool.shutdown(wait=wait, cancel_futures=True)
