"""Request limits: body size (as ASGI middleware), max_tokens cap and the model's context."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenyard.gateway.errors import ApiError, error_body


class BodyTooLarge(HTTPException):
    """Raised from receive(); FastAPI re-raises HTTPExceptions met while reading a body."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"Request body exceeds {limit} bytes")


class BodyLimitMiddleware:
    """Refuses bodies over `max_bytes`: by Content-Length up front, else while they stream in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _send_413(send, self.max_bytes)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited, send)


async def _send_413(send: Send, limit: int) -> None:
    body = json.dumps(
        error_body(
            f"Request body exceeds {limit} bytes",
            "invalid_request_error",
            None,
            "request_too_large",
        )
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def resolve_max_tokens(
    requested: int | None,
    default: int,
    cap: int,
    prompt_tokens: int,
    max_model_len: int,
    prompt_param: str = "prompt",
) -> int:
    """The max_tokens a job gets; refuses a request over the cap or over the context."""
    if requested is not None and requested > cap:
        raise ApiError(
            400,
            f"max_tokens is {requested}, above this server's limit of {cap}",
            param="max_tokens",
            code="max_tokens_exceeded",
        )
    room = max_model_len - prompt_tokens
    if requested is None:
        if room < 1:
            raise _too_long(prompt_tokens, 1, max_model_len, prompt_param)
        return min(default, cap, room)
    if requested > room:
        raise _too_long(prompt_tokens, requested, max_model_len, prompt_param)
    return requested


def _too_long(prompt_tokens: int, max_tokens: int, max_model_len: int, param: str) -> ApiError:
    return ApiError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
        f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
        param=param,
        code="context_length_exceeded",
    )
