"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions and /v1/models."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from tokenyard.gateway import protocol
from tokenyard.gateway.admission import admit
from tokenyard.gateway.auth import Tenant, authenticate
from tokenyard.gateway.dispatch import CallTimer, collect, submit
from tokenyard.gateway.errors import ApiError
from tokenyard.gateway.state import GatewayState, gateway
from tokenyard.gateway.streaming import (
    EventStreamResponse,
    OpenAIRenderer,
    event_stream,
    primed,
)
from tokenyard.messages import JobResult

router = APIRouter()
TenantDep = Annotated[Tenant, Depends(authenticate)]


@router.get("/v1/models")
async def list_models(request: Request, tenant: TenantDep) -> JSONResponse:
    state = gateway(request)
    created = int(state.started_at)
    data = [protocol.model_card(m, created) for m in state.settings.models]
    return JSONResponse({"object": "list", "data": data})


@router.post("/v1/completions")
async def completions(request: Request, tenant: TenantDep) -> Response:
    started = time.monotonic()
    body = protocol.parse(protocol.CompletionRequest, await request.body())
    return await _serve(request, "completion", body, tenant, started)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, tenant: TenantDep) -> Response:
    started = time.monotonic()
    body = protocol.parse(protocol.ChatCompletionRequest, await request.body())
    return await _serve(request, "chat", body, tenant, started)


async def _serve(
    request: Request,
    kind: protocol.Kind,
    body: protocol.CompletionRequest | protocol.ChatCompletionRequest,
    tenant: Tenant,
    started: float,
) -> Response:
    """One path for both endpoints: a job whose caller follows its events."""
    state = gateway(request)
    spec = await admit(state, kind, body, tenant, live=True)
    await submit(state.broker, state.metrics, spec)
    state.abandonment.own(spec.id)
    timer = CallTimer(state.metrics, spec.model, started=started)
    created = int(spec.created_at)
    headers = {"X-Job-Id": spec.id}
    if body.stream:
        renderer = OpenAIRenderer(
            kind,
            spec.id,
            spec.model,
            created,
            include_usage=body.include_usage,
            resumed=False,
            token_ids=body.return_token_ids,
        )
        frames = await primed(
            event_stream(
                state,
                spec.id,
                renderer,
                timer=timer,
                timeout_s=state.settings.request_timeout_s,
                fresh=True,
            )
        )
        return EventStreamResponse(frames, headers)
    result = await wait_or_cancel(state, request, spec.id, timer)
    failed = protocol.result_error(result)
    if failed is not None:
        return JSONResponse(failed[1], status_code=failed[0], headers=headers)
    return JSONResponse(
        protocol.completion_body(
            kind, spec.id, spec.model, created, result, token_ids=body.return_token_ids
        ),
        headers=headers,
    )


async def _until_disconnect(request: Request) -> None:
    # The body is already read, so the next message the server hands us is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def wait_or_cancel(
    state: GatewayState, request: Request, job_id: str, timer: CallTimer
) -> JobResult:
    """Wait for the job's result; if the client leaves or time runs out, cancel the job."""
    abandonment = state.abandonment
    abandonment.attach(job_id)
    finished = False
    result = asyncio.ensure_future(collect(state.reader, job_id, timer, fresh=True))
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait(
            {result, gone},
            timeout=state.settings.request_timeout_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
        if result in done:
            value = result.result()  # a reader error propagates, and the job is cancelled
            finished = True
            return value
        if gone in done:
            raise ApiError(499, "The client closed the request", code="client_closed")
        raise ApiError(504, "The request timed out", code="timeout")
    finally:
        gone.cancel()
        result.cancel()
        # not awaited: the job's cancellation below ends the reader even if the cancel above
        # were lost; the callback only retrieves its outcome
        result.add_done_callback(_retrieve)
        with anyio.CancelScope(shield=True):
            await abandonment.detach(job_id, finished=finished, grace=False)


def _retrieve(task: asyncio.Future[JobResult]) -> None:
    if not task.cancelled():
        task.exception()
