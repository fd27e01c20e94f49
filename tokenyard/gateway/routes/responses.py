"""OpenAI's Responses API: create (sync, SSE, background), retrieve (polled, or its events
resumed after a sequence number), cancel and delete; each response is one chat job."""

from __future__ import annotations

import contextlib
import time
from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from tokenyard import tracing
from tokenyard.broker.core import CancelOutcome
from tokenyard.errors import InvalidRequest
from tokenyard.gateway import protocol
from tokenyard.gateway.auth import Tenant, TenantDep
from tokenyard.gateway.live import LiveCall
from tokenyard.gateway.openapi import SSE, answers, json_body
from tokenyard.gateway.responses import FastJSONResponse
from tokenyard.gateway.responses_api.service import Chain, ResponseService
from tokenyard.gateway.responses_api.wire import (
    REASONING,
    ResponseEvents,
    ResponseRequest,
    ToolResponseEvents,
    call_turn,
    deleted_body,
    renamed,
    response_body,
    response_id,
    response_reader,
)
from tokenyard.gateway.routes.openai import until_disconnect
from tokenyard.gateway.state import gateway
from tokenyard.gateway.submit import Hit, Later, Live, Queued, submit
from tokenyard.gateway.tools import Reader, parse_whole
from tokenyard.messages import JobResult, JobSpec, JobStatus, StoredResponse, Turn

router = APIRouter()
CANCEL_WAIT_S = 10.0  # a running job ends at its next engine step; the answer waits for it
_FAILED = (JobStatus.FAILED, JobStatus.DEAD, JobStatus.EXPIRED)
# a response: its JSON, or its events (SSE) with `stream`; 409, 500, 503, 504 as a completion's
_CREATED = {
    **answers(404, 409, 429, 500, 503, 504),
    200: {"description": "The response (JSON), or its events (SSE) with `stream`", "content": SSE},
}
_STORED = {
    **answers(404),
    200: {"description": "The response (JSON), or its events (SSE) with `stream`", "content": SSE},
}


def _service(request: Request) -> ResponseService:
    service: ResponseService = request.app.state.responses
    return service


@router.post("/v1/responses", responses=_CREATED, openapi_extra=json_body("ResponseRequest"))
async def create_response(request: Request, tenant: TenantDep) -> Response:
    """A response: answered when done, streamed as events, or (`background`) queued at once."""
    started = time.monotonic()
    state, service = gateway(request), _service(request)
    with tracing.server_span("POST /v1/responses", request.headers):
        body = protocol.parse(ResponseRequest, await request.body())
        body.refuse_unsupported()
        chain = await _earlier(request, service, body, tenant)
        said = body.turns()
        context = [*chain.turns, *said] if chain is not None else said
        how = Later(None, request.headers) if body.background else Live(request.headers, started)
        try:
            outcome = await submit(state, "chat", body.chat_request(context), tenant, how)
        except InvalidRequest as exc:
            raise renamed(exc) from None
    assert not isinstance(outcome, Hit)  # a response never takes part in the cache
    job_id = outcome.job_id if isinstance(outcome, Queued) else outcome.call.job_id
    # the record keeps only what this response adds; its conversation is read back by `chain`
    own = said if chain is None else [*chain.prefix, *said]
    stored = _stored(body, tenant, outcome.spec, job_id, own)
    headers = {"X-Job-Id": job_id, **outcome.headers}
    try:
        await service.create(stored, chain)
    except BaseException:
        # the job is queued before its record: with none, nothing could read it, so it goes
        if isinstance(outcome, Queued):
            with contextlib.suppress(Exception):  # the first error is the caller's answer
                await state.backend.queue.cancel(job_id)  # its caller heard it failed
        else:
            await state.abandonment.cancel_now(job_id)  # no caller will follow it
        raise
    if isinstance(outcome, Queued):  # read later: the stored response now, or its events
        service.watch(stored)
        if not body.stream:
            return FastJSONResponse(response_body(stored, None, JobStatus.QUEUED), headers=headers)
        # no caller owns a background job: its stream's reader may leave and come back
        call = LiveCall(state, job_id, stored.model, fresh=True)
        return await call.stream(_events(request, stored), headers)
    return await _live(request, body, stored, outcome.call, headers)


async def _earlier(
    request: Request, service: ResponseService, body: ResponseRequest, tenant: Tenant
) -> Chain | None:
    """The conversation a `previous_response_id` continues: its own, then its output."""
    if body.previous_response_id is None:
        return None
    earlier = await service.get(body.previous_response_id, tenant, "previous_response_id")
    earlier, _ = await service.current(earlier)
    if earlier.result is None or earlier.result.status is not JobStatus.SUCCEEDED:
        raise InvalidRequest(
            f"The previous response '{earlier.id}' has not completed",
            param="previous_response_id",
        )
    reader = _reader(request, earlier)
    if reader is None:
        return await service.chain(earlier, [Turn("assistant", earlier.result.text)])
    # its reasoning and calls as the client saw them (same ids), so their outputs can answer
    # them; the chat template decides whether the reasoning shows in the next prompt
    parsed = parse_whole(reader, earlier.result.text)
    thought = [Turn(REASONING, parsed.reasoning)] if parsed.reasoning else []
    said = [Turn("assistant", parsed.content or "")] if parsed.content or not parsed.calls else []
    calls = [call_turn(c.id, c.name, c.arguments) for c in parsed.calls]
    return await service.chain(earlier, [*thought, *said, *calls])


def _reader(request: Request, stored: StoredResponse) -> Reader | None:
    """What reads a stored response's output for reasoning and function calls (None: all
    text): its kept readings (`response_reader`); this gateway's setting and the model's
    template matter only to a response stored before the call reading was kept."""
    state = gateway(request)
    tokenizer = state.tokenizers.get(stored.model)
    template = "" if tokenizer is None else tokenizer.chat_template
    return response_reader(stored, state.settings.tool_call_parser, template)


def _events(request: Request, stored: StoredResponse, after: int = -1) -> ResponseEvents:
    reader = _reader(request, stored)
    if reader is None:
        return ResponseEvents(stored, after)
    return ToolResponseEvents(stored, reader, after)


def _stored(
    body: ResponseRequest, tenant: Tenant, spec: JobSpec, job_id: str, context: list[Turn]
) -> StoredResponse:
    return StoredResponse(
        id=response_id(job_id),
        job_id=job_id,
        tenant=tenant.name,
        model=spec.model,
        adapter=spec.adapter,
        created_at=spec.created_at,
        context=context,
        instructions=body.instructions,
        metadata=body.metadata,
        previous_response_id=body.previous_response_id,
        max_output_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        background=body.background,
        store=body.store,
        tools=body.stored_tools(),
        text_format=body.stored_format(),
        calls=spec.calls,  # admission's reading: every later reading of the output uses it
        reasoning=spec.reasoning,
        chained=True,
    )


async def _live(
    request: Request,
    body: ResponseRequest,
    stored: StoredResponse,
    call: LiveCall,
    headers: dict[str, str],
) -> Response:
    """A job its caller follows now, as the chat routes do: SSE, or the response when done."""
    state, service = gateway(request), _service(request)
    if body.stream:
        counted = call.on_result  # the tenant's use (gateway/submit.py)

        def saw(result: JobResult) -> None:
            if counted is not None:
                counted(result)
            service.keep(stored, result)

        call.on_result = saw
        timeout = state.settings.request_timeout_s
        return await call.stream(_events(request, stored), headers, timeout_s=timeout)
    result = await call.result(lambda: until_disconnect(request))
    await service.finish(stored, result)
    if result.status in _FAILED:
        failed = protocol.result_error(result)
        assert failed is not None
        return FastJSONResponse(failed[1], status_code=failed[0], headers=headers)
    return FastJSONResponse(
        response_body(stored, result, reader=_reader(request, stored)), headers=headers
    )


@router.get("/v1/responses/{response_id}", responses=_STORED)
async def retrieve_response(
    request: Request,
    response_id: str,
    tenant: TenantDep,
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=-1)] = None,
) -> Response:
    """The response now; with `stream`, its events after `starting_after`, to its end."""
    state, service = gateway(request), _service(request)
    stored = await service.get(response_id, tenant)
    if not stream:
        stored, job = await service.current(stored)
        reader = _reader(request, stored)
        return FastJSONResponse(response_body(stored, stored.result, job, reader))
    call = LiveCall(state, stored.job_id, stored.model)
    if stored.result is None:
        call.on_result = lambda result: service.keep(stored, result)
    after = -1 if starting_after is None else starting_after
    return await call.stream(_events(request, stored, after), {"X-Job-Id": stored.job_id})


@router.post("/v1/responses/{response_id}/cancel", responses=answers(404))
async def cancel_response(request: Request, response_id: str, tenant: TenantDep) -> Response:
    """Cancel a background response: a queued job ends at once, a running one at its next
    engine step; answers the response as it then stands."""
    state, service = gateway(request), _service(request)
    stored = await service.get(response_id, tenant)
    if not stored.background:
        raise InvalidRequest("Only responses created with background=true can be cancelled")
    stored, _ = await service.current(stored)
    if stored.result is None:
        outcome = await state.backend.queue.cancel(stored.job_id)
        if outcome is CancelOutcome.SIGNALLED:  # a waiting job is terminal already
            stored = await service.wait(stored, CANCEL_WAIT_S)
    stored, job = await service.current(stored)
    return FastJSONResponse(response_body(stored, stored.result, job, _reader(request, stored)))


@router.delete("/v1/responses/{response_id}", responses=answers(404))
async def delete_response(request: Request, response_id: str, tenant: TenantDep) -> Response:
    """Forget a stored response (its job is cancelled if it still runs)."""
    state, service = gateway(request), _service(request)
    stored = await service.get(response_id, tenant)
    if stored.result is None:
        await state.backend.queue.cancel(stored.job_id)
    await service.delete(stored)
    return FastJSONResponse(deleted_body(stored.id))
