"""Counts every HTTP answer by route template and status (an ASGI middleware)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenyard.metrics import GatewayMetrics


class RequestMetricsMiddleware:
    """Labels use the route's template, never the raw path, so job ids cannot explode them."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the client gets if the app raises before answering

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(scope.get("method", ""), template, str(status)).inc()
