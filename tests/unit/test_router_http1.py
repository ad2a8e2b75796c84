"""Unit tests of the router's own HTTP/1.1 leg client (pdserve/router/http1.py).

A raw asyncio server on 127.0.0.1 (port 0) writes exact reply bytes, so framing, keep-alive,
broken connections and cancellation are checked byte for byte. Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from pdserve.router.http1 import PAUSE_READING_BYTES, Http1Pool, UpstreamClosed

pytestmark = pytest.mark.timeout(60)
HEADERS = {"Content-Type": "application/json"}

Reply = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes, bytes], Awaitable[bool]]


class RawServer:
    """Reads each request (head + Content-Length body) and lets `reply` answer; counts connections."""

    def __init__(self, reply: Reply):
        self.reply, self.connections, self.requests = reply, 0, []
        self.closed_by_client = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                if not await self.reply(reader, writer, head, body):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


async def json_reply(reader, writer, head, body) -> bool:
    out = b'{"echo":' + body + b"}"
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(out), out))
    await writer.drain()
    return True


def test_post_reads_reply_and_reuses_connection():
    async def main():
        server = RawServer(json_reply)
        async with server as url:
            pool = Http1Pool(url + "/base/", 10.0, 5.0)
            for i in range(3):
                resp = await pool.post(pool.cached_head("/generate", HEADERS), b'{"i":%d}' % i)
                assert (resp.status, resp.content_type) == (200, "application/json")
                assert await resp.read() == b'{"echo":{"i":%d}}' % i
                resp.close()
            pool.close()
        assert server.connections == 1
        head, body = server.requests[0]
        assert head.startswith(b"POST /base/generate HTTP/1.1\r\n")
        assert b"\r\nContent-Length: 7\r\n" in head and b"\r\nHost: 127.0.0.1:" in head and body == b'{"i":0}'
    run(main())


def test_chunked_reply_streams_piece_by_piece():
    async def main():
        release = asyncio.Event()

        async def chunked(reader, writer, head, body) -> bool:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"7\r\ndata: 1\r\n")
            await writer.drain()
            await release.wait()
            writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
            await writer.drain()
            return True

        server = RawServer(chunked)
        async with server as url:
            pool = Http1Pool(url, 10.0, 5.0)
            resp = await pool.post(pool.head("/generate", HEADERS), b"{}")
            assert resp.content_type == "text/event-stream"
            assert await resp.read_chunk() == b"data: 1"  # arrives before the rest is sent
            assert not resp.at_eof()
            release.set()
            assert await resp.read_chunk() == b"data: 2"
            assert await resp.read_chunk() == b"" and resp.at_eof()
            resp.close()
            assert len(pool._idle) == 1  # read to its end: kept for the next leg
            pool.close()
    run(main())


def test_connection_closed_mid_body_raises():
    async def cut(reader, writer, head, body) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        return False

    async def main():
        async with RawServer(cut) as url:
            pool = Http1Pool(url, 10.0, 5.0)
            resp = await pool.post(pool.head("/generate", HEADERS), b"{}")
            with pytest.raises(UpstreamClosed):
                await resp.read()
            resp.close()
            assert not pool._idle
    run(main())


def test_body_until_close_and_connection_close_are_not_reused():
    async def until_eof(reader, writer, head, body) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await writer.drain()
        return False

    async def main():
        server = RawServer(until_eof)
        async with server as url:
            pool = Http1Pool(url, 10.0, 5.0)
            for _ in range(2):
                resp = await pool.post(pool.head("/generate", HEADERS), b"{}")
                assert await resp.read() == b"all of it"
                resp.close()
            pool.close()
        assert server.connections == 2
    run(main())


def test_cancel_before_headers_closes_connection():
    async def never(reader, writer, head, body) -> bool:
        await reader.read(1)  # returns b"" once the client closes
        raise ConnectionError

    async def main():
        server = RawServer(never)
        async with server as url:
            pool = Http1Pool(url, 10.0, 5.0)
            task = asyncio.create_task(pool.post(pool.head("/generate", HEADERS), b"{}"))
            while not server.requests:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(server.closed_by_client.wait(), 5)  # the server sees the abort
            assert not pool._idle
    run(main())


def test_closing_an_unfinished_stream_closes_connection():
    async def endless(reader, writer, head, body) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await reader.read(1)
        raise ConnectionError

    async def main():
        server = RawServer(endless)
        async with server as url:
            pool = Http1Pool(url, 10.0, 5.0)
            resp = await pool.post(pool.head("/generate", HEADERS), b"{}")
            assert await resp.read_chunk() == b"abc"
            resp.close()
            await asyncio.wait_for(server.closed_by_client.wait(), 5)
            assert not pool._idle
    run(main())


def test_large_streamed_body_pauses_and_resumes_reading():
    size = 4 * PAUSE_READING_BYTES

    async def big(reader, writer, head, body) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + b"x" * size)
        await writer.drain()
        return True

    async def main():
        server = RawServer(big)
        async with server as url:
            pool = Http1Pool(url, 10.0, 5.0)
            resp = await pool.post(pool.head("/generate", HEADERS), b"{}")
            await asyncio.sleep(0.2)  # let the reply pile up unread
            assert resp._buffered <= PAUSE_READING_BYTES + 65536 * 4
            got = 0
            while chunk := await resp.read_chunk():
                got += len(chunk)
            assert got == size
            resp.close()
            resp = await pool.post(pool.head("/generate", HEADERS), b"{}")  # same connection, reading again
            assert len(await resp.read()) == size
            resp.close()
            pool.close()
        assert server.connections == 1
    run(main())


def test_idle_connection_expires():
    async def main():
        server = RawServer(json_reply)
        async with server as url:
            pool = Http1Pool(url, 0.05, 5.0)
            for _ in range(2):
                resp = await pool.post(pool.head("/generate", HEADERS), b"1")
                await resp.read()
                resp.close()
                await asyncio.sleep(0.1)
            pool.close()
        assert server.connections == 2
    run(main())


def test_idle_connections_close_without_further_traffic():
    """An idle pool closes its connections after keepalive_s on its own (the server would keep
    them far longer), and a later request simply opens a new one."""
    async def main():
        server = RawServer(json_reply)
        async with server as url:
            pool = Http1Pool(url, 0.2, 5.0)
            resps = [await pool.post(pool.head("/generate", HEADERS), b"1") for _ in range(3)]
            for r in resps:
                await r.read()
                r.close()
            assert len(pool._idle) == 3
            await asyncio.wait_for(server.closed_by_client.wait(), 5.0)
            await asyncio.sleep(0.1)
            assert not pool._idle and pool._sweeper is None
            resp = await pool.post(pool.head("/generate", HEADERS), b"1")
            await resp.read()
            resp.close()
            pool.close()
        assert server.connections == 4
    run(main())


def test_garbage_reply_and_refused_connection_are_connection_errors():
    async def garbage(reader, writer, head, body) -> bool:
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        return True

    async def main():
        async with RawServer(garbage) as url:
            pool = Http1Pool(url, 10.0, 5.0)
            with pytest.raises(UpstreamClosed):
                await pool.post(pool.head("/generate", HEADERS), b"{}")
            port = int(url.rsplit(":", 1)[1])
        with pytest.raises(OSError):  # the server is gone now
            await Http1Pool(f"http://127.0.0.1:{port}", 10.0, 5.0).post(b"POST / HTTP/1.1\r\nContent-Length: ", b"")
    run(main())


def test_set_exception_wakes_a_waiting_reader():
    async def slow(reader, writer, head, body) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await reader.read(1)
        raise ConnectionError

    async def main():
        async with RawServer(slow) as url:
            pool = Http1Pool(url, 10.0, 5.0)
            resp = await pool.post(pool.head("/generate", HEADERS), b"{}")
            reader = asyncio.create_task(resp.read_chunk())
            await asyncio.sleep(0.05)
            resp.set_exception(RuntimeError("prefill failed"))
            with pytest.raises(RuntimeError, match="prefill failed"):
                await asyncio.wait_for(reader, 5)
            resp.close()
    run(main())


def test_header_values_with_line_breaks_are_refused():
    async def main():
        async with RawServer(json_reply) as url:
            pool = Http1Pool(url, 10.0, 5.0)
            with pytest.raises(ValueError):
                pool.head("/generate", {"Authorization": "Bearer x\r\nX-Evil: 1"})
    run(main())
