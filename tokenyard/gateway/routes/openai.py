"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions and /v1/models."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from tokenyard import tracing
from tokenyard.errors import QueueFull
from tokenyard.gateway import protocol, quota, shedding
from tokenyard.gateway.admission import admit
from tokenyard.gateway.auth import Tenant, TenantDep
from tokenyard.gateway.cache import collapse_key
from tokenyard.gateway.cached import CACHE_HEADER, cache_digest, cached_response
from tokenyard.gateway.live import LiveCall
from tokenyard.gateway.responses import FastJSONResponse
from tokenyard.gateway.state import gateway
from tokenyard.gateway.streaming import OpenAIRenderer

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request, tenant: TenantDep) -> JSONResponse:
    state = gateway(request)
    return JSONResponse(protocol.models_body(state.settings.models, int(state.started_at)))


@router.post("/v1/completions")
async def completions(request: Request, tenant: TenantDep) -> Response:
    return await create_completion(request, tenant)


@router.post("/v1/chat/completions")
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
    """One path for both endpoints: a job whose caller follows it live, unless a deterministic
    request is answered from the cache or joins an identical job in flight."""
    state = gateway(request)
    with tracing.span("tokenyard.admission"):
        spec = await admit(state, kind, body, tenant, live=True)
        digest = cache_digest(state, spec, body, request)
        if digest is not None and state.settings.cache:
            # before the quota: a cached answer uses no engine
            hit = await state.cache.get(spec.model, digest)
            if hit is not None:
                return cached_response(kind, body, spec, hit)
        await shedding.check(state, spec, own_deadline=body.deadline is not None)
        limits = await quota.reserve(state, tenant, spec)
    if digest is not None and state.settings.collapse:
        spec.collapse_key = collapse_key(digest, spec.stream)
    tracing.carry(spec, request.headers)
    with tracing.span("tokenyard.enqueue", **{"tokenyard.job_id": spec.id}):
        try:
            call = await LiveCall.start(state, spec, started)
        except QueueFull:
            await quota.refund(state, spec)
            raise
    if call.collapsed:
        await quota.refund(state, spec)  # it joined another job: no job of its own to settle
    if digest is not None and state.settings.cache:
        call.on_result = lambda result: state.cache.put(spec.model, digest, result)
    created = int(spec.created_at)
    job_id = call.job_id  # a collapsed call's is the job it joined
    headers = {"X-Job-Id": job_id, **limits}
    if digest is not None:
        headers[CACHE_HEADER] = "collapsed" if call.collapsed else "miss"
    if body.stream:
        renderer = OpenAIRenderer(
            kind,
            job_id,
            spec.model,
            created,
            include_usage=body.include_usage,
            resumed=False,
            token_ids=body.return_token_ids,
        )
        return await call.stream(renderer, headers, timeout_s=state.settings.request_timeout_s)
    result = await call.result(lambda: _until_disconnect(request))
    failed = protocol.result_error(result)
    if failed is not None:
        return FastJSONResponse(failed[1], status_code=failed[0], headers=headers)
    return FastJSONResponse(
        protocol.completion_body(
            kind, job_id, spec.model, created, result, token_ids=body.return_token_ids
        ),
        headers=headers,
    )


async def _until_disconnect(request: Request) -> None:
    # The body is already read, so the next message the server hands us is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
