"""Property-based fuzzing of the HTTP layer (hypothesis), over real HTTP on the sim engine:
JSON of the right and wrong shapes for completions, chat and jobs, random headers, random
bytes. Never a 5xx, every error OpenAI's shape, the server alive after, and no quota or
concurrency slot leaked: the tenant (`max_concurrent` 1) still runs a request at the end."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.gateway.conftest import MODEL, Stack, run_stack
from tokenyard.broker.redis import connection_of
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.engines.base import Engine
from tokenyard.engines.sim import SimEngine
from tokenyard.gateway.auth import KeyRing, Tenant
from tokenyard.tenancy.limiter import Quota
from tokenyard.tenancy.records import TenantConfig

KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/jobs")
ERROR_KEYS = {"message", "type", "param", "code"}


def _instant_engine() -> Engine:
    return SimEngine(
        prefill_base=0.0, prefill_per_token=0.0, decode_base=0.0005, decode_per_seq=0.0
    )


@pytest.fixture(scope="module")
def fuzz_stack(valkey: EmbeddedServer) -> Iterator[Stack]:
    """A gateway whose one tenant may hold one job at a time; a small max_tokens cap keeps
    every accepted job short."""
    keys = KeyRing({KEY: Tenant("fuzz")})
    with run_stack(
        valkey,
        engines=[_instant_engine],
        keyring=keys,
        max_tokens_cap=16,
        default_max_tokens=8,
        cache=False,
    ) as stack:
        config = TenantConfig(name="fuzz", quota=Quota(max_concurrent=1))
        stack.call(stack.gateway_broker.directory.put_tenant(config))
        yield stack


# -- what the fuzzer sends ----------------------------------------------------------------------
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
small_ints = st.integers(min_value=-3, max_value=40)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "bogus"])},
        optional={
            "content": st.text(max_size=20)
            | st.none()
            | st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=8)}
                ),
                max_size=2,
            )
            | json_values,
            "name": json_values,
        },
    ),
    max_size=3,
)
# bodies near the real shape: the fields the routes know, values right and wrong
near_right = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, MODEL, "no-such-model", ""]) | json_values},
    optional={
        "prompt": st.text(max_size=20)
        | st.lists(small_ints, max_size=4)
        | st.lists(st.text(max_size=5), max_size=2)
        | json_values,
        "messages": messages | json_values,
        "max_tokens": small_ints | json_values,
        "max_completion_tokens": small_ints,
        "temperature": st.floats(-1, 3, allow_nan=False) | json_values,
        "top_p": st.floats(-0.5, 1.5, allow_nan=False),
        "top_k": st.integers(-2, 1 << 64),
        "seed": st.integers(-(1 << 64), 1 << 64) | json_values,
        "n": st.integers(0, 3),
        "stream": st.booleans() | json_values,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
        "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3) | json_values,
        "priority": st.sampled_from(["high", "normal", "low", "urgent"]),
        "deadline": st.floats(-1e12, 1e12, allow_nan=False) | st.just(time.time() + 600),
        "ignore_eos": st.booleans(),
        "logprobs": json_values,
        "logit_bias": json_values,
        "presence_penalty": json_values,
        "echo": st.booleans(),
        "tools": json_values,
        "response_format": json_values,
        "cache": st.booleans(),
        "unknown_field": json_values,
    },
)


# bodies the routes accept (a completion or a chat request), to mutate one field at a time
valid_options = {
    "max_tokens": st.integers(1, 16),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 50),
    "seed": st.integers(0, 1 << 32),
    "stream": st.booleans(),
    "stop": st.text(min_size=1, max_size=3),
    "priority": st.sampled_from(["high", "normal", "low"]),
    "ignore_eos": st.booleans(),
    "deadline": st.just(time.time() + 600),
}
valid = st.fixed_dictionaries(
    {"model": st.just(MODEL), "prompt": st.text(min_size=1, max_size=20)}, optional=valid_options
) | st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text()}
            ),
            min_size=1,
            max_size=3,
        ),
    },
    optional=valid_options,
)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    kind = draw(
        st.sampled_from(["valid", "valid", "mutated", "mutated", "near", "json", "bytes", "deep"])
    )
    if kind == "valid":
        return json.dumps(draw(valid)).encode()
    if kind == "mutated":
        body = draw(valid)
        field = draw(st.sampled_from([*valid_options, "model", "prompt", "messages", "n", "x"]))
        body[field] = draw(json_values)
        return json.dumps(body).encode()
    if kind == "near":
        return json.dumps(draw(near_right)).encode()
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    if kind == "deep":
        depth = draw(st.integers(50, 80))
        return b"[" * depth + b"]" * depth
    return draw(st.binary(max_size=64))


# printable, no edge spaces (h11 refuses those before they are sent)
header_text = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40)
headers = st.fixed_dictionaries(
    {},
    optional={
        "Content-Type": st.sampled_from(
            [
                "application/json",
                "text/plain",
                "multipart/form-data",
                "application/x-www-form-urlencoded",
            ]
        )
        | header_text,
        "Idempotency-Key": header_text | st.text(st.sampled_from("ab"), min_size=250, max_size=300),
        "Cache-Control": st.sampled_from(["no-cache", "no-store", "max-age=0"]) | header_text,
        "Last-Event-ID": header_text,
        "Authorization": st.sampled_from([*[f"Bearer {KEY}"] * 5, "Bearer nope", "Basic eA==", ""]),
        "traceparent": header_text,
        "Accept": st.sampled_from(["text/event-stream", "*/*"]) | header_text,
        "X-Junk": header_text,
    },
)


def _assert_answer(reply: httpx.Response, body: bytes) -> None:
    """A status below 500; an error is OpenAI's JSON shape; a stream is SSE."""
    assert reply.status_code < 500, (reply.status_code, reply.text[:500], body[:200])
    if reply.status_code >= 400:
        payload = reply.json()
        assert set(payload) == {"error"}, payload
        error = payload["error"]
        assert set(error) == ERROR_KEYS, error
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str)
        assert error["param"] is None or isinstance(error["param"], str)
        assert error["code"] is None or isinstance(error["code"], str)
    elif reply.headers.get("content-type", "").startswith("text/event-stream"):
        assert "data: " in reply.text
    else:
        reply.json()


@settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(path=st.sampled_from(PATHS), body=bodies(), extra=headers, hang_up=st.booleans())
def test_fuzzed_requests_get_openai_answers(
    fuzz_stack: Stack, path: str, body: bytes, extra: dict[str, str], hang_up: bool
) -> None:
    hdrs = {**AUTH, **extra}
    with httpx.Client(base_url=fuzz_stack.url, timeout=30) as client:
        if hang_up:
            # the client leaves after the status line: its job is cancelled, its slot freed
            with client.stream("POST", path, content=body, headers=hdrs) as reply:
                if reply.status_code < 400:
                    event(f"{path} {reply.status_code} hung up")
                    return
                reply.read()
        else:
            reply = client.post(path, content=body, headers=hdrs)
    event(f"{path} {reply.status_code}")  # --hypothesis-show-statistics: what the fuzz reached
    _assert_answer(reply, body)


def test_after_the_fuzz_the_tenant_still_runs_a_request(fuzz_stack: Stack) -> None:
    # runs after the fuzz (file order): its jobs end, and their slot must come back
    good: dict[str, Any] = {"model": MODEL, "prompt": "still here", "max_tokens": 4}
    give_up = time.monotonic() + 15
    with httpx.Client(base_url=fuzz_stack.url, timeout=30, headers=AUTH) as client:
        assert client.get("/healthz").status_code == 200
        while True:
            reply = client.post("/v1/completions", json=good)
            if reply.status_code == 200:
                break
            # 429 only while a fuzzed job still runs; past that, a leaked slot
            assert reply.status_code == 429, reply.text
            assert time.monotonic() < give_up, f"the concurrency slot leaked: {reply.text}"
            time.sleep(0.1)
        assert reply.json()["choices"][0]["finish_reason"] == "length"
    # and nothing stays reserved once that job has ended (settled at its terminal state)
    while (held := fuzz_stack.call(_held(fuzz_stack))) != (0, 0):
        assert time.monotonic() < give_up, f"reservations left after every job ended: {held}"
        time.sleep(0.05)


async def _held(stack: Stack) -> tuple[int, int]:
    """The tenant's jobs holding a concurrency slot, and its jobs holding a reservation."""
    client, keys = connection_of(stack.gateway_broker).client, stack.gateway_broker.queue.keys
    active = await client.hget(keys.quota("fuzz"), "active")
    return int(active or 0), int(await client.hlen(keys.quota_held("fuzz")))
