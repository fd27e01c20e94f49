"""Anthropic's Messages API: POST /v1/messages, one chat job admitted through the one admission
path (quota, cache, collapsing, priorities, audit), answered as a message or its SSE events."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenyard import tracing
from tokenyard.errors import InvalidRequest
from tokenyard.gateway import protocol
from tokenyard.gateway.adapters import answered_model
from tokenyard.gateway.admission import tokenizer_for
from tokenyard.gateway.anthropic import MessageEvents, MessageRequest, Reply, result_error
from tokenyard.gateway.auth import Tenant, TenantDep
from tokenyard.gateway.cached import CACHE_HEADER, replayed
from tokenyard.gateway.openapi import SSE, answers, json_body
from tokenyard.gateway.responses import FastJSONResponse
from tokenyard.gateway.routes.openai import until_disconnect
from tokenyard.gateway.state import gateway
from tokenyard.gateway.submit import Hit, Live, submit
from tokenyard.gateway.tools import job_reader

router = APIRouter()
# errors in Anthropic's shape (gateway/openapi.py documents them so on this path)
_MESSAGE = {
    **answers(404, 429, 500, 503, 504),
    200: {"description": "The message (JSON), or its events (SSE) with `stream`", "content": SSE},
}


@router.post("/v1/messages", responses=_MESSAGE, openapi_extra=json_body("MessageRequest"))
async def messages(request: Request, tenant: TenantDep) -> Response:
    return await create_message(request, tenant)


# The handler proper, called by the route above and by `gateway/fast.py`.
async def create_message(request: Request, tenant: Tenant) -> Response:
    """The message: the cached one, or its job (its own, or an identical one in flight)
    followed live, as SSE events or as the message's JSON."""
    started = time.monotonic()
    with tracing.server_span("POST /v1/messages", request.headers):
        body = protocol.parse(MessageRequest, await request.body())
        chat, places = body.chat_request()
        state = gateway(request)
        try:
            outcome = await submit(state, "chat", chat, tenant, Live(request.headers, started))
        except InvalidRequest as exc:
            raise places.renamed(exc) from None
    spec = outcome.spec
    job_id = spec.id if isinstance(outcome, Hit) else outcome.call.job_id
    reply = Reply(
        job_id,
        answered_model(spec),
        len(spec.prompt_token_ids or ()),
        stops=spec.sampling.stop,
        decode=tokenizer_for(state, spec.model).decode,
        # the chat route's reader of tool calls: the admitted job's, its calls named from the job
        reader=lambda: job_reader(spec, job_id),
    )
    events = MessageEvents(reply) if body.stream else None
    if isinstance(outcome, Hit):
        if events is not None:
            return replayed(events, outcome.result)
        return FastJSONResponse(reply.body(outcome.result), headers={CACHE_HEADER: "hit"})
    call = outcome.call
    headers = {"X-Job-Id": job_id, **outcome.headers}
    if events is not None:
        return await call.stream(events, headers, timeout_s=state.settings.request_timeout_s)
    result = await call.result(lambda: until_disconnect(request))
    failed = result_error(result)
    if failed is not None:
        return FastJSONResponse(failed[1], status_code=failed[0], headers=headers)
    return FastJSONResponse(reply.body(result), headers=headers)
