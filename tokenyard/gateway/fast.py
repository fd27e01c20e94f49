"""The hot POST routes served straight from ASGI, without FastAPI's middleware stack, router
and dependency injection (~0.3 ms of CPU per request on the 2-core box, docs/benchmarks.md):
`GatewayApp` (gateway/app.py) hands them to a stack of their own, the catch-all 500, the
request metrics and the body limit around `FastRoutes`.

The FastAPI routes stay registered: they document these paths in /openapi.json and /docs, and
serve them when `fast_routes` is off. Both call the same handlers, and an error raised here
goes through the app's own exception handlers, so answers are the same either way.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tokenyard.gateway import routes
from tokenyard.gateway.auth import authenticate
from tokenyard.gateway.routes import jobs, messages, openai
from tokenyard.gateway.routes.jobs import IDEMPOTENCY_KEY_MAX

Handler = Callable[[Request], Awaitable[Response]]


async def _completions(request: Request) -> Response:
    return await openai.create_completion(request, await authenticate(request))


async def _chat_completions(request: Request) -> Response:
    return await openai.create_chat_completion(request, await authenticate(request))


async def _messages(request: Request) -> Response:
    return await messages.create_message(request, await authenticate(request))


async def _jobs(request: Request) -> Response:
    tenant = await authenticate(request)  # FastAPI solves the key before the header, too
    key = request.headers.get("idempotency-key")
    if key is not None and len(key) > IDEMPOTENCY_KEY_MAX:
        # what FastAPI's Header(max_length=...) check raises, for the same handler
        raise RequestValidationError(
            [
                {
                    "type": "string_too_long",
                    "loc": ("header", "idempotency-key"),
                    "msg": f"String should have at most {IDEMPOTENCY_KEY_MAX} characters",
                    "input": key,
                    "ctx": {"max_length": IDEMPOTENCY_KEY_MAX},
                }
            ]
        )
    return await jobs.submit_job(request, tenant, key)


_HANDLERS: dict[str, Handler] = {
    "/v1/completions": _completions,
    "/v1/chat/completions": _chat_completions,
    "/v1/jobs": _jobs,
    "/v1/messages": _messages,
}


def fast_routes() -> dict[str, tuple[APIRoute, Handler]]:
    """Each fast POST path with the FastAPI route it stands for (metrics label by its path)."""
    documented = {
        route.path: route
        for router in routes.ROUTERS
        for route in router.routes
        if isinstance(route, APIRoute) and "POST" in (route.methods or ())
    }
    return {path: (documented[path], handler) for path, handler in _HANDLERS.items()}


class FastRoutes:
    """ASGI app answering a POST to one of `routes`; `serves` tells which requests those are."""

    def __init__(self, routes: Mapping[str, tuple[APIRoute, Handler]]) -> None:
        self.routes = dict(routes)

    def serves(self, scope: Scope) -> bool:
        return (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in self.routes
            and not scope.get("root_path")
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route, handler = self.routes[scope["path"]]
        # what FastAPI's routing leaves in the scope (the metrics label reads `route`)
        scope["route"] = route
        scope["endpoint"] = route.endpoint
        scope["path_params"] = {}
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except Exception as exc:
            response = await _handled(request, exc)
        await response(scope, receive, send)


async def _handled(request: Request, exc: Exception) -> Response:
    """The response the app's exception handlers give `exc`, looked up as Starlette's
    ExceptionMiddleware does; re-raised when none (the catch-all 500 is outermost)."""
    handlers: dict[Any, Callable[..., Any]] = request.app.exception_handlers
    handler = None
    if isinstance(exc, HTTPException) and exc.status_code != 500:
        handler = handlers.get(exc.status_code)
    if handler is None:
        for cls in type(exc).__mro__:
            if cls is not Exception and cls in handlers:
                handler = handlers[cls]
                break
    if handler is None:
        raise exc
    response = handler(request, exc)
    if inspect.isawaitable(response):
        response = await response
    assert isinstance(response, Response)
    return response
