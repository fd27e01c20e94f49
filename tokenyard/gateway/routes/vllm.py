"""vLLM's routes beside the OpenAI API: /tokenize and /detokenize (the gateway's own tokenizer,
no job), /version, and /v1/score and /v1/rerank (a cross-encoder's job, as embeddings run)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

import anyio
from fastapi import APIRouter, Request
from starlette.responses import Response

import tokenyard
from tokenyard import tracing
from tokenyard.errors import InvalidRequest
from tokenyard.gateway import protocol, vllm_api
from tokenyard.gateway.admission import (
    chat_prompt,
    refuse_untrusted_template,
    resolve_model,
    tokenizer_for,
)
from tokenyard.gateway.auth import TenantDep
from tokenyard.gateway.jsonbody import check_json
from tokenyard.gateway.openapi import answers, json_body
from tokenyard.gateway.responses import FastJSONResponse
from tokenyard.gateway.routes.openai import answered
from tokenyard.gateway.state import gateway
from tokenyard.gateway.submit import Live, submit
from tokenyard.gateway.vllm_api import (
    DetokenizeRequest,
    PieceTokenizer,
    RerankRequest,
    ScoreRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from tokenyard.messages import JobResult, JobSpec

router = APIRouter()

# a prompt longer than this is tokenized in a thread (as admission does)
_INLINE_CHARS = 4096


@router.post("/tokenize", responses=answers(404), openapi_extra=json_body("TokenizeRequest"))
async def tokenize(request: Request, tenant: TenantDep) -> Response:
    """vLLM's /tokenize: a prompt (or messages through the chat template) as the token ids its
    job would get, counted against the model's context; no job is made."""
    raw = await request.body()
    fields = None
    if raw.strip():
        check_json(raw)
        with contextlib.suppress(ValueError):  # the parse below answers it
            fields = json.loads(raw)
    # vLLM's union of two bodies: one with messages is the chat one
    with_messages = isinstance(fields, dict) and "messages" in fields
    kind = TokenizeChatRequest if with_messages else TokenizeCompletionRequest
    body = protocol.parse(kind, raw, checked=True)
    body.refuse_unsupported()
    state = gateway(request)
    model, _ = await resolve_model(state, body.model)  # an adapter: its base's tokenizer
    tokenizer = tokenizer_for(state, model)
    if isinstance(body, TokenizeChatRequest):
        # rendered as the chat completion of the same messages is: the same trust rule for a
        # request's own template, the same variables (those the server sets are 400)
        refuse_untrusted_template(state.settings, body.chat_template)
        chat = body.as_chat(model)
        messages, tools = chat.template_messages(), chat.tool_spec()
        text = chat_prompt(tokenizer, messages, tools, chat, chat.template_kwargs())
        special, default = body.add_special_tokens, False
    else:
        text, special, default = body.prompt, body.add_special_tokens, True

    def encode() -> list[int]:
        if special != default and isinstance(tokenizer, PieceTokenizer):
            return tokenizer.encode_special(text, special)
        return tokenizer.encode(text)  # what the job of this prompt would carry

    ids = encode() if len(text) <= _INLINE_CHARS else await anyio.to_thread.run_sync(encode)
    pieces = None
    if body.return_token_strs:
        if isinstance(tokenizer, PieceTokenizer):
            pieces = tokenizer.pieces(ids)
        else:
            pieces = [tokenizer.token_text(i) for i in ids]
    limits = await state.limits.of(model, tokenizer)
    return FastJSONResponse(vllm_api.tokenize_body(ids, limits.context, pieces))


@router.post("/detokenize", responses=answers(404), openapi_extra=json_body("DetokenizeRequest"))
async def detokenize(request: Request, tenant: TenantDep) -> Response:
    """vLLM's /detokenize: token ids as text, special tokens included (as vLLM decodes a
    prompt's ids: what /tokenize gave back, BOS and template tokens shown)."""
    body = protocol.parse(DetokenizeRequest, await request.body())
    body.refuse_unsupported()
    state = gateway(request)
    model, _ = await resolve_model(state, body.model)  # an adapter: its base's tokenizer
    tokenizer = tokenizer_for(state, model)
    vocab = tokenizer.vocab_size
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise InvalidRequest(
            f"token id {bad} is out of range: the vocabulary has {vocab} tokens",
            param="tokens",
            code="invalid_value",
        )
    text = tokenizer.decode(body.tokens, skip_special_tokens=False)
    return FastJSONResponse(vllm_api.detokenize_body(text))


@router.get("/version")
async def version() -> Response:
    """vLLM's /version: the server's version (tokenyard's)."""
    return FastJSONResponse({"version": tokenyard.__version__})


_SCORING = answers(404, 429, 500, 503, 504)


@router.post("/v1/score", responses=_SCORING, openapi_extra=json_body("ScoreRequest"))
@router.post("/score", include_in_schema=False)
async def score(request: Request, tenant: TenantDep) -> Response:
    """vLLM's score API: a cross-encoder's score of each text pair, as one job through the
    queue (an embeddings job's path: quota, lanes, cache, audit)."""
    body = protocol.parse(ScoreRequest, await request.body())
    return await _scoring(
        request, tenant, body, lambda spec, result: vllm_api.score_body(spec.id, spec.model, result)
    )


@router.post("/v1/rerank", responses=_SCORING, openapi_extra=json_body("RerankRequest"))
@router.post("/rerank", include_in_schema=False)
@router.post("/v2/rerank", include_in_schema=False)
async def rerank(request: Request, tenant: TenantDep) -> Response:
    """vLLM's rerank API (Jina's and Cohere's): the documents by a cross-encoder's relevance to
    the query, as one scoring job."""
    body = protocol.parse(RerankRequest, await request.body())
    return await _scoring(
        request,
        tenant,
        body,
        lambda spec, result: vllm_api.rerank_body(spec.id, spec.model, body, result),
    )


async def _scoring(
    request: Request,
    tenant: TenantDep,
    body: ScoreRequest | RerankRequest,
    render: Callable[[JobSpec, JobResult], dict[str, Any]],
) -> Response:
    """A scoring job followed live, or its cached answer (scores depend only on the pairs)."""
    started = time.monotonic()
    with tracing.server_span(f"POST {request.url.path}", request.headers):
        state = gateway(request)
        outcome = await submit(state, "score", body, tenant, Live(request.headers, started))
        return await answered(request, outcome, render)
