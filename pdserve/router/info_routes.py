"""The router's non-generation routes: health, health_generate, server_info, model info, metrics,
and flush_cache (sent on to every server)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from pdserve.core.config import Role
from pdserve.core.errors import Unavailable

from .config import RouterConfig
from .legs import LegClient, upstream_error_text
from .metrics import RouterMetrics
from .pd_body import decode, encode
from .upstream import Upstream, UpstreamPool


def _json(data, status: int = 200) -> web.Response:
    return web.Response(status=status, body=encode(data), content_type="application/json")


class InfoRoutes:
    def __init__(self, cfg: RouterConfig, pool: UpstreamPool, legs: LegClient, metrics: RouterMetrics):
        self.cfg, self.pool, self.legs, self.metrics = cfg, pool, legs, metrics

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health_generate)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info", "/v1/models"):
            app.router.add_get(path, self.from_first_decode)
        app.router.add_get("/metrics", self.metrics_text)
        for method in ("POST", "GET"):  # as sglang-router and SGLang's servers
            app.router.add_route(method, "/flush_cache", self.flush_cache)

    async def health(self, request: web.Request) -> web.Response:
        """200 while at least one prefill and one decode server are selectable."""
        counts = {role.value: len(self.pool.selectable(role)) for role in (Role.PREFILL, Role.DECODE)}
        missing = [role for role, n in counts.items() if n == 0]
        if missing:
            raise Unavailable(f"no healthy {' and no healthy '.join(missing)} server; "
                              f"upstreams: {[up.describe() for up in self.pool.all()]}")
        return _json({"status": "ok", "healthy": counts})

    async def health_generate(self, request: web.Request) -> web.Response:
        """Every selectable server must pass its own /health_generate."""
        targets = self.pool.selectable(Role.PREFILL) + self.pool.selectable(Role.DECODE)
        if not self.pool.selectable(Role.PREFILL) or not self.pool.selectable(Role.DECODE):
            raise Unavailable("no healthy prefill/decode pair to check")
        timeout = min(self.cfg.request_timeout_secs, 60.0)
        results = await asyncio.gather(*(self._probe_generate(up, timeout) for up in targets))
        failed = [msg for msg in results if msg]
        if failed:
            raise Unavailable("health_generate failed: " + "; ".join(failed))
        return _json({"status": "ok", "checked": [up.url for up in targets]})

    async def _probe_generate(self, up: Upstream, timeout: float) -> str:
        try:
            status, raw = await self.legs.get_status(up.url + "/health_generate", timeout)
        except Exception as exc:
            return f"{up.role.value} server {up.url}: {type(exc).__name__}: {exc}"
        return "" if status < 400 else f"{up.role.value} server {up.url}: {status} {upstream_error_text(raw)[0]}"

    async def server_info(self, request: web.Request) -> web.Response:
        """The router's config and every upstream's own server_info (fetched now)."""
        ups = self.pool.all()
        infos = await asyncio.gather(*(self._fetch_info(up) for up in ups))
        by_role: dict[str, list] = {Role.PREFILL.value: [], Role.DECODE.value: []}
        for up, info in zip(ups, infos):
            by_role[up.role.value].append({**up.describe(), **info})
        model_path = next((e["server_info"].get("model_path") for e in by_role["decode"] if e.get("server_info")),
                          None)
        return _json({"router": self.cfg.describe(), "disaggregation_mode": "router", "model_path": model_path,
                      **by_role})

    async def _fetch_info(self, up: Upstream) -> dict:
        try:
            info = await self.legs.get_json(up.url + "/server_info", self.cfg.health_check_timeout_secs)
        except Exception as exc:
            return {"server_info": up.server_info, "error": f"{type(exc).__name__}: {exc}"}
        self.pool.update_server_info(up, info)
        return {"server_info": info}

    async def from_first_decode(self, request: web.Request) -> web.Response:
        """/v1/models and model_info come from the first healthy decode server."""
        up = self.pool.first_healthy(Role.DECODE)
        try:
            status, raw = await self.legs.get_status(up.url + request.path, self.cfg.health_check_timeout_secs)
        except Exception as exc:
            raise Unavailable(f"decode server {up.url} {request.path}: {type(exc).__name__}: {exc}") from None
        return web.Response(status=status, body=raw, content_type="application/json")

    async def flush_cache(self, request: web.Request) -> web.Response:
        """Every prefill and decode server empties its prefix cache; 503 naming those that failed."""
        ups = self.pool.all()
        timeout = self.cfg.health_check_timeout_secs
        results = await asyncio.gather(*(self._flush_one(up, timeout) for up in ups))
        failed = [r["error"] for r in results if "error" in r]
        if failed:
            raise Unavailable("flush_cache failed on: " + "; ".join(failed))
        return _json({"success": True, "message": "Cache flushed on every server.", "servers": results})

    async def _flush_one(self, up: Upstream, timeout: float) -> dict:
        try:
            status, raw = await self.legs.post_status(up.url + "/flush_cache", timeout)
        except Exception as exc:
            return {"url": up.url, "error": f"{up.role.value} server {up.url}: {type(exc).__name__}: {exc}"}
        if status >= 400:
            return {"url": up.url, "error": f"{up.role.value} server {up.url}: {status} {upstream_error_text(raw)[0]}"}
        self.pool.forget(up)  # its prefix cache is empty now
        try:
            flushed = decode(raw).get("flushed_pages")
        except Exception:
            flushed = None
        return {"url": up.url, "role": up.role.value, "flushed_pages": flushed}

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": self.metrics.content_type})
