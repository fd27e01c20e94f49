"""The OpenAPI document states the refusals JSON Schema can say (issue 37): each body below is
refused (400) by the server and by the document it serves, and each body the document allows
is not refused as invalid (a deadline that has passed is 429, as one the queue cannot meet).
What JSON Schema cannot say (a tool_call_id naming an earlier call, a prompt past the context,
`1.0` for an integer) is listed in tests/gateway/schemathesis.toml."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import MODEL, Stack, run_stack
from tests.gateway.test_errors import assert_error
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.engines.sim import SimEngine

jsonschema = pytest.importorskip("jsonschema")

HI = [{"role": "user", "content": "hi"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
SCHEMAS = {
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/jobs": "JobRequest",
    "/v1/responses": "ResponseRequest",
    "/v1/messages": "MessageRequest",
}


@pytest.fixture(scope="module")
def served(valkey: EmbeddedServer) -> Iterator[tuple[Stack, dict[str, Any]]]:
    """A gateway whose one worker runs the sim engine (no logprobs, no embeddings), and the
    document it serves once the worker has said what it runs."""
    engine = SimEngine(prefill_base=0.0, prefill_per_token=0.0, decode_base=0.0005)
    with run_stack(valkey, engines=[lambda: engine], max_tokens_cap=16) as stack:
        give_up = time.monotonic() + 20
        while not stack.call(stack.gateway_broker.registry.workers(MODEL)):
            assert time.monotonic() < give_up, "the worker never sent a heartbeat"
            time.sleep(0.05)
        time.sleep(1.2)  # the gateway's read of published limits lapses (limits_ttl_s)
        with stack.client() as http:
            doc = http.get("/openapi.json").json()
        yield stack, doc


def allows(doc: dict[str, Any], path: str, body: dict[str, Any]) -> bool:
    schema = {"$ref": f"#/components/schemas/{SCHEMAS[path]}", "components": doc["components"]}
    return bool(jsonschema.Draft202012Validator(schema).is_valid(body))


REFUSED: list[tuple[str, dict[str, Any], str | None]] = [
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "deadline": 0}, "deadline"),
    ("/v1/jobs", {"model": MODEL, "prompt": "hi", "deadline": 30}, "deadline"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, None),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": None}]},
        "messages.0.content",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [*HI, {"role": "tool", "content": "4"}]},
        "messages.1.tool_call_id",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi", "tool_call_id": "c"}]},
        "messages.0.tool_call_id",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi", "tool_calls": [CALL]}]},
        "messages.0.tool_calls",
    ),
    (
        "/v1/responses",
        {"model": MODEL, "input": [{"role": "user", "content": "hi", "colour": "red"}]},
        "input.0.colour",
    ),
    (
        "/v1/messages",
        {"model": MODEL, "max_tokens": 4, "messages": HI, "tool_choice": {"type": "any"}},
        None,
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HI, "logprobs": True}, "logprobs"),
]


@pytest.mark.parametrize(("path", "body", "param"), REFUSED)
def test_what_the_server_refuses_the_document_refuses(
    served: tuple[Stack, dict[str, Any]], path: str, body: dict[str, Any], param: str | None
) -> None:
    stack, doc = served
    with stack.client() as http:
        refused = http.post(path, json=body)
    assert refused.status_code == 400, refused.text
    if path != "/v1/messages":  # Anthropic's error shape has no param
        error = assert_error(refused, 400)
        assert param is None or error["param"] == param, error
    assert not allows(doc, path, body), "the document allows what the server refuses"


def test_embeddings_are_not_offered_where_no_model_embeds(
    served: tuple[Stack, dict[str, Any]],
) -> None:
    stack, doc = served
    with stack.client() as http:
        refused = http.post("/v1/embeddings", json={"model": MODEL, "input": "hi"})
    assert assert_error(refused, 400, "model_not_supported")["param"] == "model"
    assert "/v1/embeddings" not in doc["paths"]


def test_score_and_rerank_are_not_offered_where_no_model_scores(
    served: tuple[Stack, dict[str, Any]],
) -> None:
    stack, doc = served
    with stack.client() as http:
        score = http.post("/v1/score", json={"model": MODEL, "text_1": "a", "text_2": ["b"]})
        rerank = http.post("/rerank", json={"query": "a", "documents": ["b", "c"]})
    for refused in (score, rerank):
        error = assert_error(refused, 400, "model_not_supported")
        assert error["param"] == "model" and f"'{MODEL}' is not a cross-encoder" in error["message"]
    assert "/v1/score" not in doc["paths"] and "/v1/rerank" not in doc["paths"]
    assert "ScoreRequest" not in doc["components"]["schemas"]


def test_what_the_document_allows_is_not_refused_as_invalid(
    served: tuple[Stack, dict[str, Any]],
) -> None:
    stack, doc = served
    now = time.time()
    calls = [
        *HI,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "4", "tool_call_id": "call_1"},
    ]
    cases: list[tuple[str, dict[str, Any], int]] = [
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "deadline": now + 600}, 200),
        ("/v1/chat/completions", {"model": MODEL, "messages": calls}, 200),
        ("/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": "hi"}]}, 200),
        ("/v1/jobs", {"model": MODEL, "prompt": "hi", "deadline": now - 5}, 429),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "deadline": now - 5}, 429),
    ]
    with stack.client() as http:
        for path, body, status in cases:
            assert allows(doc, path, body), (path, body)
            answer = http.post(path, json=body)
            assert answer.status_code == status, (path, answer.text)
    assert "429" in doc["paths"]["/v1/jobs"]["post"]["responses"]
    late = http_error(stack, {"model": MODEL, "prompt": "hi", "deadline": now - 5})
    assert late["code"] == "deadline_unmeetable" and "passed" in late["message"]


def http_error(stack: Stack, body: dict[str, Any]) -> dict[str, Any]:
    with httpx.Client(base_url=stack.url) as http:
        return assert_error(http.post("/v1/jobs", json=body), 429)
