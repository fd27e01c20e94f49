"""The async jobs API: submit, inspect, follow (resumable SSE) and cancel."""

from __future__ import annotations

from typing import Annotated

import msgspec
from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from tokenyard import tracing
from tokenyard.broker import is_job_id
from tokenyard.broker.core import CancelOutcome
from tokenyard.errors import InvalidRequest, NotFound
from tokenyard.gateway import protocol
from tokenyard.gateway.auth import Tenant, TenantDep
from tokenyard.gateway.errors import ApiError
from tokenyard.gateway.events import event_order
from tokenyard.gateway.jsonbody import check_json
from tokenyard.gateway.live import LiveCall
from tokenyard.gateway.openapi import SSE, answers, json_body
from tokenyard.gateway.responses import FastJSONResponse
from tokenyard.gateway.state import GatewayState, gateway
from tokenyard.gateway.streaming import (
    ChunkHead,
    JobRenderer,
    OpenAIRenderer,
    Renderer,
    last_event_id,
)
from tokenyard.gateway.submit import Later, submit
from tokenyard.gateway.tools import job_reader
from tokenyard.messages import Finished, JobRecord, JobSpec

router = APIRouter()
IDEMPOTENCY_KEY_MAX = 256  # characters


def split_id(raw: str) -> tuple[str, protocol.Kind | None]:
    """A job id, bare or as a completion id (cmpl-…, chatcmpl-…), and the kind it names."""
    for kind, prefix in protocol.ID_PREFIX.items():
        if raw.startswith(prefix):
            return raw[len(prefix) :], kind
    return raw, None


async def _record_of(state: GatewayState, raw_id: str, tenant: Tenant) -> tuple[JobRecord, str]:
    """The tenant's job; another tenant's job is as invisible as a missing one."""
    job_id, _ = split_id(raw_id)
    if not is_job_id(job_id):
        raise _no_job(raw_id)
    record = await state.backend.queue.record(job_id)
    if record is None or record.spec.tenant != tenant.name:
        raise _no_job(raw_id)
    return record, job_id


def _no_job(raw_id: str) -> NotFound:
    return NotFound(f"No job with id '{raw_id}'", code="job_not_found")


def _same_request(a: JobSpec, b: JobSpec) -> bool:
    # `calls`: tool_choice none and auto make the same prompt, but their answers read apart;
    # so do include_reasoning true and false
    return (
        a.model,
        a.prompt,
        a.prompt_token_ids,
        a.sampling,
        a.priority,
        a.calls,
        a.reasoning,
    ) == (b.model, b.prompt, b.prompt_token_ids, b.sampling, b.priority, b.calls, b.reasoning)


@router.post(
    "/v1/jobs",
    responses={
        **answers(404, 409, 429),
        200: {"description": "The job this Idempotency-Key already made (Idempotent-Replayed)"},
        202: {"description": "Queued: the job, and its Location"},
    },
    openapi_extra=json_body("JobRequest"),
)
async def create_job(
    request: Request,
    tenant: TenantDep,
    idempotency_key: Annotated[str | None, Header(max_length=IDEMPOTENCY_KEY_MAX)] = None,
) -> Response:
    """Enqueue a completions or chat body (chosen by `messages`); answers 202 at once."""
    return await submit_job(request, tenant, idempotency_key)


async def submit_job(request: Request, tenant: Tenant, idempotency_key: str | None) -> Response:
    """The handler of POST /v1/jobs, also called by `gateway/fast.py`."""
    state = gateway(request)
    raw = await request.body()
    if raw.strip():
        check_json(raw)  # before the first parser sees it
    try:
        decoded = msgspec.json.decode(raw) if raw.strip() else None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(
            f"The request body is not valid JSON: {exc}", code="invalid_json"
        ) from exc
    is_chat = isinstance(decoded, dict) and "messages" in decoded
    kind: protocol.Kind = "chat" if is_chat else "completion"
    model = protocol.ChatCompletionRequest if is_chat else protocol.CompletionRequest
    body = protocol.parse(model, raw, checked=True)
    if body.stream:
        raise InvalidRequest(
            "'stream' is not allowed here; follow GET /v1/jobs/{id}/events", param="stream"
        )
    with tracing.server_span("POST /v1/jobs", request.headers):
        how = Later(idempotency_key, request.headers)
        queued = await submit(state, kind, body, tenant, how)
    headers = {"Location": f"/v1/jobs/{queued.job_id}", **queued.headers}
    if queued.created:
        # the job was queued just now: its answer needs no read of the record
        return FastJSONResponse(
            protocol.queued_job_body(queued.spec), status_code=202, headers=headers
        )
    existing = await state.backend.queue.record(queued.job_id)
    if existing is not None and not _same_request(existing.spec, queued.spec):
        raise ApiError(
            409,
            "This Idempotency-Key was already used with a different request",
            param="Idempotency-Key",
            code="idempotency_key_reused",
        )
    view = protocol.job_body(queued.job_id, existing) if existing else {"id": queued.job_id}
    return FastJSONResponse(
        view, status_code=200, headers={**headers, "Idempotent-Replayed": "true"}
    )


@router.get("/v1/jobs/{job_id}", responses=answers(404))
async def get_job(request: Request, job_id: str, tenant: TenantDep) -> JSONResponse:
    record, bare = await _record_of(gateway(request), job_id, tenant)
    return JSONResponse(protocol.job_body(bare, record))


@router.get(
    "/v1/jobs/{job_id}/events",
    responses={**answers(404), 200: {"description": "The job's events", "content": SSE}},
)
async def job_events(
    request: Request,
    job_id: str,
    tenant: TenantDep,
    after: Annotated[str | None, Query(max_length=64)] = None,
    include_usage: bool = False,
) -> Response:
    """SSE of the job's events; resumes after Last-Event-ID. A cmpl-/chatcmpl- id streams
    OpenAI chunks (a chat job that was offered tools shows its calls), a bare job id the
    job's own `tokens`/`finish` events."""
    state = gateway(request)
    record, bare = await _record_of(state, job_id, tenant)
    start = last_event_id(request, after)
    _, kind = split_id(job_id)
    renderer: Renderer
    # a job that asked for logprobs shows them, named by its model's tokenizer
    how = protocol.rendering(
        record.spec, state.tokenizers.get(record.spec.model), echo=False, token_ids=False
    )
    if kind is None:
        renderer = JobRenderer(how.token_text)
    else:
        openai = OpenAIRenderer(
            ChunkHead(kind, bare, record.spec.model, int(record.spec.created_at)),
            include_usage=include_usage,
            resumed=start != "0",
            how=how,
            # a chat job shows its reasoning and calls, the calls named as the live call
            # named them
            tools=job_reader(record.spec, bare) if kind == "chat" else None,
        )
        if start != "0" and openai.carries_state:
            await _replay(state, bare, openai, start)
        renderer = openai
    call = LiveCall(state, bare, record.spec.model, after=start)
    return await call.stream(renderer, {"X-Job-Id": bare})


async def _replay(state: GatewayState, job_id: str, renderer: OpenAIRenderer, upto: str) -> None:
    """Render, and drop, the job's token events up to the resume point `upto`: the reader
    then stands where it stood when it sent that event (the tool parser's held-back text and
    call indices, completions' `text_offset`), so the stream goes on as the unbroken one."""
    end = event_order(upto)
    after = "0"
    while True:
        events = await state.backend.queue.read_events(job_id, after=after)
        for event_id, event in events:
            if event_order(event_id) > end or isinstance(event, Finished):
                return
            renderer.tokens(event_id, event)
        if not events:
            return
        after = events[-1][0]


@router.delete(
    "/v1/jobs/{job_id}",
    responses={**answers(404, 409), 202: {"description": "Running: cancelling"}},
)
async def cancel_job(request: Request, job_id: str, tenant: TenantDep) -> JSONResponse:
    state = gateway(request)
    _, bare = await _record_of(state, job_id, tenant)
    return await cancel_reply(state, bare, job_id)


async def cancel_reply(state: GatewayState, bare: str, job_id: str) -> JSONResponse:
    """Cancel a job (the caller checked it may) and answer as DELETE /v1/jobs/{id} does."""
    outcome = await state.backend.queue.cancel(bare)
    if outcome is CancelOutcome.NOT_FOUND:
        raise _no_job(job_id)
    if outcome is CancelOutcome.ALREADY_FINISHED:
        raise ApiError(409, "The job already finished", code="job_finished")
    status = "cancelled" if outcome is CancelOutcome.CANCELLED else "cancelling"
    return JSONResponse(
        protocol.cancel_body(bare, status), status_code=200 if status == "cancelled" else 202
    )
