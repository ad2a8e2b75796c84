"""The prefill's bootstrap HTTP service (docs/architecture.md, The bootstrap service) over a shared BootstrapTable.

Routes: PUT /route (a DP worker registers), GET /route?prefill_dp_rank=-1|K (topology | one
rank's endpoint; 503 until every rank registered, or when that rank's worker is gone), POST
/register_dp_rank, POST /query_dp_ranks, POST /fail_room (a decode that cannot take a room's
KV, e.g. on another transfer backend, says so: the prefill frees it now, not at its bootstrap
deadline), POST /drop_room (the decode prefilled the room itself: the prefill ends it with a
success and moves nothing), GET /health (instance_id; gone_ranks when a worker died; load_tokens, the prompt tokens the
prefill has queued or in flight, when the front gives it). Runs on its own port
inside the prefill front's event loop (`start_bootstrap_server`) or, for tests and tools, on a
thread of its own (`ThreadedBootstrap`).

/query_dp_ranks answers {"<room>": rank, ...} and adds "failed": {"<room>": reason} only when a
queried room was rejected, so a reply with no failures is exactly SGLang's shape.
"""

from __future__ import annotations

import asyncio
import hmac
import threading
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from aiohttp import web

from ..core.errors import BadRequest, PDServeError, Unauthorized
from ..core.pd_vocab import MAX_QUERY_ROOMS, check_room
from ..core.strict_json import loads_object
from .bootstrap_table import BootstrapTable, RankInfo

MAX_REASON_CHARS = 2000
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, type_: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": type_, "code": status}},
                             status=status)


@web.middleware
async def _errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except PDServeError as e:
        return web.json_response(e.to_json(), status=e.status)
    except web.HTTPException as e:  # 404, 405 from routing
        if e.status < 400:
            raise
        return _error(e.status, f"{request.method} {request.path}: {e.reason}", "invalid_request_error")


def _require_token(token: str) -> Callable[[Handler], Handler]:
    def wrap(handler: Handler) -> Handler:
        if not token:
            return handler
        expected = f"Bearer {token}".encode()

        async def checked(request: web.Request) -> web.StreamResponse:
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, expected):
                raise Unauthorized(f"{request.method} {request.path} needs 'Authorization: Bearer <token>'")
            return await handler(request)
        return checked
    return wrap


async def _json_object(request: web.Request) -> dict[str, Any]:
    return loads_object(await request.read(), f"{request.method} {request.path}: the body")


def make_bootstrap_app(table: BootstrapTable, *, token: str = "",
                       on_room_failed: Callable[[int, str], None] | None = None,
                       on_room_dropped: Callable[[int, str], None] | None = None,
                       load_tokens: Callable[[], int] | None = None) -> web.Application:
    """The bootstrap service over `table`. With `token`, the write routes need the Bearer token.
    `on_room_failed(room, reason)` handles POST /fail_room (default: record it failed in `table`),
    `on_room_dropped(room, reason)` POST /drop_room (default: forget the room)."""
    app = web.Application(middlewares=[_errors_as_json])
    auth = _require_token(token)
    fail_room = on_room_failed or table.record_failed
    drop_room = on_room_dropped or (lambda room, reason: table.forget(room))

    async def put_route(request: web.Request) -> web.Response:
        table.register_rank(RankInfo.from_json(await _json_object(request)))
        return web.json_response({"status": "ok", "instance_id": table.instance_id})

    async def get_route(request: web.Request) -> web.Response:
        raw = request.query.get("prefill_dp_rank", "-1")
        try:
            k = int(raw)
        except ValueError:
            raise BadRequest(f"prefill_dp_rank must be an integer, got {raw!r}") from None
        if k == -1:
            return web.json_response(table.topology().to_json())
        info = table.rank(k)
        return web.json_response({**info.to_json(), "instance_id": table.instance_id})

    async def register_dp_rank(request: web.Request) -> web.Response:
        body = await _json_object(request)
        room = check_room(body.get("bootstrap_room"))
        table.record(room, body.get("dp_rank"))  # type: ignore[arg-type]  # record() validates it
        return web.json_response({"status": "ok"})

    async def query_dp_ranks(request: web.Request) -> web.Response:
        rooms = (await _json_object(request)).get("bootstrap_rooms")
        if not isinstance(rooms, list):
            raise BadRequest("bootstrap_rooms must be a list of integers")
        if len(rooms) > MAX_QUERY_ROOMS:
            raise BadRequest(f"at most {MAX_QUERY_ROOMS} bootstrap_rooms per query, got {len(rooms)}")
        found, failed = table.lookup([check_room(r, "each of bootstrap_rooms") for r in rooms])
        reply: dict[str, Any] = {str(room): rank for room, rank in found.items()}
        if failed:
            reply["failed"] = {str(room): reason for room, reason in failed.items()}
        return web.json_response(reply)

    async def fail_room_route(request: web.Request) -> web.Response:
        body = await _json_object(request)
        room = check_room(body.get("bootstrap_room"))
        reason = body.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise BadRequest("reason must be a non-empty string")
        reason = reason[:MAX_REASON_CHARS]
        if f"room {room}" not in reason:
            reason = f"room {room}: {reason}"
        fail_room(room, f"the decode side gave up the room: {reason}")
        return web.json_response({"status": "ok"})

    async def drop_room_route(request: web.Request) -> web.Response:
        body = await _json_object(request)
        room = check_room(body.get("bootstrap_room"))
        reason = body.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise BadRequest("reason must be a non-empty string")
        drop_room(room, reason[:MAX_REASON_CHARS])
        return web.json_response({"status": "ok"})

    async def health(request: web.Request) -> web.Response:
        reply: dict[str, Any] = {"status": "ok", "instance_id": table.instance_id}
        if load_tokens is not None:  # what a decode weighs before prefilling a request itself
            reply["load_tokens"] = load_tokens()
        gone = table.gone_ranks()
        if gone:  # the service is up but these ranks' workers died
            reply["gone_ranks"] = {str(rank): why for rank, why in gone.items()}
        return web.json_response(reply)

    app.router.add_put("/route", auth(put_route))
    app.router.add_get("/route", get_route)
    app.router.add_post("/register_dp_rank", auth(register_dp_rank))
    app.router.add_post("/query_dp_ranks", query_dp_ranks)
    app.router.add_post("/fail_room", auth(fail_room_route))
    app.router.add_post("/drop_room", auth(drop_room_route))
    app.router.add_get("/health", health)
    return app


@dataclass
class RunningBootstrap:
    """A started bootstrap service; `port` is the bound port (useful with port 0)."""

    runner: web.AppRunner
    host: str
    port: int

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_bootstrap_server(table: BootstrapTable, host: str, port: int, *, token: str = "",
                                 on_room_failed: Callable[[int, str], None] | None = None,
                                 on_room_dropped: Callable[[int, str], None] | None = None,
                                 load_tokens: Callable[[], int] | None = None) -> RunningBootstrap:
    """Serve the bootstrap app on host:port in the running event loop."""
    runner = web.AppRunner(make_bootstrap_app(table, token=token, on_room_failed=on_room_failed,
                                              on_room_dropped=on_room_dropped, load_tokens=load_tokens),
                           access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise OSError(e.errno, f"bootstrap service cannot bind {host}:{port}: {e.strerror}") from e
    return RunningBootstrap(runner, host, runner.addresses[0][1])


class ThreadedBootstrap:
    """The bootstrap service on a daemon thread with its own event loop; `stop()` joins it."""

    def __init__(self, table: BootstrapTable, host: str = "127.0.0.1", port: int = 0, *,
                 token: str = "", start_timeout: float = 10.0,
                 on_room_failed: Callable[[int, str], None] | None = None):
        self.table = table
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bootstrap-http",
                                        daemon=True)
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(
            start_bootstrap_server(table, host, port, token=token, on_room_failed=on_room_failed),
            self._loop)
        try:
            self._server = fut.result(timeout=start_timeout)
        except BaseException:
            self._shutdown_loop(start_timeout)
            raise
        self.host, self.port = host, self._server.port

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._server.stop(), self._loop).result(timeout=timeout)
        self._shutdown_loop(timeout)

    def _shutdown_loop(self, timeout: float) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"bootstrap service thread did not stop within {timeout}s")
        self._loop.close()
