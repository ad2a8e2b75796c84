"""What the PD exchange answers when it fails, and the one asyncio wait it needs (router only)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from .legs import LegError
from .pd_body import encode

_DONE = b"data: [DONE]\n\n"


def error_body(status: int, message: str, type: str, sent: dict | None = None) -> bytes:
    """The router's error object; `sent`: the failing server's own (LegError.sent), whose fields
    other than message and type (code, param, ...) the client gets as that server sent them."""
    err = {"message": message, "type": type, "code": status}
    if sent:
        err.update({k: v for k, v in sent.items() if k not in ("message", "type")})
    return encode({"error": err})


def error_response(status: int, message: str, type: str, sent: dict | None = None,
                   retry_after: str | None = None) -> web.Response:
    headers = {"Retry-After": retry_after} if retry_after else None
    return web.Response(status=status, body=error_body(status, message, type, sent), content_type="application/json",
                        headers=headers)


async def write_stream_error(response: web.StreamResponse, status: int, message: str, type: str,
                             sent: dict | None = None) -> None:
    """End a committed stream with the error as an event, then [DONE] (the client may be gone)."""
    try:
        await response.write(b"data: " + error_body(status, message, type, sent) + b"\n\n" + _DONE)
        await response.write_eof()
    except (ConnectionError, RuntimeError):
        pass  # the client is gone too


class StreamBroke(Exception):
    """A leg failed after the client's stream was committed; `err` is the failure to report."""

    def __init__(self, err: LegError):
        super().__init__(err.message)
        self.err = err


async def either_done(loop: asyncio.AbstractEventLoop, a: asyncio.Task, b: asyncio.Task) -> None:
    """Wait until a or b is done (asyncio.wait costs a getpid() syscall on Python 3.11)."""
    waiter = loop.create_future()

    def wake(_: asyncio.Task) -> None:
        if not waiter.done():
            waiter.set_result(None)

    a.add_done_callback(wake)
    b.add_done_callback(wake)
    try:
        await waiter
    finally:
        a.remove_done_callback(wake)
        b.remove_done_callback(wake)
