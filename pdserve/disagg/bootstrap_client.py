"""Synchronous HTTP client of a prefill's bootstrap service, for worker threads; it keeps no
state about the servers it talks to (the decode's PrefillPeers does).

Addresses are "host:port" strings (see `bootstrap_addr`). Every call has a deadline; a failure
raises BootstrapError naming the address and the cause.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import httpx

from ..core.errors import HandoffFailed
from ..core.pd_vocab import DEFAULT_BOOTSTRAP_PORT, bootstrap_addr
from .bootstrap_table import RankInfo, Topology

__all__ = ["DEFAULT_BOOTSTRAP_PORT", "BootstrapClient", "BootstrapError", "Health", "bootstrap_addr"]
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


@dataclass(frozen=True)
class Health:
    """A /health answer: the service's instance id and the ranks whose worker died."""

    instance_id: str
    gone_ranks: dict[int, str]
    load_tokens: int | None = None  # prompt tokens queued or in flight there (None: not reported)


class BootstrapClient:
    """Talks to any number of bootstrap services; thread-safe (httpx.Client is)."""

    def __init__(self, *, timeout: float = 10.0, token: str = "",
                 clock: Callable[[], float] = time.monotonic):
        self.timeout = timeout
        self._clock = clock
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(headers=headers, trust_env=False)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "BootstrapClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- one HTTP call ----
    def _call(self, method: str, addr: str, path: str, *, timeout: float, **kw: Any) -> httpx.Response:
        url = f"http://{addr}{path}"
        try:
            return self._http.request(method, url, timeout=max(timeout, 0.001), **kw)
        except httpx.HTTPError as e:
            raise BootstrapError(f"bootstrap {addr}: {method} {path} failed: "
                                 f"{type(e).__name__}: {e}") from e

    def _json(self, method: str, addr: str, path: str, *, timeout: float, **kw: Any) -> object:
        resp = self._call(method, addr, path, timeout=timeout, **kw)
        if resp.status_code != 200:
            raise BootstrapError(f"bootstrap {addr}: {method} {path} answered {resp.status_code}: "
                                 f"{_error_message(resp)}", resp.status_code)
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

    def fetch_topology(self, addr: str, *, deadline_s: float | None = None) -> Topology:
        """GET /route?prefill_dp_rank=-1, retrying on no answer or 503 until `deadline_s`."""
        body = self._retrying(f"fetching the topology of {addr}", addr,
                              self.timeout if deadline_s is None else deadline_s,
                              lambda t: self._json("GET", addr, "/route?prefill_dp_rank=-1", timeout=t))
        return self._parse(addr, Topology.from_json, body)

    def fetch_rank(self, addr: str, rank: int) -> tuple[RankInfo, str]:
        """Rank `rank`'s registration at `addr` and the service's instance id ("" if none)."""
        body = self._json("GET", addr, f"/route?prefill_dp_rank={rank}", timeout=self.timeout)
        info = self._parse(addr, RankInfo.from_json, body)
        instance = body.get("instance_id") if isinstance(body, dict) else None
        return info, instance if isinstance(instance, str) else ""

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

    def health(self, addr: str, *, timeout: float | None = None) -> Health | None:
        """GET /health, or None if the service does not answer healthily."""
        try:
            body = self._json("GET", addr, "/health", timeout=timeout or self.timeout)
        except BootstrapError:
            return None
        if not isinstance(body, dict):
            return None
        instance = body.get("instance_id")
        if not isinstance(instance, str):
            return None
        try:
            gone = {int(k): str(v) for k, v in (body.get("gone_ranks") or {}).items()}
        except (AttributeError, TypeError, ValueError):
            gone = {}
        load = body.get("load_tokens")
        return Health(instance, gone, load if isinstance(load, int) and not isinstance(load, bool) else None)

    @staticmethod
    def _parse(addr: str, parse: Callable[[object], T], body: object) -> T:
        try:
            return parse(body)
        except Exception as e:
            raise BootstrapError(f"bootstrap {addr}: malformed reply: {e}") from e
