"""ASGI middleware counting every HTTP request by route and the status it was answered with
(streams count when their headers go out; 499 when the client left first)."""

from __future__ import annotations

from typing import Callable


class HTTPMetricsMiddleware:
    """`count(route, status)` once per request; routes outside `paths` count as "other" so the
    label set stays bounded. Outermost, so it also sees what inner middlewares refuse (401)."""

    def __init__(self, app, count: Callable[[str, int], None], paths: frozenset[str]):
        self.app = app
        self.count = count
        self.paths = paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in self.paths else "other"
        counted = False

        async def send_counting(message) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.count(route, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            if not counted:  # the app ended without answering (cancelled, crashed)
                self.count(route, 500)
