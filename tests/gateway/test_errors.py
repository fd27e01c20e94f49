"""Bad input and unavailable backends: each gets its status and an OpenAI-shaped error."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import MODEL, Stack, run_stack
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.engines.sim import SimTokenizer
from tokenyard.fleet.launch import free_port
from tokenyard.gateway.auth import KeyRing, Tenant
from tokenyard.messages import Priority


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    if code is not None:
        assert error["code"] == code, error
    return dict(error)


OK = {"model": MODEL, "prompt": "hello", "max_tokens": 2}


@pytest.mark.parametrize(
    ("path", "content", "status", "code", "param"),
    [
        ("/v1/completions", b'{"model": "sim-model", "prompt": ', 400, "invalid_json", None),
        ("/v1/completions", b"", 400, "invalid_json", None),
        ("/v1/completions", {**OK, "max_tokens": "many"}, 400, "invalid_value", "max_tokens"),
        ("/v1/completions", {**OK, "temperature": 3.5}, 400, "invalid_value", "temperature"),
        ("/v1/completions", {"model": MODEL}, 400, "invalid_value", "prompt"),
        ("/v1/completions", [1, 2, 3], 400, "invalid_value", None),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": "hi"},
            400,
            "invalid_value",
            "messages",
        ),
        ("/v1/completions", {**OK, "model": "gpt-9"}, 404, "model_not_found", "model"),
        (
            "/v1/completions",
            {**OK, "prompt": "x" * 4095, "max_tokens": 2},
            400,
            "context_length_exceeded",
            "prompt",
        ),
        (
            "/v1/completions",
            {**OK, "max_tokens": 100_000},
            400,
            "max_tokens_exceeded",
            "max_tokens",
        ),
        ("/v1/completions", {**OK, "prompt": [5, 10**6]}, 400, "invalid_prompt", "prompt"),
        ("/v1/completions", {**OK, "prompt": [5, -1]}, 400, "invalid_prompt", "prompt"),
        ("/v1/completions", {**OK, "n": 10_000}, 400, "invalid_value", "n"),
        ("/v1/jobs", {**OK, "n": 2}, 400, "unsupported_parameter", "n"),
        ("/v1/completions", {**OK, "logprobs": 2}, 400, "unsupported_parameter", "logprobs"),
        # several prompts are served (a job each); more than the gateway's max_prompts are not
        ("/v1/completions", {**OK, "prompt": ["a"] * 65}, 400, "invalid_value", "prompt"),
        ("/v1/completions", {**OK, "frobnicate": True}, 400, "unknown_parameter", "frobnicate"),
        # no keys, so no tier: `high` is refused, not quietly served at normal
        ("/v1/completions", {**OK, "priority": "high"}, 400, "priority_not_allowed", "priority"),
        ("/v1/jobs", {**OK, "priority": "high"}, 400, "priority_not_allowed", "priority"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "priority": "high"},
            400,
            "priority_not_allowed",
            "priority",
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function"}],
            },
            400,
            None,
            "tools.0.function",
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                    }
                ],
            },
            400,
            "unsupported_parameter",
            "messages.0.content.0",
        ),
    ],
)
def test_bad_input(
    stack: Stack, path: str, content: Any, status: int, code: str | None, param: str | None
) -> None:
    raw = content if isinstance(content, bytes) else json.dumps(content).encode()
    with stack.client() as http:
        response = http.post(path, content=raw, headers={"content-type": "application/json"})
    error = assert_error(response, status, code)
    assert error["param"] == param


def test_oversized_body_is_413_with_and_without_content_length(valkey: EmbeddedServer) -> None:
    with run_stack(valkey, max_body_bytes=2048) as stack, stack.client() as http:
        big = json.dumps({**OK, "prompt": "x" * 4000}).encode()
        assert_error(http.post("/v1/completions", content=big), 413, "request_too_large")

        def chunked() -> Any:  # no Content-Length: the limit applies while reading
            for i in range(0, len(big), 512):
                yield big[i : i + 512]

        assert_error(http.post("/v1/completions", content=chunked()), 413, "request_too_large")
        # small bodies still work
        assert http.post("/v1/completions", json=OK).status_code == 200


def test_unknown_route_method_and_job(stack: Stack) -> None:
    with stack.client() as http:
        assert_error(http.get("/v2/nothing"), 404, "not_found")
        assert_error(http.get("/v1/completions"), 405, "method_not_allowed")
        assert_error(http.get("/v1/jobs/not-a-job"), 404, "job_not_found")
        assert_error(http.get("/v1/jobs/0123abcd-ffff"), 404, "job_not_found")
        assert_error(http.delete("/v1/jobs/cmpl-0123abcd-ffff"), 404, "job_not_found")
        assert_error(http.get("/v1/jobs/x/events", headers={"Last-Event-ID": "x"}), 404)


def test_api_keys_map_to_tenants(valkey: EmbeddedServer) -> None:
    keyring = KeyRing(
        {"sk-gold": Tenant("gold", Priority.HIGH), "sk-free": Tenant("free", Priority.LOW)}
    )
    with run_stack(valkey, keyring=keyring) as stack, stack.client() as http:
        assert_error(http.get("/v1/models"), 401, "missing_api_key")
        assert_error(
            http.post("/v1/completions", json=OK, headers={"Authorization": "Bearer sk-nope"}),
            401,
            "invalid_api_key",
        )
        gold = {"Authorization": "Bearer sk-gold"}
        free = {"Authorization": "Bearer sk-free"}
        assert http.get("/v1/models", headers=gold).status_code == 200
        # health endpoints need no key
        assert http.get("/healthz").status_code == 200

        job = http.post("/v1/jobs", json=OK, headers=gold).json()
        assert (job["tenant"], job["priority"]) == ("gold", "high")
        # a tenant may lower its priority, never raise it above its tier
        low = http.post("/v1/jobs", json={**OK, "priority": "low"}, headers=gold).json()
        assert low["priority"] == "low"
        capped = http.post("/v1/jobs", json={**OK, "priority": "high"}, headers=free).json()
        assert capped["priority"] == "low"
        # another tenant's job does not exist for you
        assert_error(http.get(f"/v1/jobs/{job['id']}", headers=free), 404)
        assert http.get(f"/v1/jobs/{job['id']}", headers=gold).status_code == 200


def test_full_queue_is_429_with_retry_after(valkey: EmbeddedServer) -> None:
    # no worker, and room for one job per lane
    with (
        run_stack(valkey, engines=[], broker_options={"max_queue_depth": 1}) as stack,
        stack.client() as http,
    ):
        assert http.post("/v1/jobs", json=OK).status_code == 202
        full = http.post("/v1/jobs", json=OK)
        assert_error(full, 429, "queue_full")
        assert full.headers["retry-after"] == "1"
        assert_error(http.get("/readyz"), 503, "no_live_worker")
        metrics = http.get("/metrics").text
        assert 'tokenyard_rejections_total{reason="queue_full"} 1.0' in metrics
        assert f'tokenyard_queue_depth{{model="{MODEL}",priority="normal"}} 1.0' in metrics


def test_unreachable_broker_is_503(valkey: EmbeddedServer) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    with run_stack(valkey, engines=[], broker_url=dead) as stack, stack.client() as http:
        down = http.post("/v1/completions", json=OK)
        assert_error(down, 503, "broker_unavailable")
        assert_error(http.post("/v1/jobs", json=OK), 503)
        assert_error(http.get("/readyz"), 503, "broker_unavailable")
        assert http.get("/healthz").status_code == 200
        assert "tokenyard_broker_up 0.0" in http.get("/metrics").text


class _BrokenTokenizer(SimTokenizer):
    def encode(self, text: str) -> list[int]:
        raise RuntimeError("secret internals")


def test_unexpected_errors_are_a_bare_500(valkey: EmbeddedServer) -> None:
    with (
        run_stack(valkey, engines=[], tokenizer=_BrokenTokenizer()) as stack,
        stack.client() as http,
    ):
        answer = http.post("/v1/completions", json=OK)
        error = assert_error(answer, 500)
        assert error["message"] == "Internal server error"
        assert error["type"] == "server_error"
        # the connection it came on is closed: the same client's next request gets its answer
        assert answer.headers["connection"] == "close"
        assert_error(http.post("/v1/jobs", json=OK), 500)
        assert http.get("/healthz").status_code == 200
