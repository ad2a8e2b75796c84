"""Overload protection of a server front: a cap on request body size (413) and admission control
(429 with Retry-After), so that overload is refused early instead of timing out late.

Admission: at most `max_concurrent` generation requests run at once; up to `max_queued` more
wait in arrival order for a slot, each for at most `queue_timeout_s`. A request beyond the
queue, or one whose wait runs out, is refused with 429 and `Retry-After`. A slot is held from
admission until the reply (or stream) ends, and passes straight to the oldest waiter.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from ..core.config import ServerConfig
from ..core.errors import Overloaded, PDServeError

RETRY_AFTER_S = 1


class RequestTooLarge(PDServeError):
    status = 413
    type = "request_too_large"


class Refused(Overloaded):
    """429: the server is full; `retry_after` (seconds) goes out as the Retry-After header."""

    def __init__(self, message: str, retry_after: int = RETRY_AFTER_S):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class AdmissionLimits:
    max_concurrent: int  # 0 = no limit
    max_queued: int
    queue_timeout_s: float

    @classmethod
    def from_config(cls, cfg: ServerConfig) -> "AdmissionLimits":
        return cls(cfg.max_concurrent_requests, cfg.max_queued_requests, cfg.queue_timeout)


class Slot:
    """One admitted request; `release()` (idempotent) hands the slot on."""

    def __init__(self, admission: "Admission | None"):
        self._admission = admission

    def release(self) -> None:
        if self._admission is not None:
            admission, self._admission = self._admission, None
            admission._release()


class Admission:
    """Counts running requests and queues the rest; used on the event loop only."""

    def __init__(self, limits: AdmissionLimits):
        self.limits = limits
        self.running = 0
        self.queued = 0
        self.refused = 0
        self._waiters: deque[asyncio.Future] = deque()

    async def acquire(self) -> Slot:
        """A slot now, or after a wait in the queue; Refused (429) when full or the wait runs out."""
        lim = self.limits
        if lim.max_concurrent <= 0:
            return Slot(None)
        if self.running < lim.max_concurrent and not self.queued:
            self.running += 1
            return Slot(self)
        if self.queued >= lim.max_queued:
            raise self._refuse(f"the server is full: {self.running} requests running, {self.queued} "
                               f"queued (--max-concurrent-requests {lim.max_concurrent}, "
                               f"--max-queued-requests {lim.max_queued})")
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self.queued += 1
        try:
            await asyncio.wait_for(fut, lim.queue_timeout_s)
        except asyncio.TimeoutError:
            raise self._refuse(f"the server is overloaded: no free slot within {lim.queue_timeout_s:g}s "
                               f"(--queue-timeout); {self.running} requests running, "
                               f"{self.queued - 1} more queued") from None
        except BaseException:
            if fut.done() and not fut.cancelled():  # a slot came as the caller went away
                self._release()
            raise
        finally:
            self.queued -= 1
        return Slot(self)

    def _refuse(self, message: str) -> Refused:
        self.refused += 1
        return Refused(message)

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():  # a waiter that timed out or left is skipped
                fut.set_result(None)
                return
        self.running -= 1

    def stats(self) -> dict:
        return {"running": self.running, "queued": self.queued, "refused": self.refused,
                **{k: getattr(self.limits, k) for k in ("max_concurrent", "max_queued", "queue_timeout_s")}}


class BodyLimit:
    """ASGI middleware: a body over `max_bytes` gets 413, by Content-Length up front or, for a
    chunked body, as soon as the bytes read pass the limit (it is never held in memory whole)."""

    def __init__(self, app, max_bytes: int, error_response):
        self.app = app
        self.max_bytes = max_bytes
        self.error_response = error_response  # PDServeError -> ASGI response

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.max_bytes <= 0:
            return await self.app(scope, receive, send)
        limit = self.max_bytes
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            resp = self.error_response(RequestTooLarge(
                f"request body of {int(length)} bytes is over the limit of {limit} bytes (--max-request-bytes)"))
            return await resp(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise RequestTooLarge(f"request body is over the limit of {limit} bytes "
                                          "(--max-request-bytes)")
            return msg
        await self.app(scope, counted, send)
