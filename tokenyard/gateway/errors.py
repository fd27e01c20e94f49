"""The HTTP edge of the error taxonomy: every error leaves as OpenAI's shape,
{"error": {message, type, param, code}}, except on Anthropic's Messages API (`ANTHROPIC_PATH`),
where it leaves as Anthropic's, {"type": "error", "error": {type, message}}, with its statuses.

Errors that mean something outside HTTP are `tokenyard.errors` classes (raised anywhere, mapped
here once); `ApiError` carries only answers that exist at the HTTP edge (401, 409, 413, 499,
504 and route errors). Invalid parameter values are 400, as OpenAI and vLLM answer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match

from tokenyard.errors import BrokerUnavailable, InvalidRequest, NotFound, QueueFull, UserError
from tokenyard.gateway.responses import FastJSONResponse

log = logging.getLogger(__name__)

_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    503: "service_unavailable",
    504: "timeout_error",
}


class ApiError(Exception):
    """An error answer with its HTTP status; raised anywhere below a route."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPE_OF_STATUS.get(status, "server_error")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class RateLimited(ApiError):
    """429 for now: the tenant's quota or the queue's estimated wait refused the request, and
    the same request may pass later (a batch line waits a tick on it instead of failing)."""

    def __init__(self, message: str, *, code: str, headers: Mapping[str, str]) -> None:
        super().__init__(429, message, code=code, headers=headers)


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# Anthropic's error type of each status it answers (docs.claude.com/en/api/errors)
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
ANTHROPIC_PATH = "/v1/messages"


def anthropic_path(path: str) -> bool:
    """Whether a request path is Anthropic's API, whose errors take Anthropic's shape; decided
    by path, so the errors raised before a route runs (the key, the body limit) take it too."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_error(
    status: int, message: str, param: str | None = None
) -> tuple[int, dict[str, Any]]:
    """An error's status and body as Anthropic answers them. A 503 (the broker unreachable, a
    job expired in the queue) is its 529 overloaded_error, which its clients retry; any other
    4xx is invalid_request_error, as Anthropic's docs say, any other 5xx api_error. Its body
    has no `param`: the message leads with the parameter, as Anthropic's do, unless it names
    it already."""
    if param and param not in message:
        message = f"{param}: {message}"
    if status == 503:
        status = 529
    type_ = _ANTHROPIC_TYPES.get(status)
    if type_ is None:
        type_ = "api_error" if status >= 500 else "invalid_request_error"
    return status, {"type": "error", "error": {"type": type_, "message": message}}


def error_response(exc: ApiError, path: str = "") -> JSONResponse:
    """The answer to `exc` on a request to `path`: in OpenAI's shape, or Anthropic's there."""
    status, body = exc.status, exc.body()
    if anthropic_path(path):
        status, body = anthropic_error(status, exc.message, exc.param)
    return FastJSONResponse(body, status_code=status, headers=exc.headers or None)


def _answer(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc, request.scope.get("path", ""))


def unsupported(param: str, detail: str = "") -> InvalidRequest:
    what = f"'{param}'{' ' + detail if detail else ''}"
    return InvalidRequest(
        f"{what} is not supported by this server", param=param, code="unsupported_parameter"
    )


def renamed(exc: InvalidRequest, names: Mapping[str, str]) -> InvalidRequest:
    """An admission error (which names the chat request's fields) with its parameter named as
    the API the client called names it (the Responses and the Messages API)."""
    name = names.get(exc.param or "")
    if name is None:
        return exc
    assert exc.param is not None
    message = exc.message.replace(f"'{exc.param}'", f"'{name}'").replace(exc.param, name)
    return InvalidRequest(message, param=name, code=exc.code)


def validation_error(errors: list[Any]) -> InvalidRequest:
    """A pydantic error list as one OpenAI error: 400 invalid_request_error naming the first
    bad parameter, as OpenAI and vLLM answer (so `openai.BadRequestError` catches it)."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return InvalidRequest(
            f"The request body is not valid JSON{': ' + detail if detail else ''}",
            code="invalid_json",
        )
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    where = f"Invalid value for '{param}': " if param else "Invalid request body: "
    extra = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return InvalidRequest(f"{where}{msg}{extra}", param=param, code="invalid_value")


def _retry_after(request: Request) -> int:
    state = getattr(request.app.state, "gateway", None)
    return int(getattr(getattr(state, "settings", None), "retry_after_s", 1))


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _answer(request, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        err = ApiError(404, f"No route for {request.method} {request.url.path}", code="not_found")
    elif exc.status_code == 405:
        err = ApiError(
            405,
            f"Method {request.method} is not allowed on {request.url.path}",
            code="method_not_allowed",
        )
        headers["Allow"] = ", ".join(_allowed(request))
    elif exc.status_code == 413:
        err = ApiError(413, str(exc.detail), code="request_too_large")
    else:
        err = ApiError(exc.status_code, str(exc.detail))
    err.headers.update(headers)
    return _answer(request, err)


def _allowed(request: Request) -> list[str]:
    """Every method some route serves on the request's path: Starlette's 405 names only the
    first route that matched the path (GET /v1/batches hid POST)."""
    scope = {**request.scope, "method": ""}
    methods: set[str] = set()
    for route in _leaves(request.app.router.routes):
        if route.matches(scope)[0] is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


def _leaves(routes: Iterable[Any]) -> Iterator[Any]:
    # FastAPI >= 0.160 keeps an included router whole (its `original_router`), not its routes
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _leaves(inner.routes)
        else:
            yield route


async def _request_validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return _answer(request, _of_user_error(validation_error(list(exc.errors()))))


def _retry_later(request: Request, status: int, message: str, code: str) -> Response:
    """A refusal the client may retry after the gateway's `retry_after_s`."""
    headers = {"Retry-After": str(_retry_after(request))}
    return _answer(request, ApiError(status, message, code=code, headers=headers))


async def _queue_full(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, QueueFull)
    return _retry_later(request, 429, "The queue for this model is full; retry later", "queue_full")


async def _broker_down(request: Request, exc: Exception) -> Response:
    log.warning("broker unavailable: %s", exc)
    return _retry_later(
        request, 503, "The job queue is unavailable; retry later", "broker_unavailable"
    )


def status_of(exc: UserError) -> int:
    """The HTTP status of a wrong request: 404 for what does not exist, else 400."""
    return 404 if isinstance(exc, NotFound) else 400


def _of_user_error(exc: UserError) -> ApiError:
    return ApiError(
        status_of(exc), exc.message, param=exc.param, code=exc.code, type_="invalid_request_error"
    )


async def _user_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, UserError)
    return _answer(request, _of_user_error(exc))


async def _unexpected(request: Request, exc: Exception) -> Response:
    # The traceback goes to the log, never to the client.
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    error = ApiError(500, "Internal server error", type_="server_error")
    # the server closes this connection after the answer (the error is re-raised to it): said
    # here, a keep-alive client opens another for its next request instead of meeting a reset
    error.headers["Connection"] = "close"
    return _answer(request, error)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers; the catch-all turns any other exception into a bare 500."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(QueueFull, _queue_full)
    app.add_exception_handler(BrokerUnavailable, _broker_down)
    app.add_exception_handler(UserError, _user_error)  # InvalidRequest 400, NotFound 404
    app.add_exception_handler(Exception, _unexpected)
