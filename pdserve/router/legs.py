"""One leg of a PD request: POST a body to one upstream and get its reply, or a LegError.

A leg counts itself in its upstream's `inflight` (and, given its DP rank, in `rank_inflight`) and
in the latency metric. Cancelling a leg (or closing an open stream) closes its connection, which
makes a pdserve server abort it.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass

import aiohttp

from .http1 import Http1Pool, Http1Response
from .metrics import RouterMetrics
from .pd_body import decode
from .upstream import Upstream

# statuses a leg may answer before any token that another pair may not (sglang-router's retry
# set less 429, which is back-pressure and handled apart): a lost worker, a failed handoff
RETRYABLE_STATUSES = frozenset({408, 500, 502, 503, 504})


class LegErrorKind(str, enum.Enum):
    CONNECTION = "connection"  # never connected, or the connection broke: retryable before streaming
    STATUS = "status"  # the server answered with status >= 400


class LegError(Exception):
    """A failed leg. `status` is what the client gets; `message` names the role and server;
    `sent` is the server's own JSON `error` object, when it sent one (the client gets its code,
    param and other fields as they were), `retry_after` its Retry-After header."""

    def __init__(self, upstream: Upstream, kind: LegErrorKind, status: int, message: str,
                 type: str = "upstream_error", sent: dict | None = None, retry_after: str | None = None):
        super().__init__(message)
        self.upstream, self.kind, self.status, self.message, self.type = upstream, kind, status, message, type
        self.sent, self.retry_after = sent, retry_after

    @property
    def retryable(self) -> bool:
        return self.kind is LegErrorKind.CONNECTION or self.status in RETRYABLE_STATUSES

    @property
    def server_down(self) -> bool:
        """The server itself looks gone (counts against its health), not just this request."""
        return self.kind is LegErrorKind.CONNECTION or self.status == 503


def upstream_error_object(raw: bytes) -> dict | None:
    """The `error` object of an OpenAI/pdserve-style error body, else None."""
    try:
        data = decode(raw)
    except Exception:
        return None
    err = data.get("error") if isinstance(data, dict) else None
    return err if isinstance(err, dict) else None


def upstream_error_text(raw: bytes) -> tuple[str, str | None]:
    """(message, type) out of an upstream error body: pdserve/OpenAI JSON, FastAPI detail, or text."""
    try:
        data = decode(raw)
    except Exception:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err)), err.get("type")
        for key in ("error", "detail", "message"):
            if data.get(key) is not None:
                return str(data[key]), None
    text = raw.decode("utf-8", errors="replace").strip()
    return (text[:1000] or "(empty body)"), None


def _connection_error(up: Upstream, exc: BaseException) -> LegError:
    return LegError(up, LegErrorKind.CONNECTION, 502,
                    f"{up.role.value} server {up.url} connection failed: {type(exc).__name__}: {exc}",
                    "upstream_connection_error")


# OSError covers UpstreamClosed (a broken connection or a bad reply) and refused connects.
_CONNECTION_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError)


@dataclass
class LegReply:
    status: int
    content_type: str
    body: bytes


class OpenStream:
    """A leg whose response headers (status < 400) and first body chunk have arrived."""

    def __init__(self, client: "LegClient", up: Upstream, resp: Http1Response, first: bytes, t0: float,
                 rank: int | None = None):
        self.client, self.upstream, self.resp, self.first_chunk, self._t0 = client, up, resp, first, t0
        self._rank = rank
        self._done = False

    @property
    def status(self) -> int:
        return self.resp.status

    @property
    def content_type(self) -> str:
        return self.resp.content_type or "text/event-stream"

    def at_eof(self) -> bool:
        return self.resp.at_eof()

    def fail(self, exc: BaseException) -> None:
        """Make the next next_chunk() raise `exc` at once (another leg failed)."""
        self.resp.set_exception(exc)

    async def next_chunk(self) -> bytes:
        """The next piece of body as it arrives; b"" at the end. Raises LegError if it breaks."""
        try:
            return await self.resp.read_chunk()
        except _CONNECTION_ERRORS as exc:
            raise _connection_error(self.upstream, exc) from None

    def close(self) -> None:
        """Release the leg; closes the connection unless the body was read to its end."""
        if not self._done:
            self._done = True
            self.resp.close()
            self.client._finished(self.upstream, self._t0, self._rank)


class LegClient:
    """HTTP to upstreams: the PD legs over our own keep-alive pools (http1.py), one per upstream;
    health and info GETs over the aiohttp session that `use_session` hands in once the loop runs."""

    def __init__(self, metrics: RouterMetrics, headers: dict[str, str], keepalive_s: float = 4.0,
                 connect_timeout_s: float = 10.0):
        self._session: aiohttp.ClientSession | None = None
        self._metrics, self._headers = metrics, headers
        self._keepalive_s, self._connect_timeout_s = keepalive_s, connect_timeout_s
        self._per_upstream: dict = {}  # url -> its latency histogram child
        self._pools: dict[str, Http1Pool] = {}

    def use_session(self, session: aiohttp.ClientSession) -> None:
        self._session = session

    def close(self) -> None:
        """Close the idle leg connections (busy ones close with their legs)."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def _latency(self, up: Upstream):
        latency = self._per_upstream.get(up.url)
        if latency is None:  # labels() costs microseconds; resolve once per upstream
            labels = (up.role.value, up.url)
            latency = self._metrics.upstream_latency.labels(*labels)
            # the in-flight gauge reads up.inflight when scraped: nothing to update per leg
            self._metrics.upstream_inflight.labels(*labels).set_function(lambda: up.inflight)
            self._per_upstream[up.url] = latency
        return latency

    def _started(self, up: Upstream, rank: int | None = None) -> float:
        up.inflight += 1
        if rank is not None:
            up.rank_inflight[rank] = up.rank_inflight.get(rank, 0) + 1
        return time.perf_counter()

    def _finished(self, up: Upstream, t0: float, rank: int | None = None) -> None:
        up.inflight -= 1
        if rank is not None:
            up.rank_inflight[rank] -= 1
        self._latency(up).observe(time.perf_counter() - t0)

    def _pool(self, up: Upstream) -> Http1Pool:
        pool = self._pools.get(up.url)
        if pool is None:
            pool = self._pools[up.url] = Http1Pool(up.url, self._keepalive_s, self._connect_timeout_s)
        return pool

    async def _post(self, up: Upstream, path: str, data: bytes, auth: str | None) -> Http1Response:
        pool = self._pool(up)
        # the client's own Authorization varies per client: build it each time, not in the cache
        head = pool.cached_head(path, self._headers) if auth is None else \
            pool.head(path, {**self._headers, "Authorization": auth})
        try:
            return await pool.post(head, data)
        except _CONNECTION_ERRORS as exc:
            self._metrics.upstream_errors.labels(up.role.value, up.url, "connection").inc()
            raise _connection_error(up, exc) from None

    async def _status_error(self, up: Upstream, resp: Http1Response) -> LegError:
        try:
            raw = await resp.read()
        except _CONNECTION_ERRORS:
            raw = b""
        message, etype = upstream_error_text(raw)
        self._metrics.upstream_errors.labels(up.role.value, up.url, "status").inc()
        return LegError(up, LegErrorKind.STATUS, resp.status,
                        f"{up.role.value} server {up.url} failed with status {resp.status}: {message}",
                        etype or "upstream_error", upstream_error_object(raw), resp.retry_after)

    async def fetch(self, up: Upstream, path: str, data: bytes, auth: str | None = None,
                    rank: int | None = None) -> LegReply:
        """POST and read the whole reply. `auth` overrides the Authorization header; `rank` is the
        DP rank the body pins (--dp-aware), counted in the upstream's per-rank in-flight."""
        t0 = self._started(up, rank)
        try:
            resp = await self._post(up, path, data, auth)
            try:
                if resp.status >= 400:
                    raise await self._status_error(up, resp)
                body = await resp.read()
            except _CONNECTION_ERRORS as exc:
                raise _connection_error(up, exc) from None
            finally:
                resp.close()
            return LegReply(resp.status, resp.content_type or "application/json", body)
        finally:
            self._finished(up, t0, rank)

    async def open_stream(self, up: Upstream, path: str, data: bytes, auth: str | None = None,
                          rank: int | None = None) -> OpenStream:
        """POST and wait for the headers and the first body chunk; the caller must close() it."""
        t0 = self._started(up, rank)
        try:
            resp = await self._post(up, path, data, auth)
        except BaseException:
            self._finished(up, t0, rank)
            raise
        stream = OpenStream(self, up, resp, b"", t0, rank)
        try:
            if resp.status >= 400:
                raise await self._status_error(up, resp)
            stream.first_chunk = await stream.next_chunk()
        except BaseException:
            stream.close()
            raise
        return stream

    async def get_json(self, url: str, timeout: float) -> dict:
        """GET a small JSON document (server_info, models); raises on any failure."""
        async with self._session.get(url, headers=self._headers,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            raw = await resp.read()
            if resp.status >= 400:
                raise RuntimeError(f"GET {url} -> {resp.status}: {upstream_error_text(raw)[0]}")
            data = decode(raw)
        if not isinstance(data, dict):
            raise RuntimeError(f"GET {url} did not return a JSON object")
        return data

    async def post_status(self, url: str, timeout: float) -> tuple[int, bytes]:
        """POST with no body (admin routes such as /flush_cache) -> (status, body)."""
        async with self._session.post(url, headers=self._headers,
                                      timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return resp.status, await resp.read()

    async def get_status(self, url: str, timeout: float) -> tuple[int, bytes]:
        async with self._session.get(url, headers=self._headers,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return resp.status, await resp.read()


async def cancel_task(task: asyncio.Task) -> bool:
    """Cancel a leg task and wait for it to unwind (it closes its connection).

    Returns True when the task was still running. The task's own error, if any, is consumed.
    """
    running = not task.done()
    if running:
        task.cancel()
        await asyncio.wait([task])
    consume(task)
    return running


def consume(task: asyncio.Task) -> None:
    """Mark a finished task's exception as retrieved (we report errors ourselves)."""
    if task.done() and not task.cancelled():
        task.exception()
