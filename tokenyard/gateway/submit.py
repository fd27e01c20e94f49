"""The one admission path, request → job: admit → cache → shed → reserve → enqueue → refund.

The completions routes (a caller who follows its job now), /v1/jobs and the batch runner (a
job read later) all submit through `submit`, and each maps its typed outcome to its own answer
(JSON, SSE, 202, a batch line). Refusals are raised as the errors the HTTP edge answers;
`RETRY_LATER` names those a later try of the same request may pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, Literal, overload

import msgspec

from tokenyard import tracing
from tokenyard.errors import QueueFull
from tokenyard.gateway import quota, shedding
from tokenyard.gateway.admission import admit, admit_embeddings, admit_scores
from tokenyard.gateway.auth import Tenant
from tokenyard.gateway.cache import collapse_key
from tokenyard.gateway.cached import CACHE_HEADER, cache_digest
from tokenyard.gateway.errors import RateLimited
from tokenyard.gateway.instrument import current_access
from tokenyard.gateway.live import LiveCall
from tokenyard.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    Kind,
)
from tokenyard.gateway.state import GatewayState
from tokenyard.gateway.vllm_api import RerankRequest, ScoreRequest
from tokenyard.messages import JobResult, JobSpec

# A full lane, the tenant's quota, the queue's estimated wait: 429 to an HTTP caller, a tick's
# wait to a batch line (its window is long; the same line is submitted again).
RETRY_LATER = (QueueFull, RateLimited)

Body = CompletionRequest | ChatCompletionRequest | EmbeddingRequest | ScoreRequest | RerankRequest
# what a request asks for: its body's type says the same
Task = Kind | Literal["embedding", "score"]


class Live(msgspec.Struct, frozen=True):
    """A caller who follows its job now (sync JSON or SSE): the request timeout is its deadline,
    it takes part in the response cache and collapsing, and its leaving cancels the job."""

    headers: Mapping[str, str]  # the request's: trace context, Cache-Control
    started: float  # monotonic; the call's latency metrics count from here


class Later(msgspec.Struct, frozen=True):
    """A job read later (/v1/jobs, a batch line): answered at once, and one job per
    idempotency key, so a retried submit finds the job the first one made."""

    idempotency_key: str | None
    headers: Mapping[str, str] | None = None  # the request's trace context; None: untraced
    # keep its tokens as events for a reader who follows later; a batch line's reader (the
    # runner) reads only its result
    tokens: bool = True


class Hit(msgspec.Struct, frozen=True):
    """A live call answered from the response cache: no job stands behind it, no quota used."""

    spec: JobSpec
    result: JobResult


class Following(msgspec.Struct, frozen=True):
    """A live call following its job: its own, or an identical one in flight it joined."""

    spec: JobSpec
    call: LiveCall
    headers: dict[str, str]  # x-ratelimit-* and, when it took part in the cache, X-Cache


class Queued(msgspec.Struct, frozen=True):
    """A job read later: entered now (`created`), or the one its idempotency key named."""

    spec: JobSpec
    job_id: str
    created: bool
    headers: dict[str, str]  # x-ratelimit-*


@overload
async def submit(
    state: GatewayState,
    kind: Task,
    body: Body,
    tenant: Tenant,
    how: Live,
    choice: int = 0,
    prompt_index: int = 0,
) -> Hit | Following: ...


@overload
async def submit(
    state: GatewayState,
    kind: Task,
    body: Body,
    tenant: Tenant,
    how: Later,
    choice: int = 0,
    prompt_index: int = 0,
) -> Queued: ...


async def submit(
    state: GatewayState,
    kind: Task,
    body: Body,
    tenant: Tenant,
    how: Live | Later,
    choice: int = 0,
    prompt_index: int = 0,
) -> Hit | Following | Queued:
    """Make `body` a job and enter it, or answer it from the cache; a reservation whose job
    was not entered is refunded on every path. `choice`: which of a live call's `n` choices
    (each its own job, cache entry and reservation); `prompt_index`: which of its prompts (a
    batched completions call). Counted per tenant for the dashboard."""
    state.usage.asked(tenant.name, tenant.quota)
    try:
        return await _submit(state, kind, body, tenant, how, choice, prompt_index)
    except RETRY_LATER:
        state.usage.refused(tenant.name)
        raise


async def _submit(
    state: GatewayState,
    kind: Task,
    body: Body,
    tenant: Tenant,
    how: Live | Later,
    choice: int,
    prompt_index: int,
) -> Hit | Following | Queued:
    live = isinstance(how, Live)
    digest: str | None = None
    with _span(how.headers, "tokenyard.admission"):
        key = how.idempotency_key if isinstance(how, Later) else None
        if isinstance(body, EmbeddingRequest):
            spec = await admit_embeddings(state, body, tenant, live=live, idempotency_key=key)
        elif isinstance(body, ScoreRequest | RerankRequest):
            spec = await admit_scores(state, body, tenant, live=live, idempotency_key=key)
        else:
            assert kind != "embedding" and kind != "score"
            spec = await admit(
                state,
                kind,
                body,
                tenant,
                live=live,
                idempotency_key=key,
                choice=choice,
                prompt_index=prompt_index,
            )
        if isinstance(how, Later):
            spec.stream = how.tokens
        else:
            digest = cache_digest(state, spec, body, how.headers)
            if digest is not None and state.settings.cache:
                # before the quota: a cached answer uses no engine
                hit = await state.cache.get(spec.model, digest)
                if hit is not None:
                    return Hit(spec, hit)
        await shedding.check(state, spec, own_deadline=body.deadline is not None, live=live)
        headers = await quota.reserve(state, tenant, spec)
    if digest is not None and state.settings.collapse:
        spec.collapse_key = collapse_key(digest, spec.stream)
    if how.headers is not None:
        tracing.carry(spec, how.headers)
    with _span(how.headers, "tokenyard.enqueue", **{"tokenyard.job_id": spec.id}):
        # from here the enqueuer gives the reservation back on every path where no job of
        # this call's own holds it (see Enqueuer.submit)
        entered = await state.enqueuer.submit(spec, live=live)
    access = current_access()
    if access is not None:
        access.job_id = entered.job_id
    if isinstance(how, Later):
        return Queued(spec, entered.job_id, entered.created, headers)
    call = LiveCall.following(state, spec, entered, how.started)
    if access is not None:
        access.timer = call.timer
    cache = state.cache if digest is not None and state.settings.cache else None

    def saw(result: JobResult) -> None:
        state.usage.used(tenant.name, result.prompt_tokens + result.completion_tokens)
        if cache is not None and digest is not None:
            cache.put(spec.model, digest, result)

    call.on_result = saw
    if digest is not None:
        headers[CACHE_HEADER] = "collapsed" if entered.collapsed else "miss"
    return Following(spec, call, headers)


def _span(
    headers: Mapping[str, str] | None, name: str, **attributes: Any
) -> AbstractContextManager[object]:
    """A span of an HTTP request's admission; a batch line has no request to trace."""
    if headers is None:
        return contextlib.nullcontext()
    return tracing.span(name, **attributes)
