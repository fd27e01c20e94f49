"""The response cache and in-flight collapsing at the HTTP edge: which requests take part, and
a cached answer rendered exactly as a fresh run's (JSON, or SSE replayed from the result)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping

from starlette.responses import Response

from tokenyard.gateway import protocol
from tokenyard.gateway.adapters import answered_model
from tokenyard.gateway.cache import cache_key, cache_scope, deterministic
from tokenyard.gateway.responses import FastJSONResponse
from tokenyard.gateway.state import GatewayState
from tokenyard.gateway.streaming import ChunkHead, EventStreamResponse, OpenAIRenderer, Renderer
from tokenyard.gateway.tools import Reader, parse_whole
from tokenyard.gateway.vllm_api import RerankRequest, ScoreRequest
from tokenyard.messages import JobResult, JobSpec, TokenChunk

CACHE_HEADER = "X-Cache"  # hit | miss | collapsed | bypass
_OPT_OUT = ("no-cache", "no-store")


def cache_digest(
    state: GatewayState,
    spec: JobSpec,
    body: protocol.CompletionRequest
    | protocol.ChatCompletionRequest
    | protocol.EmbeddingRequest
    | ScoreRequest
    | RerankRequest,
    headers: Mapping[str, str],
) -> str | None:
    """The request's cache key, or None when it takes no part: not deterministic, opted out
    (in the body, or by the request `headers`' Cache-Control), both features off, or the
    model's revision is not known (no worker, or a rollout)."""
    settings = state.settings
    if not (settings.cache or settings.collapse) or body.cache is False:
        return None
    control = headers.get("cache-control", "").lower()
    if any(word in control for word in _OPT_OUT):
        return None
    if not deterministic(spec.sampling) or spec.prompt_token_ids is None:
        return None
    revision = state.limits.revision(spec.model)
    if revision is None:
        return None
    scope = cache_scope(spec.tenant, settings.cache_shared)
    return cache_key(
        # an adapter's answers are its own: never the base's, nor another adapter's, nor
        # those of an adapter once served under its name from elsewhere
        f"{spec.model}\0{spec.adapter}\0{spec.adapter_path}" if spec.adapter else spec.model,
        revision,
        scope,
        spec.prompt_token_ids,
        spec.sampling,
        spec.input_lengths,
        spec.pooling,
    )


def cached_response(
    kind: protocol.Kind,
    body: protocol.CompletionRequest | protocol.ChatCompletionRequest,
    spec: JobSpec,
    result: JobResult,
    how: protocol.Rendering = protocol.PLAIN,
    tools: Reader | None = None,
) -> Response:
    """A cached answer of one choice, shaped as a fresh run's; its id is new, no job stands
    behind it. `tools` reads a chat answer for tool calls."""
    created = int(spec.created_at)
    headers = {CACHE_HEADER: "hit"}
    if not body.stream:
        parsed = [None if tools is None else parse_whole(tools, result.text)]
        content = protocol.completion_body(
            kind, spec.id, spec.model, created, [result], how, parsed=parsed
        )
        return FastJSONResponse(content, headers=headers)
    renderer = OpenAIRenderer(
        ChunkHead(kind, spec.id, answered_model(spec), created),
        include_usage=body.include_usage,
        resumed=False,
        how=how,
        tools=tools,
    )
    return replayed(renderer, result)


def replayed(renderer: Renderer, result: JobResult) -> EventStreamResponse:
    """A cached result streamed in `renderer`'s wire format."""
    return EventStreamResponse(replay(renderer, result), {CACHE_HEADER: "hit"})


async def replay(renderer: Renderer, result: JobResult) -> AsyncGenerator[bytes, None]:
    """A cached result as the frames of a stream: the whole answer in one chunk, with the same
    text, ids, logprobs and end as the run that made it."""
    for f in renderer.start():
        yield f
    chunk = TokenChunk(token_ids=result.token_ids, text=result.text, logprobs=result.logprobs)
    for f in renderer.tokens("0-1", chunk):
        yield f
    for f in renderer.finish("0-2", result):
        yield f
