"""Stand-ins for misbehaving peers in the fault suites: a bootstrap service proxy that can be
slow or fail, and a TCP listener that accepts connections and then never answers."""

from __future__ import annotations

import asyncio
import socket
import threading


class BootstrapStub:
    """An aiohttp proxy in front of a real bootstrap service, on its own thread and port.
    `mode`: "pass" forwards; "slow" forwards after `delay` seconds; "error" answers `status`.
    `paths` limits slow/error to those paths (None: every path)."""

    def __init__(self, target: str):
        from aiohttp import web

        self.target = target
        self.mode, self.delay, self.status, self.paths = "pass", 0.0, 500, None
        self.hits: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="bootstrap-stub")
        self._thread.start()

        async def handle(request: web.Request) -> web.Response:
            self.hits.append(request.path)
            if self.paths is None or request.path in self.paths:
                if self.mode == "error":
                    return web.json_response({"error": {"message": "stub failure", "type": "stub"}},
                                             status=self.status)
                if self.mode == "slow":
                    await asyncio.sleep(self.delay)
            async with self._session.request(request.method, f"http://{self.target}{request.path_qs}",
                                             data=await request.read(), headers={
                                                 k: v for k, v in request.headers.items()
                                                 if k.lower() in ("content-type", "authorization")}) as r:
                return web.Response(status=r.status, body=await r.read(),
                                    content_type=r.content_type)

        async def start():
            import aiohttp

            self._session = aiohttp.ClientSession()
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", handle)
            self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            return self._runner.addresses[0][1]

        self.port = asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)

    def stop(self) -> None:
        async def stop():
            await self._runner.cleanup()
            await self._session.close()
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class StallingPeer:
    """A TCP listener that accepts connections and then neither reads nor answers."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True, name="stalling-peer")
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.accepted.append(conn)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for c in self.accepted:
            c.close()
        self.sock.close()
