"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions and /v1/models."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from tokenyard import tracing
from tokenyard.gateway import protocol
from tokenyard.gateway.admission import tool_reader
from tokenyard.gateway.auth import Tenant, TenantDep
from tokenyard.gateway.cached import CACHE_HEADER, cached_response
from tokenyard.gateway.openapi import SSE, answers, json_body
from tokenyard.gateway.responses import FastJSONResponse
from tokenyard.gateway.state import gateway
from tokenyard.gateway.streaming import OpenAIRenderer
from tokenyard.gateway.submit import Hit, Live, submit
from tokenyard.gateway.tools import parse_whole

router = APIRouter()
# a completion: its JSON, or its chunks as SSE with `stream`; 409 a cancelled job, 500 a job
# that failed on every attempt, 503 one that expired in the queue, 504 the request timeout
_COMPLETION = {
    **answers(404, 409, 429, 500, 503, 504),
    200: {
        "description": "The completion (JSON), or its chunks (SSE) with `stream`",
        "content": SSE,
    },
}


@router.get("/v1/models")
async def list_models(request: Request, tenant: TenantDep) -> JSONResponse:
    state = gateway(request)
    return JSONResponse(protocol.models_body(state.settings.models, int(state.started_at)))


@router.post("/v1/completions", responses=_COMPLETION, openapi_extra=json_body("CompletionRequest"))
async def completions(request: Request, tenant: TenantDep) -> Response:
    return await create_completion(request, tenant)


@router.post(
    "/v1/chat/completions",
    responses=_COMPLETION,
    openapi_extra=json_body("ChatCompletionRequest"),
)
async def chat_completions(request: Request, tenant: TenantDep) -> Response:
    return await create_chat_completion(request, tenant)


# The handlers proper, called by the routes above and by `gateway/fast.py` (which serves these
# paths without FastAPI's routing and dependency injection).
async def create_completion(request: Request, tenant: Tenant) -> Response:
    started = time.monotonic()
    with tracing.server_span("POST /v1/completions", request.headers):
        body = protocol.parse(protocol.CompletionRequest, await request.body())
        return await _serve(request, "completion", body, tenant, started)


async def create_chat_completion(request: Request, tenant: Tenant) -> Response:
    started = time.monotonic()
    with tracing.server_span("POST /v1/chat/completions", request.headers):
        body = protocol.parse(protocol.ChatCompletionRequest, await request.body())
        return await _serve(request, "chat", body, tenant, started)


async def _serve(
    request: Request,
    kind: protocol.Kind,
    body: protocol.CompletionRequest | protocol.ChatCompletionRequest,
    tenant: Tenant,
    started: float,
) -> Response:
    """Both endpoints' answer: the cached one, or the job (its own, or an identical one in
    flight) followed live, as SSE or as the result's JSON."""
    state = gateway(request)
    outcome = await submit(state, kind, body, tenant, Live(request.headers, started))
    tools = tool_reader(state, body, outcome.spec.model)
    if isinstance(outcome, Hit):
        return cached_response(kind, body, outcome.spec, outcome.result, tools)
    spec, call = outcome.spec, outcome.call
    created = int(spec.created_at)
    job_id = call.job_id  # a collapsed call's is the job it joined
    headers = {"X-Job-Id": job_id, **outcome.headers}
    if body.stream:
        renderer = OpenAIRenderer(
            kind,
            job_id,
            spec.model,
            created,
            include_usage=body.include_usage,
            resumed=False,
            token_ids=body.return_token_ids,
            tools=tools,
        )
        return await call.stream(renderer, headers, timeout_s=state.settings.request_timeout_s)
    result = await call.result(lambda: until_disconnect(request))
    failed = protocol.result_error(result)
    if failed is not None:
        return FastJSONResponse(failed[1], status_code=failed[0], headers=headers)
    parsed = None if tools is None else parse_whole(tools, result.text)
    return FastJSONResponse(
        protocol.completion_body(
            kind,
            job_id,
            spec.model,
            created,
            result,
            token_ids=body.return_token_ids,
            parsed=parsed,
        ),
        headers=headers,
    )


async def until_disconnect(request: Request) -> None:
    # The body is already read, so the next message the server hands us is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.post(
    "/v1/embeddings",
    responses=answers(404, 429, 500, 503, 504),
    openapi_extra=json_body("EmbeddingRequest"),
)
async def embeddings(request: Request, tenant: TenantDep) -> Response:
    """An embeddings job followed live, or its cached answer (vectors depend only on inputs)."""
    started = time.monotonic()
    with tracing.server_span("POST /v1/embeddings", request.headers):
        body = protocol.parse(protocol.EmbeddingRequest, await request.body())
        state = gateway(request)
        outcome = await submit(state, "embedding", body, tenant, Live(request.headers, started))
        if isinstance(outcome, Hit):
            content = protocol.embedding_body(
                outcome.spec.model, outcome.result, body.encoding_format
            )
            return FastJSONResponse(content, headers={CACHE_HEADER: "hit"})
        call = outcome.call
        headers = {"X-Job-Id": call.job_id, **outcome.headers}
        result = await call.result(lambda: until_disconnect(request))
        failed = protocol.result_error(result)
        if failed is not None:
            return FastJSONResponse(failed[1], status_code=failed[0], headers=headers)
        content = protocol.embedding_body(outcome.spec.model, result, body.encoding_format)
        return FastJSONResponse(content, headers=headers)
