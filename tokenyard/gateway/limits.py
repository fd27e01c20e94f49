"""Request limits at the gateway: body size (as ASGI middleware), the max_tokens cap and
default, and the model limits its live workers publish (the rule itself is `tokenyard.limits`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenyard.broker.tables import WorkerRegistry
from tokenyard.engines.base import EngineTokenizer
from tokenyard.errors import InvalidRequest
from tokenyard.gateway.errors import ApiError, error_response
from tokenyard.gateway.refresh import RefreshAhead
from tokenyard.limits import context_length_exceeded, loosest
from tokenyard.messages import Feature, ModelLimits

# How much of an oversize body is read (and dropped) before its 413 goes out. A server that
# answers and closes with the body still arriving makes the kernel reset the connection, and a
# client that sends its whole body before it reads (most do) then sees the reset, not the 413.
DRAIN_BYTES = 16 << 20
_LENGTH_DIGITS = 20  # a Content-Length of more digits is past 2^64 bytes


class BodyTooLarge(HTTPException):
    """Raised from receive(); FastAPI re-raises HTTPExceptions met while reading a body.
    `close`: the rest of the body was left unread, so the connection must close."""

    def __init__(self, limit: int, *, close: bool = False) -> None:
        headers = {"Connection": "close"} if close else None
        super().__init__(413, f"Request body exceeds {limit} bytes", headers=headers)


async def _drain(receive: Receive, more: bool, budget: int) -> bool:
    """Read and drop the rest of a request body, up to `budget` bytes; whether it all came."""
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return False  # the client left
        budget -= len(message.get("body", b""))
        more = bool(message.get("more_body", False))
        if more and budget < 0:
            return False
    return True


class BodyLimitMiddleware:
    """Refuses bodies over `max_bytes` with 413: by Content-Length up front, else while they
    stream in. Up to `drain_bytes` more of the body are read first, so the client that is still
    sending gets its answer, and the connection survives when the body ends within them."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        per_path: dict[str, int] | None = None,
        drain_bytes: int = DRAIN_BYTES,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.per_path = per_path or {}  # exact paths with their own limit (file uploads)
        self.drain_bytes = drain_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.per_path.get(scope.get("path", ""), self.max_bytes)
        declared: bytes | None = None
        chunked = expects_continue = False
        for name, value in scope.get("headers") or ():
            if name == b"content-length":
                declared = value
            elif name == b"transfer-encoding":
                chunked = True
            elif name == b"expect":
                expects_continue = value.lower() == b"100-continue"
        if declared is not None and declared.isdigit():
            # int() refuses more than 4,300 digits; 20 already say more bytes than any limit
            length = int(declared) if len(declared) <= _LENGTH_DIGITS else 1 << 64
            if length > max_bytes:
                # a client waiting for 100 Continue has sent no body: nothing to drain
                drained = not expects_continue and length <= max_bytes + self.drain_bytes
                if drained:
                    drained = await _drain(receive, True, length)
                await _send_413(scope, send, max_bytes, close=not drained)
                return
            if not chunked:
                # the server frames the body by Content-Length: it cannot grow past it
                await self.app(scope, receive, send)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_bytes:
                    more = bool(message.get("more_body", False))
                    drained = await _drain(receive, more, self.drain_bytes)
                    raise BodyTooLarge(max_bytes, close=not drained)
            return message

        await self.app(scope, limited, send)


async def _send_413(scope: Scope, send: Send, limit: int, *, close: bool) -> None:
    # in the shape of the path's API, as the exception handlers answer the 413 raised later
    error = ApiError(413, f"Request body exceeds {limit} bytes", code="request_too_large")
    if close:
        error.headers["Connection"] = "close"
    await error_response(error, scope.get("path", ""))(scope, _no_receive, send)


async def _no_receive() -> Message:
    # a JSON response reads nothing; the body was drained (or is left with the connection)
    return {"type": "http.disconnect"}


def resolve_max_tokens(
    requested: int | None,
    default: int,
    cap: int,
    prompt_tokens: int,
    context: int,
    prompt_param: str = "prompt",
) -> int:
    """The max_tokens a job gets: the request's, else a default that fits the context.

    A request over the cap is refused; whether it fits the model is `tokenyard.limits.refusal`.
    """
    if requested is not None and requested > cap:
        raise InvalidRequest(
            f"max_tokens is {requested}, above this server's limit of {cap}",
            param="max_tokens",
            code="max_tokens_exceeded",
        )
    if requested is not None:
        return requested
    room = context - prompt_tokens
    if room < 1:
        raise context_length_exceeded(prompt_tokens, 1, context, prompt_param)
    return min(default, cap, room)


class PublishedLimits:
    """What each model's live workers can take, from their heartbeats, read at most every
    `ttl_s` per model and refreshed ahead of that (`gateway/refresh.py`), so no request waits
    on the read while the model has traffic; a model none of whose workers published falls
    back to its tokenizer."""

    def __init__(
        self,
        registry: WorkerRegistry,
        ttl_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self._published = RefreshAhead(self._read, ttl_s, clock)
        self._revisions: dict[str, str | None] = {}

    async def of(self, model: str, tokenizer: EngineTokenizer) -> ModelLimits:
        published = await self._published.get(model)
        if published is not None:
            return published
        own = tokenizer.max_model_len
        # until a worker says what it runs, every task, adapter and optional feature is
        # admitted; its worker decides (its scheduler applies the same rule to its own limits)
        return ModelLimits(
            max_model_len=own,
            max_seqs=1,
            token_budget=own,
            vocab_size=tokenizer.vocab_size,
            embeds=True,
            scores=True,
            adapters=True,
            matryoshka=True,
            features=frozenset(Feature),
        )

    async def _read(self, model: str) -> ModelLimits | None:
        workers = await self.registry.workers(model)
        published = loosest(w.limits for w in workers if w.limits is not None)
        revisions = {w.limits.revision if w.limits else "" for w in workers}
        if revisions:
            # none live (a late heartbeat under load, a restart) says nothing about the weights:
            # the revision last seen stands until a worker shows another
            self._revisions[model] = revisions.pop() if len(revisions) == 1 else None
        return published

    def revision(self, model: str) -> str | None:
        """The weights every live worker of `model` served at the last `of` that saw any; None
        when none was ever seen, or workers differ (a rollout): then nothing is cached or
        collapsed."""
        return self._revisions.get(model) or None
