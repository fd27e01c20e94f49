"""The OpenAPI document and the routes around it: who may read it (`docs_public`), the statuses
and bodies it declares, and the Allow header of a 405 naming every method of the path."""

from __future__ import annotations

import pytest

from tests.gateway.conftest import Stack, run_stack
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.gateway.auth import KeyRing, Tenant

KEYS = KeyRing({"sk-acme": Tenant("acme")})
DOCS = ("/openapi.json", "/docs", "/redoc", "/dashboard")


@pytest.mark.parametrize("public", [True, False])
def test_docs_answer_without_a_key_only_when_public(valkey: EmbeddedServer, public: bool) -> None:
    with run_stack(valkey, keyring=KEYS, docs_public=public) as stack, stack.client() as client:
        for path in DOCS:
            bare = client.get(path)
            if public:
                assert bare.status_code == 200, path
            else:
                assert bare.status_code == 401, path
                assert bare.json()["error"]["type"] == "authentication_error"
            keyed = client.get(path, headers={"Authorization": "Bearer sk-acme"})
            assert keyed.status_code == 200, path
        # the API itself needs a key either way; the probes never do
        assert client.get("/v1/models").status_code == 401
        assert client.get("/healthz").status_code == 200


def test_the_document_declares_bodies_statuses_and_content_types(stack: Stack) -> None:
    with stack.client() as client:
        doc = client.get("/openapi.json").json()
    paths = doc["paths"]
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas  # invalid input is 400, never 422
    for path, operations in paths.items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            # Anthropic's API answers 529 where the others answer 503
            unavailable = "529" if path.startswith("/v1/messages") else "503"
            if path not in ("/health", "/healthz", "/readyz"):  # probes: no key
                assert {"400", "401", unavailable} <= set(responses), (method, path)
    completions = paths["/v1/completions"]["post"]
    assert completions["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"
    }
    assert {"404", "413", "429"} <= set(completions["responses"])
    assert "text/event-stream" in completions["responses"]["200"]["content"]
    assert schemas["CompletionRequest"]["properties"]["model"] == {"enum": [stack.model]}
    jobs = paths["/v1/jobs"]["post"]
    assert {"200", "202", "409", "429"} <= set(jobs["responses"])
    assert "$ref" in str(paths["/v1/batches"]["post"]["requestBody"])
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    error = schemas["Error"]["properties"]["error"]
    assert error["required"] == ["message", "type", "param", "code"]
    messages = paths["/v1/messages"]["post"]
    assert messages["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/MessageRequest"
    }
    assert "503" not in messages["responses"]
    anthropic_error = {"$ref": "#/components/schemas/AnthropicError"}
    for status in ("400", "401", "404", "413", "429", "500", "504", "529"):
        assert messages["responses"][status]["content"]["application/json"]["schema"] == (
            anthropic_error
        ), status
    assert schemas["AnthropicError"]["required"] == ["type", "error"]
    assert schemas["MessageRequest"]["required"] == ["model", "max_tokens", "messages"]


def test_a_405_allows_every_method_of_the_path(stack: Stack) -> None:
    with stack.client() as client:
        for path, allowed in [
            ("/v1/batches", "GET, POST"),
            ("/v1/files/file-x", "DELETE, GET"),
            ("/v1/jobs/x", "DELETE, GET"),
            ("/v1/completions", "POST"),
        ]:
            reply = client.request("OPTIONS", path)
            assert reply.status_code == 405, path
            assert reply.headers["allow"] == allowed, path
            assert reply.json()["error"]["code"] == "method_not_allowed"
