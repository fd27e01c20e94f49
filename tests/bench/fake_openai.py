"""A minimal OpenAI-compatible streaming server on a free port, for end-to-end bench tests.

It streams one chunk per output token after a short delay, reports usage when asked, and can
refuse every k-th request with 429 or break a stream on request.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

BREAK_STREAM = "BREAK-STREAM"


@dataclass
class FakeState:
    """Knobs a test turns, and what the server saw."""

    first_token_delay_s: float = 0.01
    token_delay_s: float = 0.002
    reject_every: int = 0  # 0: never; k: every k-th request gets 429
    calls: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    authorization: list[str | None] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


def _chunk(kind: str, text: str | None, finish: str | None = None) -> dict[str, Any]:
    if kind == "chat":
        delta = {} if text is None else {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish}
        obj = "text_completion"
    return {"id": "cmpl-1", "object": obj, "created": 0, "model": "fake", "choices": [choice]}


def _sse(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


def make_app(state: FakeState) -> Starlette:
    async def handle(request: Request, kind: str) -> Response:
        body = await request.json()
        state.calls += 1
        state.bodies.append(body)
        state.authorization.append(request.headers.get("authorization"))
        if state.reject_every and state.calls % state.reject_every == 0:
            return JSONResponse(
                {
                    "error": {
                        "message": "rate limited",
                        "type": "rate_limit",
                        "code": "rate_limit_exceeded",
                    }
                },
                status_code=429,
            )
        prompt = body.get("prompt") if kind == "completions" else json.dumps(body.get("messages"))
        tokens = int(body["max_tokens"])
        usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def stream() -> AsyncIterator[bytes]:
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                if kind == "chat":  # the role chunk carries no text and is not a token
                    yield _sse(_chunk(kind, ""))
                await asyncio.sleep(state.first_token_delay_s)
                for i in range(tokens):
                    if i:
                        await asyncio.sleep(state.token_delay_s)
                    if BREAK_STREAM in str(prompt) and i == 1:
                        yield _sse({"error": {"message": "engine died", "code": "engine"}})
                        yield b"data: [DONE]\n\n"
                        return
                    yield _sse(_chunk(kind, f" t{i}"))
                yield _sse(_chunk(kind, None, "length"))
                if usage:
                    yield _sse(
                        {
                            "id": "cmpl-1",
                            "object": "x",
                            "choices": [],
                            "usage": {
                                "prompt_tokens": len(str(prompt).split()),
                                "completion_tokens": tokens,
                                "total_tokens": tokens + len(str(prompt).split()),
                            },
                        }
                    )
                yield b"data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def completions(request: Request) -> Response:
        return await handle(request, "completions")

    async def chat(request: Request) -> Response:
        return await handle(request, "chat")

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )


@dataclass
class FakeServer:
    url: str  # the base URL, ending in /v1
    state: FakeState


@contextmanager
def running_fake_server() -> Iterator[FakeServer]:
    """Serve the fake API with uvicorn in a background thread until the block ends."""
    state = FakeState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(make_app(state), log_level="warning", lifespan="off", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the fake OpenAI server did not start")
        time.sleep(0.01)
    try:
        yield FakeServer(url=f"http://127.0.0.1:{port}/v1", state=state)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
