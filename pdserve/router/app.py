"""The router process: aiohttp app (routes, auth, JSON errors, metrics), its lifecycle, and `run_router`.

RouterApp owns the leg client (our keep-alive pools for the PD legs, an aiohttp session for
health and info GETs), the upstream pool, the health loop, the policies' upkeep (cache_aware's
eviction) and the PD proxy; `serve()` runs it until SIGINT/SIGTERM. A server that leaves selection
or restarts (a new instance_id in /server_info) loses its cache-aware state.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hmac
import logging
import random
import signal
import sys
import time

import aiohttp
from aiohttp import web

from pdserve.core.config import Role
from pdserve.core.errors import PDServeError, Unauthorized
from pdserve.core.netaddr import host_port

from .cli_args import config_from_args
from .config import RouterConfig
from .health import HealthLoop, HealthState
from .info_routes import InfoRoutes
from .legs import LegClient
from .metrics import RouterMetrics
from .pd_body import Route, inspect_request, parse_client_body
from .pd_errors import error_response
from .pd_proxy import PDProxy
from .policies import Policy, make_policy
from .upstream import Upstream, UpstreamPool

log = logging.getLogger("pdserve.router")
# Below uvicorn's 5 s keep-alive, so we never reuse a connection the server is about to close.
UPSTREAM_KEEPALIVE_S = 4.0
UPSTREAM_CONNECT_TIMEOUT_S = 10.0
OPEN_PATHS = frozenset({"/health"})
GC_GEN0_THRESHOLD = 10_000  # CPython's default is 700 allocations


class RouterApp:
    def __init__(self, cfg: RouterConfig, rng: random.Random | None = None):
        self.cfg = cfg
        self.metrics = RouterMetrics()
        rng = rng or random.Random()
        policies = [make_policy(name, rng, cache=cfg.cache_aware(),
                                on_decision=self.metrics.cache_aware_recorder(role.value))
                    for name, role in ((cfg.prefill_policy, Role.PREFILL), (cfg.decode_policy, Role.DECODE))]
        self.pool = UpstreamPool.from_config(cfg, *policies, assume_healthy=not cfg.health_check_enabled)
        self.health = HealthLoop(self.pool.all(), self._probe, cfg.health_check_interval_secs, self._health_changed)
        headers = {"Content-Type": "application/json"}
        if cfg.api_key:
            headers["Authorization"] = f"Bearer {cfg.api_key}"
        self.legs = LegClient(self.metrics, headers, UPSTREAM_KEEPALIVE_S, UPSTREAM_CONNECT_TIMEOUT_S)
        self.proxy = PDProxy(cfg, self.pool, self.legs, self.metrics, self._leg_connection_failed)
        self.session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None
        self._upkeep_tasks: list[asyncio.Task] = []
        self._request_children: dict[tuple[str, int], tuple] = {}

    def build(self) -> web.Application:
        middlewares = [self._errors_and_metrics, self._auth] if self.cfg.api_key else [self._errors_and_metrics]
        app = web.Application(middlewares=middlewares, client_max_size=self.cfg.max_payload_size)
        for route in Route:
            app.router.add_post(route.value, self._pd_handler(route))
        InfoRoutes(self.cfg, self.pool, self.legs, self.metrics).add_to(app)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        # No cookie jar: a cookie one upstream sets must not ride on other clients' requests.
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=UPSTREAM_CONNECT_TIMEOUT_S),
            cookie_jar=aiohttp.DummyCookieJar())
        self.legs.use_session(self.session)
        for up in self.pool.all():
            self.metrics.upstream_healthy.labels(up.role.value, up.url).set(int(up.health.selectable))
        if self.cfg.worker_startup_timeout_secs:  # config: only with health checks
            await self.health.wait_all_healthy(self.cfg.worker_startup_timeout_secs)
        if self.cfg.health_check_enabled:
            await self.health.check_all()  # route at once if the servers are already up
            self._health_task = asyncio.create_task(self.health.run())
        else:  # still learn DP sizes once
            await asyncio.gather(*(self._refresh_info(up) for up in self.pool.all()))
        for policy in (self.pool.prefill_policy, self.pool.decode_policy):
            if policy.maintenance_interval_s > 0:
                self._upkeep_tasks.append(asyncio.create_task(self._upkeep(policy)))

    @staticmethod
    async def _upkeep(policy: Policy) -> None:
        """Run a policy's maintain() every maintenance_interval_s (cache_aware: LRU eviction, on this
        loop so it never races a pick)."""
        while True:
            await asyncio.sleep(policy.maintenance_interval_s)
            try:
                policy.maintain()
            except Exception:
                log.exception("%s policy upkeep failed", policy.name)

    async def _cleanup(self, app: web.Application) -> None:
        tasks = [t for t in (self._health_task, *self._upkeep_tasks) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        await self.proxy.close()
        await self.health.close()
        self.legs.close()
        if self.session is not None:
            await self.session.close()

    async def _probe(self, up: Upstream) -> None:
        timeout = self.cfg.health_check_timeout_secs
        status, _ = await self.legs.get_status(up.url + self.cfg.health_check_endpoint, timeout)
        if not 200 <= status < 300:
            raise RuntimeError(f"{self.cfg.health_check_endpoint} answered {status}")
        await self._refresh_info(up)

    async def _refresh_info(self, up: Upstream) -> None:
        """DP size and load from /server_info; a server without it still counts as healthy."""
        try:
            self.pool.update_server_info(
                up, await self.legs.get_json(up.url + "/server_info", self.cfg.health_check_timeout_secs))
        except Exception as exc:
            log.debug("server_info of %s failed: %s", up.url, exc)

    def _health_changed(self, up: Upstream, old: HealthState, new: HealthState) -> None:
        self.metrics.upstream_healthy.labels(up.role.value, up.url).set(int(up.health.selectable))
        if not up.health.selectable:  # out of selection: when it returns, its cache may be gone
            self.pool.forget(up)

    def _leg_connection_failed(self, up: Upstream, message: str) -> asyncio.Task | None:
        """A leg failed as if `up` were gone: probe it now (health.py); None without health checks."""
        if self.cfg.health_check_enabled:
            return self.health.confirm(up, message)
        return None

    def _pd_handler(self, route: Route):
        async def handler(request: web.Request) -> web.StreamResponse:
            raw = await request.read()
            body = parse_client_body(raw)
            shape = inspect_request(route, body)
            return await self.proxy.handle(request, body, shape)

        return handler

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.cfg.api_key}".encode()):
                raise Unauthorized("missing or wrong API key (send 'Authorization: Bearer <key>')")
        return await handler(request)

    @web.middleware
    async def _errors_and_metrics(self, request: web.Request, handler):
        t0 = time.perf_counter()
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        try:
            resp = await handler(request)
        except PDServeError as exc:
            resp = error_response(exc.status, exc.message, exc.type)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            etype = "not_found_error" if exc.status == 404 else "invalid_request_error"
            resp = error_response(exc.status, f"{request.method} {request.path}: {exc.reason}", etype)
        except asyncio.CancelledError:
            self.metrics.requests.labels(route, "499").inc()  # client went away
            raise
        except Exception as exc:
            log.exception("router error on %s", request.path)
            resp = error_response(500, f"router internal error: {type(exc).__name__}: {exc}", "internal_error")
        self._count(route, resp.status, time.perf_counter() - t0)
        return resp

    def _count(self, route: str, status: int, seconds: float) -> None:
        key = (route, status)
        children = self._request_children.get(key)
        if children is None:  # labels() costs microseconds; resolve once per (route, status)
            children = (self.metrics.requests.labels(route, str(status)), self.metrics.request_latency.labels(route))
            self._request_children[key] = children
        children[0].inc()
        children[1].observe(seconds)


def _metrics_only_app(metrics: RouterMetrics) -> web.Application:
    app = web.Application()

    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": metrics.content_type})

    app.router.add_get("/metrics", handle)
    return app


async def serve(cfg: RouterConfig, stop: asyncio.Event | None = None) -> None:
    """Run the router until `stop` is set (or SIGINT/SIGTERM). Prints the bound address once up."""
    router = RouterApp(cfg)
    runner = web.AppRunner(router.build(), handler_cancellation=True, access_log=None)
    await runner.setup()
    runners = [runner]
    try:
        await web.TCPSite(runner, cfg.host, cfg.port, backlog=4096).start()
        if cfg.prometheus_port:
            m_runner = web.AppRunner(_metrics_only_app(router.metrics), access_log=None)
            await m_runner.setup()
            runners.append(m_runner)
            await web.TCPSite(m_runner, cfg.prometheus_host or cfg.host, cfg.prometheus_port).start()
        host, port = runner.addresses[0][:2]
        # Start-up objects live forever: keep them out of every later collection (a full one took
        # up to 100 ms in the benchmark, stalling every request in flight), and collect the young
        # generation less often (in-flight request state is traversed again at each collection).
        gc.freeze()
        gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
        print(f"pdserve router listening on http://{host_port(host, port)}", flush=True)
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):
                pass
        await stop.wait()
    finally:
        for r in reversed(runners):
            await r.cleanup()


def run_router(args: argparse.Namespace) -> None:
    """Entry point for `pdserve router`: flags from build_router_parser(), runs until stopped."""
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        sys.exit(f"pdserve router: {exc}")
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop  # lower per-request overhead when present (it ships with uvicorn[standard])
    except ImportError:
        asyncio.run(serve(cfg))
    else:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(cfg))
