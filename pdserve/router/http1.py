"""A small HTTP/1.1 keep-alive client on asyncio protocols (httptools' C parser), for the PD legs.

Why not aiohttp's client: it was the router's largest CPU share (~28 %); a leg only needs to
POST a body and read the reply whole or chunk by chunk (`router_bench --client-ab` compares the
two). Closing a response before its end closes its connection, which makes the server abort.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
import time
from urllib.parse import urlparse

import httptools

PAUSE_READING_BYTES = 256 * 1024  # stop reading a streamed reply the caller does not consume


class UpstreamClosed(ConnectionError):
    """The connection broke before the reply ended, or the reply was not valid HTTP."""


class Http1Response:
    """One reply: status and Content-Type once the headers are in, then the body as it arrives."""

    __slots__ = ("status", "content_type", "retry_after", "_conn", "_chunks", "_buffered", "_complete", "_keep_alive",
                 "_headers_done", "_framed", "_error", "_waiter", "_released")

    def __init__(self, conn: "_Connection"):
        self.status = 0
        self.content_type: str | None = None
        self.retry_after: str | None = None  # a 429's or 503's Retry-After, passed on to the client
        self._conn = conn
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._complete = self._keep_alive = self._headers_done = self._framed = self._released = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = self._conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def set_exception(self, exc: BaseException) -> None:
        """Make the next read raise `exc` (used to wake a reader with another leg's failure)."""
        self._error = exc
        self._wake()

    def at_eof(self) -> bool:
        return self._complete and not self._chunks

    async def wait_headers(self) -> None:
        while not self._headers_done:
            if self._error is not None:
                raise self._error
            await self._wait()

    async def read_chunk(self) -> bytes:
        """The body received since the last call (waits for some); b"" at the end."""
        while True:
            if self._error is not None:
                raise self._error
            if self._chunks:
                data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
                self._chunks.clear()
                self._buffered = 0
                self._conn.resume()
                return data
            if self._complete:
                return b""
            await self._wait()

    async def read(self) -> bytes:
        """The whole body."""
        while not self._complete:
            if self._error is not None:
                raise self._error
            self._buffered = 0  # reading it all anyway: keep the socket going
            self._conn.resume()
            await self._wait()
        if self._error is not None:
            raise self._error
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data

    def close(self) -> None:
        """Give the connection back when the reply was read to its end and may be reused, else close it."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        conn.response = None
        if self._complete and self._keep_alive and self._error is None and not conn.closed:
            conn.resume()
            conn.pool._release(conn)
        else:
            conn.close()
            if self._error is None:  # a reader still waiting must not hang
                self._error = UpstreamClosed("response closed before its end")
                self._wake()


class _Connection(asyncio.Protocol):
    """One keep-alive connection; feeds received bytes to the parser, which fills `response`."""

    def __init__(self, pool: "Http1Pool"):
        self.pool, self.loop = pool, pool.loop
        self.transport: asyncio.Transport | None = None
        self.response: Http1Response | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = self.paused = False
        self.idle_since = 0.0

    def resume(self) -> None:
        if self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    # ---- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: the connection is out of step
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamClosed(f"bad HTTP reply from {self.pool.authority}: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        resp = self.response
        if resp is not None and not resp._complete:
            if resp._headers_done and not resp._framed:  # a body that runs until the connection closes
                resp._complete = True
                resp._wake()
            else:
                self._fail(UpstreamClosed(f"{self.pool.authority} closed the connection"
                                          + (f": {exc}" if exc else "")))

    def _fail(self, exc: BaseException) -> None:
        resp = self.response
        if resp is not None and resp._error is None and not resp._complete:
            resp._error = exc
            resp._wake()

    # ---- httptools callbacks ----------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self.response
        name = name.lower()
        if name == b"content-type":
            resp.content_type = value.decode("latin-1")
        elif name == b"content-length" or name == b"transfer-encoding":
            resp._framed = True
        elif name == b"retry-after":
            resp.retry_after = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        resp = self.response
        resp.status = self.parser.get_status_code()
        if resp.status < 200:  # an interim 1xx reply; the real one follows
            resp.content_type, resp.retry_after, resp._framed = None, None, False
            return
        resp._headers_done = True
        resp._wake()

    def on_body(self, body: bytes) -> None:
        resp = self.response
        resp._chunks.append(body)
        resp._buffered += len(body)
        if resp._buffered > PAUSE_READING_BYTES and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        resp._wake()

    def on_message_complete(self) -> None:
        resp = self.response
        if resp.status < 200:
            return
        resp._keep_alive = self.parser.should_keep_alive()
        resp._complete = True
        resp._wake()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            if self.transport is not None:
                self.transport.close()


class Http1Pool:
    """Keep-alive connections to one server (`http://host:port[/prefix]`), opened on demand, no limit."""

    def __init__(self, base_url: str, keepalive_s: float, connect_timeout_s: float, user_agent: str = "pdserve-router"):
        url = urlparse(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.loop = asyncio.get_running_loop()
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.authority = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        self.ssl = ssl_module.create_default_context() if url.scheme == "https" else None
        self.prefix = url.path.rstrip("/")
        self.keepalive_s, self.connect_timeout_s = keepalive_s, connect_timeout_s
        self._common = f"Host: {self.authority}\r\nUser-Agent: {user_agent}\r\n"
        self._heads: dict[tuple[str, str | None], bytes] = {}
        self._idle: list[_Connection] = []  # oldest first
        self._sweeper: asyncio.TimerHandle | None = None  # closes idle connections past keepalive_s

    def head(self, path: str, headers: dict[str, str]) -> bytes:
        """The request head of a POST up to the Content-Length value."""
        if any("\r" in kv or "\n" in kv for item in headers.items() for kv in item):
            raise ValueError("header names and values must not contain line breaks")
        lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        return f"POST {self.prefix}{path} HTTP/1.1\r\n{self._common}{lines}Content-Length: ".encode("latin-1")

    def cached_head(self, path: str, headers: dict[str, str]) -> bytes:
        """head() for the router's own fixed headers, built once per path."""
        key = (path, headers.get("Authorization"))
        head = self._heads.get(key)
        if head is None:
            head = self._heads[key] = self.head(path, headers)
        return head

    async def post(self, head: bytes, body: bytes) -> Http1Response:
        """Send head (from head()) and body; return once the reply's headers are in.

        Cancelled or failed before that, the connection is closed (the server aborts the request).
        """
        conn = self._take_idle() or await self._connect()
        resp = conn.response = Http1Response(conn)
        conn.transport.write(b"%s%d\r\n\r\n%s" % (head, len(body), body))
        try:
            await resp.wait_headers()
        except BaseException:
            resp.close()
            raise
        return resp

    def _take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
            older, self._idle = self._idle, []
            for old in older:  # older still: all expired
                old.close()
        return None

    async def _connect(self) -> _Connection:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await self.loop.create_connection(
                    lambda: _Connection(self), self.host, self.port, ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None)
        except TimeoutError:
            raise UpstreamClosed(f"connecting to {self.authority} timed out after "
                                 f"{self.connect_timeout_s:g}s") from None
        return conn

    def _release(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.append(conn)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(self.keepalive_s, self._sweep)

    def _sweep(self) -> None:
        """Close the idle connections older than keepalive_s (the servers keep theirs far longer,
        75 s for pdserve's: without this an idle router would hold its peak pool that long)."""
        self._sweeper = None
        now = time.monotonic()
        while self._idle and now - self._idle[0].idle_since >= self.keepalive_s:
            self._idle.pop(0).close()
        if self._idle:
            self._sweeper = self.loop.call_later(self._idle[0].idle_since + self.keepalive_s - now, self._sweep)

    def _forget(self, conn: _Connection) -> None:
        try:
            self._idle.remove(conn)
        except ValueError:
            pass

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._idle):
            conn.close()
        self._idle.clear()
