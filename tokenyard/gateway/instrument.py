"""Every HTTP answer, once, at its end (streams included): counted by route template and status,
logged as one access line, and its request span ended (an ASGI middleware)."""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenyard import tracing
from tokenyard.logs import Fields
from tokenyard.metrics import GatewayMetrics

if TYPE_CHECKING:
    from tokenyard.gateway.live import CallTimer

ACCESS_LOG = logging.getLogger("tokenyard.access")
_JOB_HEADER = b"x-job-id"
# Probes, scrapes and the dashboard's poll come every few seconds from machines: their lines are
# DEBUG, so INFO reads as the API's traffic.
_POLLED = frozenset({"/healthz", "/readyz", "/metrics", "/dashboard/data"})


@dataclass(slots=True)
class Access:
    """What the handling of one request learned for its access line: filled as it goes by
    authentication (tenant) and admission (job, call timer)."""

    started: float  # monotonic
    tenant: str | None = None
    job_id: str | None = None
    timer: CallTimer | None = None

    def line(self, scope: Scope, status: int, ended: float) -> Fields:
        timer = self.timer
        result = None if timer is None else timer.result
        query = scope.get("query_string", b"")
        client = scope.get("client")
        values: dict[str, Any] = {
            "method": scope.get("method", ""),
            "path": scope.get("path", "") + (f"?{query.decode('latin-1')}" if query else ""),
            "status": status,
            "tenant": self.tenant,
            "job_id": self.job_id,
            "queue_ms": _ms(None if result is None else result.queued_s),
            "ttft_ms": _ms(None if timer is None else timer.ttft_s),
            "total_ms": _ms(ended - self.started),
            "prompt_tokens": None if result is None else result.prompt_tokens,
            "completion_tokens": None if result is None else result.completion_tokens,
            "client": client[0] if client else None,
        }
        return Fields("", values, head=("method", "path", "status"))


# The request being answered in this task, while access lines are on (else always None).
_current: ContextVar[Access | None] = ContextVar("tokenyard_access", default=None)


def current_access() -> Access | None:
    """The access record of the request this code runs for; None when access lines are off."""
    return _current.get()


class RequestMetricsMiddleware:
    """Labels use the route's template, never the raw path, so job ids cannot explode them.

    The access line costs nothing below INFO: no record is made and nothing is formatted."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the client gets if the app raises before answering
        level = logging.DEBUG if scope["path"] in _POLLED else logging.INFO
        access = Access(time.monotonic()) if ACCESS_LOG.isEnabledFor(level) else None
        token = None if access is None else _current.set(access)
        held = tracing.hold()

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                if access is not None and access.job_id is None:
                    # a route that names its job only in the answer (following an existing job)
                    for name, value in message.get("headers", ()):
                        if name.lower() == _JOB_HEADER:
                            access.job_id = value.decode("latin-1")
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            if held is not None:
                tracing.release(held)
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(scope.get("method", ""), template, str(status)).inc()
            if access is not None and token is not None:
                _current.reset(token)
                ACCESS_LOG.log(level, access.line(scope, status, time.monotonic()))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)
