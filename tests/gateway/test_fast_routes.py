"""The hot POST routes served without FastAPI's routing (gateway/fast.py) answer exactly as the
FastAPI routes do, count under the same metric labels, and stay documented in /openapi.json."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.middleware.errors import ServerErrorMiddleware

from tests.gateway.conftest import MODEL, Stack, run_stack
from tokenyard.broker import connect
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings
from tokenyard.gateway import GatewaySettings, create_app
from tokenyard.gateway import submit as submit_path
from tokenyard.gateway.auth import KeyRing, Tenant
from tokenyard.gateway.fast import FastRoutes
from tokenyard.gateway.instrument import RequestMetricsMiddleware
from tokenyard.gateway.limits import BodyLimitMiddleware

KEY = {"Authorization": "Bearer sk-acme"}
OK = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0.0}
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 2,
    "temperature": 0.0,
}
BIG = json.dumps({**OK, "prompt": "x" * 3000}).encode()
MESSAGE = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 2,
    "temperature": 0.0,
}
X_KEY = {"x-api-key": "sk-acme", "anthropic-version": "2023-06-01"}


def _chunked() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
    for i in range(0, len(BIG), 512):
        yield BIG[i : i + 512]


# (method, path, body, extra headers); a bytes body is sent as is, a callable streams chunks
CASES: list[tuple[str, str, Any, dict[str, str]]] = [
    ("POST", "/v1/completions", OK, KEY),
    ("POST", "/v1/chat/completions", CHAT, KEY),
    ("POST", "/v1/jobs", OK, KEY),
    ("POST", "/v1/jobs", CHAT, {**KEY, "Idempotency-Key": "k-1"}),
    ("POST", "/v1/jobs", OK, {**KEY, "Idempotency-Key": "k-1"}),  # reused: 409
    ("POST", "/v1/jobs", OK, {**KEY, "Idempotency-Key": "k" * 257}),
    ("POST", "/v1/jobs", {**OK, "stream": True}, KEY),
    ("POST", "/v1/completions", OK, {}),  # no key: 401
    ("POST", "/v1/completions", OK, {"Authorization": "Bearer sk-wrong"}),
    ("POST", "/v1/completions", b'{"model": "sim-model", "prompt": ', KEY),
    ("POST", "/v1/completions", b"", KEY),
    ("POST", "/v1/completions", {**OK, "model": "gpt-9"}, KEY),
    ("POST", "/v1/completions", {**OK, "frobnicate": 1}, KEY),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, KEY),
    ("POST", "/v1/completions", {**OK, "max_tokens": 100_000}, KEY),
    ("POST", "/v1/completions", BIG, KEY),  # 413 by Content-Length
    ("POST", "/v1/completions", _chunked, KEY),  # 413 while reading
    ("GET", "/v1/completions", None, KEY),  # 405, through FastAPI either way
    ("POST", "/v1/completions/", OK, KEY),  # FastAPI's slash redirect either way
    # Anthropic's API: its keys, its error shape and statuses
    ("POST", "/v1/messages", MESSAGE, X_KEY),
    ("POST", "/v1/messages", {**MESSAGE, "stream": True}, KEY),
    ("POST", "/v1/messages", MESSAGE, {}),
    ("POST", "/v1/messages", {**MESSAGE, "max_tokens": None}, X_KEY),
    ("POST", "/v1/messages", {**MESSAGE, "model": "gpt-9"}, X_KEY),
    ("POST", "/v1/messages", BIG, X_KEY),
    ("GET", "/v1/messages", None, X_KEY),
]
_VOLATILE = re.compile(r"[0-9a-f]{8,}[0-9a-f-]*")  # job ids in ids, urls and headers
# per answer, never alike: dropped (a request id is on every answer, both ways: checked below)
_DROPPED_HEADERS = {"date", "content-length", "location", "x-job-id", "x-request-id"}


def _answer(http: httpx.Client, method: str, path: str, body: Any, headers: dict[str, str]) -> Any:
    if callable(body):
        content = body()
    elif isinstance(body, bytes):
        content = body
    else:
        content = None if body is None else json.dumps(body).encode()
    response = http.request(method, path, content=content, headers=headers)
    if response.status_code != 500:  # the catch-all 500 is answered outside the middleware
        assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"]), response.headers
    kept = {k: v for k, v in response.headers.items() if k not in _DROPPED_HEADERS}
    try:
        payload = response.json()
    except ValueError:
        payload = response.text
    return response.status_code, kept, _normalized(payload)


def _normalized(value: Any) -> Any:
    if isinstance(value, dict):
        skip = ("created", "created_at", "deadline")
        return {k: None if k in skip else _normalized(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalized(v) for v in value]
    if isinstance(value, str):
        return _VOLATILE.sub("<id>", value)
    return value


@pytest.fixture(scope="module")
def stacks(valkey: EmbeddedServer) -> Iterator[dict[bool, Stack]]:
    keyring = KeyRing({"sk-acme": Tenant("acme", admin=True)})
    options: dict[str, Any] = {"keyring": keyring, "max_body_bytes": 2048}
    with (
        run_stack(valkey, fast_routes=True, **options) as fast,
        run_stack(valkey, fast_routes=False, **options) as slow,
    ):
        yield {True: fast, False: slow}


def test_fast_routes_answer_as_fastapi_does(stacks: dict[bool, Stack]) -> None:
    answers: dict[bool, list[Any]] = {}
    for fast, stack in stacks.items():
        with stack.client(follow_redirects=False) as http:
            answers[fast] = [_answer(http, *case) for case in CASES]
    for case, on, off in zip(CASES, answers[True], answers[False], strict=True):
        assert on == off, case[:2]
    statuses = [status for status, _, _ in answers[True]]
    assert statuses == [200, 200, 202, 202, 409, 400, 400, 401, 401, 400, 400, 404, 400, 400,
                        400, 413, 413, 405, 307, 200, 200, 401, 400, 404, 413, 405]  # fmt: skip
    for status, _, body in answers[True][-6:]:
        if status != 200:
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}


def test_an_unexpected_error_is_the_same_bare_500_either_way(
    stacks: dict[bool, Stack], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("internals the client must not see")

    monkeypatch.setattr(submit_path, "admit", broken)
    answers = {}
    for fast, stack in stacks.items():
        with stack.client() as http:
            answers[fast] = _answer(http, "POST", "/v1/completions", OK, KEY)
    assert answers[True] == answers[False]
    status, _, body = answers[True]
    assert status == 500 and body["error"]["type"] == "server_error"
    assert "internals" not in json.dumps(body)
    for fast, stack in stacks.items():
        with stack.client() as http:
            answers[fast] = _answer(http, "POST", "/v1/messages", MESSAGE, KEY)
    assert answers[True] == answers[False]
    assert answers[True][0] == 500
    assert answers[True][2] == {
        "type": "error",
        "error": {"type": "api_error", "message": "Internal server error"},
    }


def test_fast_routes_count_under_the_route_template(stacks: dict[bool, Stack]) -> None:
    def requests_counted(stack: Stack) -> set[str]:
        with stack.client() as http:
            http.post("/v1/completions", json=OK, headers=KEY)
            http.post("/v1/completions", json={**OK, "n": 2}, headers=KEY)
            text = http.get("/metrics", headers=KEY).text
        return {
            line.rsplit(" ", 1)[0]
            for line in text.splitlines()
            if line.startswith("tokenyard_http_requests_total{") and 'method="POST"' in line
        }

    fast, slow = requests_counted(stacks[True]), requests_counted(stacks[False])
    assert fast == slow
    assert 'tokenyard_http_requests_total{method="POST",route="/v1/completions",status="200"}' in (
        fast
    )


def test_fast_routes_stay_in_the_openapi_schema(stacks: dict[bool, Stack]) -> None:
    schemas = [httpx.get(f"{stacks[fast].url}/openapi.json").json() for fast in (True, False)]
    assert schemas[0] == schemas[1]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/jobs"):
        assert "post" in schemas[0]["paths"][path]
    jobs = schemas[0]["paths"]["/v1/jobs"]["post"]
    assert any(p["name"] == "idempotency-key" for p in jobs["parameters"])


@pytest.mark.parametrize("on", [True, False])
def test_fast_routes_sit_inside_the_metrics_and_body_limit(
    on: bool, valkey: EmbeddedServer
) -> None:
    settings = GatewaySettings(models=(MODEL,), tokenizer="sim", fast_routes=on)
    backend = connect(BrokerSettings(url=valkey.url))  # built, never used: no connection opens
    app = create_app(settings, backend, tokenizers={}, keyring=KeyRing())
    assert (app.fast_stack is not None) is on
    stacks = [app.build_middleware_stack(), *([app.fast_stack] if app.fast_stack else [])]
    for stack in stacks:  # the full stack and the hot routes' own have the same layers
        layers, layer = [], stack
        while hasattr(layer, "app"):
            layers.append(type(layer))
            layer = layer.app
        assert layers.index(ServerErrorMiddleware) < layers.index(RequestMetricsMiddleware)
        assert layers.index(RequestMetricsMiddleware) < layers.index(BodyLimitMiddleware)
    if on:  # the hot routes' stack ends in them, the full one never reaches them
        assert isinstance(layer, FastRoutes)
