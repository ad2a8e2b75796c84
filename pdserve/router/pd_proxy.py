"""The PD exchange: send one client request to a prefill and a decode at once, answer with decode's.

Life of one request (one PDExchange):
1. pick a pair (by the request's routing key when a policy needs one), mint rooms, post both legs
   concurrently;
2. wait until decode has answered (non-stream) or sent its headers and first chunk (stream);
   the first failing leg cancels the other and becomes the one error the client gets (a
   decode 5xx first waits briefly for the prefill, whose rejection is then the cause reported);
3. a connection failure or a retryable status there (legs.RETRYABLE_STATUSES, or 429) is retried
   on another pair with new rooms (up to max tries); the failed server is taken again only when
   nothing else is healthy, after a connection failure once the probe it started has passed;
4. stream: commit decode's status and relay its events as they come (migration.StreamRelay);
5. a decode that fails after that (an error event, a broken or cut-off body), or with a 5xx
   before answering, moves the request to another pair with the tokens streamed so far, up to
   --migration-limit times (migration.py), to the same decode only when its connection broke,
   nothing else is healthy and its probe passed; any other failure, or one that cannot move, is the
   client's error: on a stream `data: {"error": ...}` then `data: [DONE]`;
6. prefill's reply is read and dropped (merged first with `return_logprob`), in the background
   when decode finished first. Client disconnect or the deadline cancels every open leg.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from aiohttp import web

from pdserve.core.config import Role
from pdserve.core.errors import Timeout, Unavailable

from .config import RouterConfig
from .deadline import Deadline
from .legs import LegClient, LegError, LegErrorKind, OpenStream, cancel_task, consume
from .metrics import RouterMetrics
from .migration import Migration, StreamRelay, blocker, continuation, request_body
from .pd_body import RequestShape, leg_bodies, merge_input_logprobs, mint_rooms, routing_key
from .pd_errors import StreamBroke, either_done, error_response, write_stream_error
from .upstream import Pair, Upstream, UpstreamPool

log = logging.getLogger("pdserve.router.pd_proxy")
STREAM_ERROR_WRITE_TIMEOUT_S = 5.0
PREFILL_VERDICT_GRACE_S = 0.5  # how long a failed decode leg waits for the prefill's own error


class PDProxy:
    """Shared parts of every exchange: config, pool, leg client, metrics, background drains."""

    def __init__(self, cfg: RouterConfig, pool: UpstreamPool, legs: LegClient, metrics: RouterMetrics,
                 on_connection_failure: Callable[[Upstream, str], Awaitable | None]):
        self.cfg, self.pool, self.legs, self.metrics = cfg, pool, legs, metrics
        self.on_connection_failure = on_connection_failure
        self._background: set[asyncio.Task] = set()
        self.loop: asyncio.AbstractEventLoop | None = None  # bound on the first request

    async def handle(self, request: web.Request, body: dict, shape: RequestShape) -> web.StreamResponse:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        return await PDExchange(self, request, body, shape).run()

    def drain(self, task: asyncio.Task, deadline: float) -> None:
        """Let a prefill leg finish on its own (its reply is dropped), cancelled at the deadline."""
        self._background.add(task)
        timer = self.loop.call_at(deadline, task.cancel)

        def done(t: asyncio.Task) -> None:
            timer.cancel()
            self._background.discard(t)
            consume(t)

        task.add_done_callback(done)

    async def close(self) -> None:
        for task in list(self._background):
            await cancel_task(task)


class PDExchange:
    def __init__(self, proxy: PDProxy, request: web.Request, body: dict, shape: RequestShape):
        self.p, self.request, self.body, self.shape = proxy, request, body, shape
        self.response: web.StreamResponse | None = None  # set once decode's stream is committed
        self.where = ""  # room and servers of the current try, for error messages
        self._timeout: Deadline | None = None
        self._deadline = 0.0
        self._avoid: set[str] = set()  # servers that failed this request: picked only if nothing else is
        self._suspects: dict[str, Awaitable] = {}  # url -> the probe its connection failure started

    async def run(self) -> web.StreamResponse:
        cfg = self.p.cfg
        last: LegError | None = None
        tries = 0
        key = routing_key(self.shape.route, self.body) if self.p.pool.needs_key else None
        stream = self.shape.stream
        # with --migration-limit 0 no stream ever moves: the decodes are not asked for progress
        m = self.migration = Migration(blocker(self.shape, self.body) if stream and cfg.migration_limit else
                                       None, enabled=cfg.migration_limit > 0)
        body = request_body(self.body, m, stream)
        moving = False  # a migration waits for its pair
        try:
            async with Deadline(self.p.loop, cfg.request_timeout_secs) as self._timeout:
                self._deadline = self._timeout.when
                while True:
                    tries += 1
                    try:
                        pair = await self._pick(key)
                        if moving:
                            self.p.metrics.migrations.labels("started").inc()
                            moving = False
                    except Unavailable as exc:
                        if last is None:
                            raise
                        # the failed server just left selection: its error is the cause, not this
                        why = "could not migrate" if m.count else "no retry"
                        return await self._fail(last, f"{last.message} ({self.where}; {why}: {exc.message})")
                    try:
                        resp = await self._try_pair(pair, body)
                    except (LegError, StreamBroke) as exc:
                        mid_stream = isinstance(exc, StreamBroke)
                        err = exc.err if isinstance(exc, StreamBroke) else exc
                        move, why_not = self._migration_verdict(err, mid_stream)
                        if move:
                            self._start_migration(err)
                            moving, tries = True, 0  # the continuation gets its own tries
                            body, last = continuation(self.body, m, stream), err
                            continue
                        busy = err.kind is LegErrorKind.STATUS and err.status == 429  # back-pressure
                        if mid_stream or not (err.retryable or busy):
                            return await self._fail(err, f"{err.message} ({self.where}){why_not}")
                        if err.server_down:  # a full server is healthy: another pair takes the request
                            self._suspect(err)
                        self._avoid.add(err.upstream.url)
                        if tries >= cfg.max_tries:
                            return await self._fail(err, f"{err.message} ({self.where}; gave up after {tries} tries)")
                        self.p.metrics.retries.labels("overloaded" if busy else err.kind.value).inc()
                        last = err
                        continue
                    if m.count:
                        self.p.metrics.migrations.labels("succeeded").inc()
                    return resp
        except TimeoutError:
            message = f"request timed out after {cfg.request_timeout_secs:g}s ({self.where})"
            if m.count:
                self.p.metrics.migrations.labels("failed").inc()
            if self.response is None:
                raise Timeout(message) from None
            try:
                async with asyncio.timeout(STREAM_ERROR_WRITE_TIMEOUT_S):
                    await write_stream_error(self.response, Timeout.status, message, Timeout.type)
            except TimeoutError:
                pass  # the client does not read; drop it
            return self.response

    def _migration_verdict(self, err: LegError, mid_stream: bool) -> tuple[bool, str]:
        """(move it?, what the error adds when not). Only decode failures move: any break of its
        stream, or a 5xx before it answered; the prefill's own failures keep today's rules."""
        if err.upstream.role is not Role.DECODE:
            return False, ""
        if not (err.kind is LegErrorKind.CONNECTION and mid_stream) and \
                not (err.kind is LegErrorKind.STATUS and err.status >= 500):
            return False, ""
        m, limit = self.migration, self.p.cfg.migration_limit
        if m.count >= limit:
            self.p.metrics.migrations.labels("limit_reached").inc()
            return False, f"; not migrated: --migration-limit {limit} " + ("reached" if limit else "(disabled)")
        refusal = m.refusal()
        if refusal is not None:
            self.p.metrics.migrations.labels("unsupported").inc()
            return False, f"; not migrated: {refusal}"
        return True, ""

    def _start_migration(self, err: LegError) -> None:
        m = self.migration
        m.count += 1
        if err.kind is LegErrorKind.CONNECTION:  # maybe only the connection broke: a last resort
            self._suspect(err)
            self._avoid.add(err.upstream.url)
        else:  # it answered with an error: never back there
            m.failed_decodes.add(err.upstream.url)
        log.warning("migrating a request (%d of at most %d) after %d streamed tokens: %s (%s)", m.count,
                    self.p.cfg.migration_limit, len(m.ids), err.message, self.where)

    def _suspect(self, err: LegError) -> None:
        probe = self.p.on_connection_failure(err.upstream, err.message)
        if probe is not None:
            self._suspects[err.upstream.url] = probe

    async def _pick(self, key) -> Pair:
        """A pair for the next try. Servers that failed this request are taken only when nothing
        else is healthy, and one that failed by connection only once its probe passed (health.py)."""
        m = self.migration
        pair = self.p.pool.pick_pair(frozenset(self._avoid), key, frozenset(m.failed_decodes))
        probes = [self._suspects.pop(up.url) for up in (pair.prefill, pair.decode) if up.url in self._suspects]
        if probes:
            await asyncio.wait(probes)  # bounded by the request's deadline; never cancels a probe
            pair = self.p.pool.pick_pair(frozenset(self._avoid), key, frozenset(m.failed_decodes))
        return pair

    async def _fail(self, err: LegError, message: str) -> web.StreamResponse:
        """The client's one error, with the leg's status, type and own error fields: a JSON reply,
        or an error event once the stream is committed."""
        if self.migration.count:
            self.p.metrics.migrations.labels("failed").inc()
        if self.response is None:
            return error_response(err.status, message, err.type, err.sent, err.retry_after)
        await write_stream_error(self.response, err.status, message, err.type, err.sent)
        return self.response

    def _client_auth(self) -> str | None:
        """Without a key of its own the router passes the client's Authorization on to both legs."""
        return None if self.p.cfg.api_key else self.request.headers.get("Authorization")

    def _cancel_reason(self) -> str:
        return "timeout" if self._timeout is not None and self._timeout.expired() else "client_disconnect"

    async def _cancel(self, task: asyncio.Task, role: str, reason: str) -> None:
        """Stop a leg: cancel it if running, close it if it is an open stream."""
        cancelled = await cancel_task(task)
        if not cancelled and not task.cancelled() and task.exception() is None \
                and isinstance(task.result(), OpenStream):
            task.result().close()
            cancelled = True
        if cancelled:
            self.p.metrics.cancelled_legs.labels(role, reason).inc()

    async def _try_pair(self, pair: Pair, body: dict) -> web.StreamResponse:
        rooms = mint_rooms(self.shape.room_count)
        dp = (pair.prefill_rank, pair.decode_rank) if pair.prefill_rank is not None else None
        self.where = (f"bootstrap_room={rooms}, prefill {pair.prefill.url}{f' dp_rank {dp[0]}' if dp else ''}, "
                      f"decode {pair.decode.url}{f' dp_rank {dp[1]}' if dp else ''}")
        count, rid = self.migration.count, body.get("rid")
        # a migration may pick the old prefill, whose leg of the same rid may not have ended yet
        p_rid = f"{rid}-migration-{count}" if count and isinstance(rid, str) else None
        p_body, d_body = leg_bodies(body, pair.prefill.bootstrap_host, pair.prefill.bootstrap_port, rooms, dp, p_rid)
        path, legs, auth = self.shape.route.value, self.p.legs, self._client_auth()
        loop = self.p.loop
        p_rank, d_rank = dp if dp else (None, None)
        prefill = loop.create_task(legs.fetch(pair.prefill, path, p_body, auth, p_rank))
        open_decode = legs.open_stream if self.shape.stream else legs.fetch
        decode = loop.create_task(open_decode(pair.decode, path, d_body, auth, d_rank))
        try:
            await self._until_decode_answers(prefill, decode)
        except LegError as err:
            other, role = (decode, "decode") if err.upstream is pair.prefill else (prefill, "prefill")
            await self._cancel(other, role, "peer_failed")
            raise
        except BaseException:
            reason = self._cancel_reason()
            await self._cancel(prefill, "prefill", reason)
            await self._cancel(decode, "decode", reason)
            raise
        if self.shape.stream:
            return await self._stream(decode.result(), prefill)
        reply = decode.result()
        body = reply.body
        if self.shape.return_logprob:
            try:
                body = merge_input_logprobs((await prefill).body, body)
            except BaseException:
                await self._cancel(prefill, "prefill", self._cancel_reason())
                raise
        elif not prefill.done():
            self.p.drain(prefill, self._deadline)
        consume(prefill)
        return web.Response(status=reply.status, body=body, headers={"Content-Type": reply.content_type})

    async def _until_decode_answers(self, prefill: asyncio.Task, decode: asyncio.Task) -> None:
        """Wait for decode's answer; raise the first leg error of either side.

        A decode 5xx is often the echo of a prefill rejection (the prefill fails the room, the
        decode's handoff fails with it), so the prefill gets a short grace to report the cause.
        """
        while True:
            if prefill.done() and prefill.exception() is not None:
                raise prefill.exception()
            if decode.done():
                break
            await either_done(self.p.loop, prefill, decode)
        err = decode.exception()
        if err is not None:
            if not prefill.done() and isinstance(err, LegError) and err.status >= 500:
                await asyncio.wait({prefill}, timeout=PREFILL_VERDICT_GRACE_S)
                if prefill.done() and isinstance(prefill.exception(), LegError):
                    raise prefill.exception()
            raise err

    async def _stream(self, stream: OpenStream, prefill: asyncio.Task) -> web.StreamResponse:
        """Commit decode's status (the first decode's: a continuation streams on into the same
        response) and relay its events; a failure of either leg then raises StreamBroke."""
        def prefill_done(task: asyncio.Task) -> None:
            # A failed prefill wakes the decode read at once with the prefill's error.
            if not task.cancelled() and isinstance(task.exception(), LegError):
                stream.fail(task.exception())

        prefill.add_done_callback(prefill_done)
        relay = StreamRelay(self.migration, stream.upstream)
        try:
            if self.response is None:
                resp = web.StreamResponse(status=stream.status, headers={
                    "Content-Type": stream.content_type, "Cache-Control": "no-cache"})
                await resp.prepare(self.request)
                self.response = resp
            chunk = stream.first_chunk
            while True:
                if chunk:
                    out = relay.feed(chunk)
                    if out:
                        await self.response.write(out)
                else:
                    relay.end()
                if relay.failure is not None:
                    raise relay.failure
                if not chunk:
                    break
                chunk = await stream.next_chunk()
            await self.response.write_eof()  # decode finished: a late prefill error changes nothing now
        except LegError as err:
            if err.upstream is stream.upstream and not prefill.done():
                # a decode failing before its first token is often the echo of a prefill failure
                await asyncio.wait({prefill}, timeout=PREFILL_VERDICT_GRACE_S)
            other_failed = prefill.done() and not prefill.cancelled() and isinstance(prefill.exception(), LegError)
            err = prefill.exception() if other_failed else err
            await self._cancel(prefill, "prefill", "peer_failed")
            raise StreamBroke(err) from None
        except ConnectionError:  # writing to the client failed: it is gone (upstream errors are LegErrors)
            await self._stop_streaming_legs(stream, prefill, "client_disconnect")
            return self.response
        except BaseException:
            await self._stop_streaming_legs(stream, prefill, self._cancel_reason())
            raise
        finally:
            prefill.remove_done_callback(prefill_done)
            stream.close()
        if not prefill.done():
            self.p.drain(prefill, self._deadline)
        consume(prefill)
        return self.response

    async def _stop_streaming_legs(self, stream: OpenStream, prefill: asyncio.Task, reason: str) -> None:
        await self._cancel(prefill, "prefill", reason)
        if not stream.at_eof():  # closed by the caller's finally
            self.p.metrics.cancelled_legs.labels("decode", reason).inc()
