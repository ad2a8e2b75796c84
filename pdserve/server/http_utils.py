"""ASGI pieces the routes share: JSON error replies, the API-key gate, an SSE response that
notices a client disconnect, and running a coroutine until the client goes away."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..core.errors import PDServeError, Unauthorized
from ..core.strict_json import loads_object

log = logging.getLogger(__name__)
T = TypeVar("T")


def error_response(err: PDServeError) -> JSONResponse:
    retry_after = getattr(err, "retry_after", None)  # limits.Refused (429)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(err.to_json(), status_code=err.status, headers=headers)


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def json_body(request: Request) -> dict:
    return loads_object(await request.body())


class ClientGone(Exception):
    """The client disconnected before the reply was ready."""


async def _wait_disconnect(receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    return task.result()


class SSEResponse(Response):
    """Stream pre-encoded SSE events; on client disconnect stop the stream. `on_close` runs once
    at the end in every case (it aborts unfinished worker requests)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        async def pump():
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        pump_task = asyncio.ensure_future(pump())
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({pump_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (pump_task, watcher):
                t.cancel()
            results = await asyncio.gather(pump_task, watcher, return_exceptions=True)
            try:
                await self.events.aclose()  # type: ignore[attr-defined]
            except Exception:
                log.exception("closing an SSE stream failed")
            self.on_close()
        if isinstance(results[0], Exception) and not isinstance(results[0], OSError):
            log.error("SSE stream failed: %r", results[0])


class ApiKeyMiddleware:
    """Require `Authorization: Bearer <key>` on every HTTP route except the open ones."""

    def __init__(self, app, api_key: str, open_paths: tuple[str, ...] = ("/health", "/health_generate")):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("path") not in self.open_paths:
            headers = dict(scope.get("headers") or [])
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                resp = error_response(Unauthorized("missing or wrong API key (Authorization: Bearer ...)"))
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)
