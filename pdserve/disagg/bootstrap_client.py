"""Synchronous client of a prefill's bootstrap service, for worker threads.

Addresses are "host:port" strings (see `bootstrap_addr`). Every call has a deadline; a failure
raises BootstrapError naming the address and the cause. Topologies and rank endpoints are
cached per address; a topology or /health reply with a new instance_id (the prefill restarted on
the same port) drops what was cached for that address. `get_topology(max_age_s=...)` first asks
/health when the address has been silent for longer, so a restart is noticed before the stale
endpoints are used.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, TypeVar

import httpx

from ..core.errors import HandoffFailed
from ..core.pd_vocab import DEFAULT_BOOTSTRAP_PORT, bootstrap_addr
from .bootstrap_table import RankInfo, Topology

__all__ = ["DEFAULT_BOOTSTRAP_PORT", "BootstrapClient", "BootstrapError", "bootstrap_addr"]
_RETRY_PAUSE_S = 0.05
T = TypeVar("T")


class BootstrapError(HandoffFailed):
    """A bootstrap call failed; `http_status` is the service's answer, None if none came."""

    def __init__(self, message: str, http_status: int | None = None):
        super().__init__(message)
        self.http_status = http_status


def _error_message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:200]


class BootstrapClient:
    """Talks to any number of bootstrap services; thread-safe."""

    def __init__(self, *, timeout: float = 10.0, token: str = "",
                 clock: Callable[[], float] = time.monotonic):
        self.timeout = timeout
        self._clock = clock
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(headers=headers, trust_env=False)
        self._lock = threading.Lock()
        self._topologies: dict[str, Topology] = {}
        self._endpoints: dict[tuple[str, int], RankInfo] = {}
        self._instances: dict[str, str] = {}  # addr -> last instance_id seen
        self._gone: dict[str, dict[int, str]] = {}  # addr -> dead ranks in its last /health answer
        self._heard: dict[str, float] = {}  # addr -> when it last answered 200

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "BootstrapClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- one HTTP call ----
    def _call(self, method: str, addr: str, path: str, *, timeout: float, **kw) -> httpx.Response:
        url = f"http://{addr}{path}"
        try:
            return self._http.request(method, url, timeout=max(timeout, 0.001), **kw)
        except httpx.HTTPError as e:
            raise BootstrapError(f"bootstrap {addr}: {method} {path} failed: "
                                 f"{type(e).__name__}: {e}") from e

    def _json(self, method: str, addr: str, path: str, *, timeout: float, **kw) -> object:
        resp = self._call(method, addr, path, timeout=timeout, **kw)
        if resp.status_code != 200:
            raise BootstrapError(f"bootstrap {addr}: {method} {path} answered {resp.status_code}: "
                                 f"{_error_message(resp)}", resp.status_code)
        with self._lock:
            self._heard[addr] = self._clock()
        try:
            return resp.json()
        except ValueError as e:
            raise BootstrapError(f"bootstrap {addr}: {method} {path} sent invalid JSON: {e}") from e

    def _retrying(self, what: str, addr: str, deadline_s: float, call: Callable[[float], object]) -> object:
        """Retry `call(remaining_s)` on no answer or 503 (not up yet) until the deadline."""
        end = self._clock() + deadline_s
        while True:
            remaining = end - self._clock()
            try:
                return call(min(self.timeout, max(remaining, 0.001)))
            except BootstrapError as e:
                if e.http_status not in (None, 503):
                    raise BootstrapError(f"{what}: {e}", e.http_status) from e
                if self._clock() + _RETRY_PAUSE_S >= end:
                    raise BootstrapError(f"{what}: no success within {deadline_s}s; last: {e}",
                                         e.http_status) from e
            time.sleep(_RETRY_PAUSE_S)

    # ---- API ----
    def register_rank(self, addr: str, info: RankInfo, *, deadline_s: float) -> str:
        """PUT /route, retrying until the service is up or `deadline_s` passed; -> the service's
        instance id ("" if it sent none)."""
        body = self._retrying(f"registering prefill dp_rank {info.dp_rank}", addr, deadline_s,
                              lambda t: self._json("PUT", addr, "/route", timeout=t, json=info.to_json()))
        instance = body.get("instance_id") if isinstance(body, dict) else None
        return instance if isinstance(instance, str) else ""

    def register_dp_rank(self, addr: str, room: int, rank: int) -> None:
        self._json("POST", addr, "/register_dp_rank", timeout=self.timeout,
                   json={"bootstrap_room": room, "dp_rank": rank})

    def fail_room(self, addr: str, room: int, reason: str) -> None:
        """POST /fail_room: this decode cannot take `room`'s KV; the prefill frees it at once."""
        self._json("POST", addr, "/fail_room", timeout=self.timeout,
                   json={"bootstrap_room": room, "reason": reason})

    def drop_room(self, addr: str, room: int, reason: str) -> None:
        """POST /drop_room: this decode prefilled `room` itself; the prefill ends it, moving nothing."""
        self._json("POST", addr, "/drop_room", timeout=self.timeout,
                   json={"bootstrap_room": room, "reason": reason})

    def get_topology(self, addr: str, *, deadline_s: float | None = None,
                     max_age_s: float | None = None) -> Topology:
        """The cached topology of `addr`, fetched (retrying on 503 until `deadline_s`) on a miss.
        With `max_age_s`, an address silent for longer is asked for /health first (a new instance
        drops the cache; no answer keeps it, and using it fails on its own)."""
        with self._lock:
            cached = self._topologies.get(addr)
            silent = self._clock() - self._heard.get(addr, float("-inf"))
        if cached is not None and max_age_s is not None and silent > max_age_s:
            self.health(addr, timeout=self.timeout if deadline_s is None else min(self.timeout, deadline_s))
            with self._lock:
                cached = self._topologies.get(addr)
        if cached is not None:
            return cached
        body = self._retrying(f"fetching the topology of {addr}", addr,
                              self.timeout if deadline_s is None else deadline_s,
                              lambda t: self._json("GET", addr, "/route?prefill_dp_rank=-1", timeout=t))
        topo = self._parse(addr, Topology.from_json, body)
        with self._lock:
            self._note_instance(addr, topo.instance_id)
            self._topologies[addr] = topo
        return topo

    def get_rank_endpoint(self, addr: str, rank: int) -> RankInfo:
        """Rank `rank`'s registration at `addr` (its transfer endpoint), cached."""
        with self._lock:
            cached = self._endpoints.get((addr, rank))
        if cached is not None:
            return cached
        body = self._json("GET", addr, f"/route?prefill_dp_rank={rank}", timeout=self.timeout)
        info = self._parse(addr, RankInfo.from_json, body)
        instance = body.get("instance_id") if isinstance(body, dict) else None
        with self._lock:
            if isinstance(instance, str):
                self._note_instance(addr, instance)
            self._endpoints[(addr, rank)] = info
        return info

    def query_dp_ranks(self, addr: str, rooms: list[int]) -> tuple[dict[int, int], dict[int, str]]:
        """One POST /query_dp_ranks: (found: room -> rank, failed: room -> reason); absent = not yet."""
        body = self._json("POST", addr, "/query_dp_ranks", timeout=self.timeout,
                          json={"bootstrap_rooms": list(rooms)})
        try:
            if not isinstance(body, dict):
                raise TypeError(f"expected a JSON object, got {type(body).__name__}")
            failed = {int(k): str(v) for k, v in (body.pop("failed", None) or {}).items()}
            found = {int(k): int(v) for k, v in body.items()}
        except (AttributeError, TypeError, ValueError) as e:
            raise BootstrapError(f"bootstrap {addr}: malformed /query_dp_ranks reply: {e!r}") from e
        return found, failed

    def health(self, addr: str, *, timeout: float | None = None) -> str | None:
        """The service's instance_id, or None if it does not answer healthily. A new instance_id
        drops what was cached for `addr`."""
        try:
            body = self._json("GET", addr, "/health", timeout=timeout or self.timeout)
        except BootstrapError:
            return None
        instance = body.get("instance_id") if isinstance(body, dict) else None
        if not isinstance(instance, str):
            return None
        gone = body.get("gone_ranks")
        with self._lock:
            self._note_instance(addr, instance)
            try:
                self._gone[addr] = {int(k): str(v) for k, v in (gone or {}).items()}
            except (AttributeError, TypeError, ValueError):
                self._gone[addr] = {}
        return instance

    def gone_ranks(self, addr: str) -> dict[int, str]:
        """DP ranks of `addr` whose worker died, as its last /health answer listed them."""
        with self._lock:
            return dict(self._gone.get(addr, {}))

    def invalidate(self, addr: str) -> None:
        """Forget the topology and rank endpoints cached for `addr`."""
        with self._lock:
            self._drop(addr)

    def _note_instance(self, addr: str, instance_id: str) -> None:
        if self._instances.get(addr, instance_id) != instance_id:
            self._drop(addr)
        self._instances[addr] = instance_id

    def _drop(self, addr: str) -> None:
        self._topologies.pop(addr, None)
        self._instances.pop(addr, None)
        for key in [k for k in self._endpoints if k[0] == addr]:
            del self._endpoints[key]

    @staticmethod
    def _parse(addr: str, parse: Callable[[object], T], body: object) -> T:
        try:
            return parse(body)
        except Exception as e:
            raise BootstrapError(f"bootstrap {addr}: malformed reply: {e}") from e
