"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions and /v1/models."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from tokenyard import tracing
from tokenyard.gateway import protocol
from tokenyard.gateway.adapters import answered_model
from tokenyard.gateway.admission import tokenizer_for
from tokenyard.gateway.auth import Tenant, TenantDep
from tokenyard.gateway.cached import CACHE_HEADER, cached_response, replay
from tokenyard.gateway.openapi import SSE, answers, json_body
from tokenyard.gateway.responses import FastJSONResponse
from tokenyard.gateway.state import GatewayState, gateway
from tokenyard.gateway.streaming import (
    Choices,
    ChunkHead,
    EventStreamResponse,
    OpenAIRenderer,
    merged,
    primed,
)
from tokenyard.gateway.submit import Following, Hit, Live, submit
from tokenyard.gateway.tools import Reader, job_reader, parse_whole
from tokenyard.messages import JobResult, JobSpec

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
    served = state.served
    roots: dict[str, str] = {}
    contexts: dict[str, int] = {}
    for name in served.names:
        model = served.aliases.get(name, name)
        roots[name] = served.sources.get(model, model)
        tokenizer = state.tokenizers.get(model)
        if tokenizer is not None:
            contexts[name] = (await state.limits.of(model, tokenizer)).context
    # LoRA adapters as vLLM lists them: `root` where the adapter loads from, `parent` its base
    adapters = await state.adapters.all()
    parents: dict[str, str] = {}
    for name, adapter in adapters.items():
        roots[name], parents[name] = adapter.path, adapter.base
        if adapter.base in contexts:
            contexts[name] = contexts[adapter.base]
    names = (*served.names, *(n for n in adapters if n not in served.names))
    body = protocol.models_body(names, int(state.started_at), roots, contexts, parents)
    return JSONResponse(body)


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
    flight) followed live, as SSE or as the result's JSON. `n` choices are n jobs, each
    admitted, cached and collapsed on its own, answered together."""
    state = gateway(request)
    outcomes = await _submit_choices(state, kind, body, tenant, Live(request.headers, started))
    first = outcomes[0]
    spec = first.spec
    how = _rendering(state, kind, body, spec)
    # a batched call's choices echo each its own prompt
    hows = [how] * len(outcomes)
    if len(outcomes) > body.n:
        hows = [_rendering(state, kind, body, o.spec) for o in outcomes]

    def tools(outcome: Hit | Following) -> Reader | None:
        # each choice's answer is read on its own, its calls named from its job's id (the
        # ids GET /v1/jobs/{id}/events shows for that job)
        return job_reader(outcome.spec, _job_id(outcome))

    if len(outcomes) == 1 and isinstance(first, Hit):
        return cached_response(kind, body, spec, first.result, how, tools(first))
    created = int(spec.created_at)
    job_id = _job_id(first)  # a collapsed call's is the job it joined
    headers = _headers(outcomes)
    if body.stream:
        timeout_s = state.settings.request_timeout_s
        head = ChunkHead(kind, job_id, answered_model(spec), created)
        if len(outcomes) == 1 and isinstance(first, Following):
            renderer = OpenAIRenderer(
                head,
                include_usage=body.include_usage,
                resumed=False,
                how=how,
                tools=tools(first),
            )
            return await first.call.stream(renderer, headers, timeout_s=timeout_s)
        choices = Choices(
            head,
            len(outcomes),
            include_usage=body.include_usage,
            per_prompt=body.n,
        )
        children = []
        for index, outcome in enumerate(outcomes):
            renderer = OpenAIRenderer(
                head,
                include_usage=False,
                resumed=False,
                how=hows[index],
                index=index,
                choices=choices,
                tools=tools(outcome),
            )
            if isinstance(outcome, Hit):
                children.append(replay(renderer, outcome.result))
            else:
                children.append(await outcome.call.frames(renderer, timeout_s))
        return EventStreamResponse(await primed(merged(children, choices)), headers)
    results = await _results(outcomes, request)
    failed = next(filter(None, map(protocol.result_error, results)), None)
    if failed is not None:
        return FastJSONResponse(failed[1], status_code=failed[0], headers=headers)
    return FastJSONResponse(
        protocol.completion_body(
            kind,
            job_id,
            answered_model(spec),
            created,
            results,
            hows,
            parsed=[
                None if (t := tools(o)) is None else parse_whole(t, r.text)
                for o, r in zip(outcomes, results, strict=True)
            ],
            per_prompt=body.n,
        ),
        headers=headers,
    )


async def _submit_choices(
    state: GatewayState,
    kind: protocol.Kind,
    body: protocol.CompletionRequest | protocol.ChatCompletionRequest,
    tenant: Tenant,
    how: Live,
) -> list[Hit | Following]:
    """A job (or a cached answer) per choice, of each prompt in turn (a batched completions
    call's choices are prompt-major, as vLLM indexes them); if one is refused, the jobs
    already entered for the others are left (so cancelled) and the refusal is the call's
    answer."""
    prompts = len(body.prompts()) if isinstance(body, protocol.CompletionRequest) else 1
    outcomes: list[Hit | Following] = []
    try:
        for index in range(prompts):
            for choice in range(body.n):
                outcome = await submit(
                    state, kind, body, tenant, how, choice=choice, prompt_index=index
                )
                outcomes.append(outcome)
    except BaseException:
        await _leave(state, outcomes)
        raise
    return outcomes


async def _leave(state: GatewayState, outcomes: Sequence[Hit | Following]) -> None:
    # choices that collapsed onto one job are one job to leave
    for job_id in dict.fromkeys(o.call.job_id for o in outcomes if isinstance(o, Following)):
        await state.abandonment.cancel_now(job_id)


def _rendering(
    state: GatewayState,
    kind: protocol.Kind,
    body: protocol.CompletionRequest | protocol.ChatCompletionRequest,
    spec: JobSpec,
) -> protocol.Rendering:
    echo = isinstance(body, protocol.CompletionRequest) and body.echo
    tokenizer = tokenizer_for(state, spec.model)
    return protocol.rendering(
        spec,
        tokenizer,
        echo=echo,
        token_ids=body.return_token_ids,
        tokens_as_ids=bool(body.return_tokens_as_token_ids),
    )


def _job_id(outcome: Hit | Following) -> str:
    return outcome.spec.id if isinstance(outcome, Hit) else outcome.call.job_id


def _headers(outcomes: Sequence[Hit | Following]) -> dict[str, str]:
    """The call's headers: every choice's job id, and the cache's word on the first choice
    that ran (hit only when every choice was cached)."""
    following = [o for o in outcomes if isinstance(o, Following)]
    job_ids = dict.fromkeys(o.call.job_id for o in following)
    if not following:
        return {"X-Job-Id": ",".join(o.spec.id for o in outcomes), CACHE_HEADER: "hit"}
    return {**following[0].headers, "X-Job-Id": ",".join(job_ids)}


async def _results(outcomes: Sequence[Hit | Following], request: Request) -> list[JobResult]:
    """Every choice's result. One choice waits in the caller's own task (the hot path);
    several wait together, and the first that fails (or the client leaving) ends the wait,
    leaving the others' jobs."""
    if len(outcomes) == 1:
        only = outcomes[0]
        if isinstance(only, Hit):
            return [only.result]
        return [await only.call.result(lambda: until_disconnect(request))]
    gone = anyio.Event()

    async def watch() -> None:
        await until_disconnect(request)
        gone.set()

    watcher = asyncio.create_task(watch())
    waits = {
        i: asyncio.ensure_future(o.call.result(gone.wait))
        for i, o in enumerate(outcomes)
        if isinstance(o, Following)
    }
    results: dict[int, JobResult] = {
        i: o.result for i, o in enumerate(outcomes) if isinstance(o, Hit)
    }
    try:
        pending = set(waits.values())
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                result = task.result()  # a 499 or 504 of one choice is the call's
                if protocol.result_error(result) is not None:
                    return [result]
        results.update((i, task.result()) for i, task in waits.items())
        return [results[i] for i in range(len(outcomes))]
    finally:
        watcher.cancel()
        for task in waits.values():
            task.cancel()  # an unfinished wait, cancelled once, leaves its job
        # a cancelled gather would cancel them again, cutting that short
        with anyio.CancelScope(shield=True):
            await asyncio.gather(watcher, *waits.values(), return_exceptions=True)


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
        return await answered(
            request,
            outcome,
            lambda spec, result: protocol.embedding_body(spec.model, result, body.encoding_format),
        )


async def answered(
    request: Request,
    outcome: Hit | Following,
    render: Callable[[JobSpec, JobResult], dict[str, Any]],
) -> Response:
    """A job's JSON answer (`render`ed): its cached result, or its result once it ends (an
    OpenAI-shaped error where it failed)."""
    if isinstance(outcome, Hit):
        content = render(outcome.spec, outcome.result)
        return FastJSONResponse(content, headers={CACHE_HEADER: "hit"})
    call = outcome.call
    headers = {"X-Job-Id": call.job_id, **outcome.headers}
    result = await call.result(lambda: until_disconnect(request))
    failed = protocol.result_error(result)
    if failed is not None:
        return FastJSONResponse(failed[1], status_code=failed[0], headers=headers)
    return FastJSONResponse(render(outcome.spec, result), headers=headers)
