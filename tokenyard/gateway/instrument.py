"""Every HTTP answer, once, at its end (streams included): counted by route template and status,
logged as one access line, and its request span ended (an ASGI middleware).

Each answer carries the request's id in `X-Request-Id`: the caller's own when it sent a
usable one, else a new one; the access line names it, and for an error the error's code and
message (read from the answer's body, whichever handler wrote it)."""

from __future__ import annotations

import json
import logging
import random
import re
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenyard import tracing
from tokenyard.logs import Fields, trace_id_of
from tokenyard.metrics import GatewayMetrics

if TYPE_CHECKING:
    from tokenyard.gateway.live import CallTimer

ACCESS_LOG = logging.getLogger("tokenyard.access")
_JOB_HEADER = b"x-job-id"
REQUEST_ID_HEADER = b"x-request-id"
# a caller's request id is kept when it is this short and printable (no spaces: it goes into
# log lines and headers as it is); any other is replaced by a new one
_USABLE_ID = re.compile(rb"[!-~]{1,128}")
_ERROR_BODY_MAX = 1 << 16  # an error's body, read for its code and message; larger: not ours
# Probes, scrapes and the dashboard's poll come every few seconds from machines: their lines are
# DEBUG, so INFO reads as the API's traffic.
_POLLED = frozenset({"/health", "/healthz", "/readyz", "/metrics", "/dashboard/data"})


@dataclass(slots=True)
class Access:
    """What the handling of one request learned for its access line: filled as it goes by
    authentication (tenant) and admission (job, call timer)."""

    started: float  # monotonic
    request_id: str | None = None
    tenant: str | None = None
    job_id: str | None = None
    timer: CallTimer | None = None
    trace_id: str | None = None
    error_code: str | None = None  # an error answer's code (its type where it has none)
    reason: str | None = None  # an error answer's message

    def line(self, scope: Scope, status: int, ended: float) -> Fields:
        timer = self.timer
        result = None if timer is None else timer.result
        query = scope.get("query_string", b"")
        client = scope.get("client")
        values: dict[str, Any] = {
            "method": scope.get("method", ""),
            "path": scope.get("path", "") + (f"?{query.decode('latin-1')}" if query else ""),
            "status": status,
            "error_code": self.error_code,
            "reason": self.reason,
            "tenant": self.tenant,
            "job_id": self.job_id,
            "request_id": self.request_id,
            "trace_id": self.trace_id,
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
        request_id = _request_id(scope)
        access = Access(time.monotonic()) if ACCESS_LOG.isEnabledFor(level) else None
        token = None if access is None else _current.set(access)
        held = tracing.hold()
        error_body: bytearray | None = None

        async def watch(message: Message) -> None:
            nonlocal status, error_body
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = message.get("headers", ())
                if not isinstance(headers, list):
                    headers = list(headers)  # read twice below
                for name, _ in headers:
                    if name.lower() == REQUEST_ID_HEADER:
                        break
                else:
                    message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, request_id)]}
                if access is not None:
                    if status >= 400:
                        error_body = bytearray()
                    if access.job_id is None:
                        # a route that names its job only in the answer (following a job)
                        for name, value in headers:
                            if name.lower() == _JOB_HEADER:
                                access.job_id = value.decode("latin-1")
            elif (
                error_body is not None
                and message["type"] == "http.response.body"
                and len(error_body) < _ERROR_BODY_MAX
            ):
                error_body += message.get("body", b"")
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            if access is not None:
                access.request_id = request_id.decode("latin-1")
                access.trace_id = _trace_id(scope, held)
                if error_body:
                    access.error_code, access.reason = _error_of(bytes(error_body))
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


def _request_id(scope: Scope) -> bytes:
    """The caller's X-Request-Id when usable, else a new one."""
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER:  # ASGI servers give header names in lower case
            if _USABLE_ID.fullmatch(value):
                return bytes(value)
            break
    # 128 random bits, as uuid4's, from the process's generator (reseeded in a forked child):
    # an id to find lines by, not a secret, so not worth uuid4's system call on every request
    return b"%032x" % random.getrandbits(128)


def _trace_id(scope: Scope, held: tracing.Held | None) -> str | None:
    """The request span's trace id when tracing is on; else the trace of the caller's own
    `traceparent`, which the job carries to the worker's lines (`tracing.carry`)."""
    if held is not None and held.spans:
        return f"{held.spans[0].get_span_context().trace_id:032x}"
    for name, value in scope.get("headers", ()):
        if name == b"traceparent":
            return trace_id_of({"traceparent": value.decode("latin-1")})
    return None


def _error_of(body: bytes) -> tuple[str | None, str | None]:
    """(code, message) of an error answer in OpenAI's shape ({"error": {message, code, ...}})
    or Anthropic's ({"type": "error", "error": {type, message}}); Nones for any other body."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None, None
    if not isinstance(error, dict):
        return None, None
    code, message = error.get("code") or error.get("type"), error.get("message")
    return (
        None if code is None else str(code),
        None if message is None else " ".join(str(message).split()),
    )
