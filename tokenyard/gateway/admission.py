"""Admit a request (request → job): check the model and parameters, tokenize the prompt once,
check it against the model's published limits, build the job."""

from __future__ import annotations

import hashlib
import time
from typing import Any, Protocol, TypedDict

import anyio

from tokenyard import limits
from tokenyard.broker import new_job_id
from tokenyard.engines.base import EngineTokenizer
from tokenyard.errors import InvalidRequest, NotFound
from tokenyard.gateway import structured
from tokenyard.gateway.auth import Tenant
from tokenyard.gateway.errors import RateLimited
from tokenyard.gateway.limits import resolve_max_tokens
from tokenyard.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    Kind,
)
from tokenyard.gateway.routing import Rule, resolve_alias, route, wants_fast_path
from tokenyard.gateway.settings import GatewaySettings
from tokenyard.gateway.state import GatewayState
from tokenyard.gateway.tools import Tools, call_reading, reasoning_reading
from tokenyard.gateway.vllm_api import RerankRequest, ScoreRequest, TruncatingTokenizer
from tokenyard.messages import (
    AdapterRecord,
    CallReading,
    Guide,
    JobSpec,
    ModelLimits,
    PoolingOptions,
    Priority,
    ReasoningReading,
    SamplingParams,
)

# Tokenizing a long prompt would stall the event loop; past this size it runs in a thread.
_INLINE_CHARS = 4096
# OpenAI's default for /v1/completions; chat falls back to the configured default.
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def tokenizer_for(state: GatewayState, model: str) -> EngineTokenizer:
    """The model's tokenizer; an unknown model is 404 model_not_found, as OpenAI answers."""
    tokenizer = state.tokenizers.get(model) if model in state.served.models else None
    if tokenizer is None:
        raise NotFound(f"The model '{model}' does not exist", param="model", code="model_not_found")
    return tokenizer


async def _tokenize(
    tokenizer: EngineTokenizer, text: str, add_special_tokens: bool | None = None
) -> list[int]:
    def encode() -> list[int]:
        if add_special_tokens is None:
            return tokenizer.encode(text)
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    if len(text) <= _INLINE_CHARS:
        return encode()
    return await anyio.to_thread.run_sync(encode)


async def admit(
    state: GatewayState,
    kind: Kind,
    body: CompletionRequest | ChatCompletionRequest,
    tenant: Tenant,
    *,
    live: bool,
    idempotency_key: str | None = None,
    choice: int = 0,
    prompt_index: int = 0,
) -> JobSpec:
    """A JobSpec for a validated request, carrying its prompt's token ids (the worker does not
    tokenize again); `live` calls get the request timeout as deadline. `choice`: which of the
    request's `n` choices this job makes (a seeded request's choice i samples with seed + i,
    as vLLM seeds its child requests); `prompt_index`: which of a completions request's
    prompts it runs."""
    body.refuse_unsupported()
    if not live:
        why = "for a job read later (one job per id)"
        body.refuse_choices(why)
        if isinstance(body, CompletionRequest):
            body.refuse_prompts(why)
    elif body.n > state.settings.max_n:
        raise InvalidRequest(
            f"n is {body.n}, above this server's limit of {state.settings.max_n}",
            param="n",
            code="invalid_value",
        )
    asked = structured.guide_of(body)
    model, adapter = await resolve_model(state, body.model)
    tokenizer = tokenizer_for(state, model)
    settings = state.settings
    prompt: str | None
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: Tools | None = None
    reading: CallReading | None = None
    variables: dict[str, Any] = {}
    reasoning: ReasoningReading | None = None
    if isinstance(body, ChatCompletionRequest):
        refuse_untrusted_template(settings, body.chat_template)
        messages = body.template_messages()
        tools = body.tool_spec()
        variables = body.template_kwargs()
        # refused now if the answer cannot be read for calls (a template of unknown format)
        reading = call_reading(tools, settings.tool_call_parser, _template(tokenizer, body))
        prompt = chat_prompt(tokenizer, messages, tools, body, variables)
        reasoning = reasoning_reading(
            settings.reasoning_parser, prompt, variables, body.include_reasoning
        )
        requested, default = body.requested_max_tokens, settings.default_max_tokens
        cap = settings.max_tokens_cap
        if body.max_completion_tokens is not None and body.max_completion_tokens > cap:
            # held to the cap even beside a max_tokens, which wins
            raise InvalidRequest(
                f"max_completion_tokens is {body.max_completion_tokens}, above this server's "
                f"limit of {cap}",
                param="max_completion_tokens",
                code="max_tokens_exceeded",
            )
        param = "messages"
    else:
        prompts = body.prompts()
        if len(prompts) > settings.max_prompts:
            raise InvalidRequest(
                f"'prompt' has {len(prompts)} prompts, above this server's limit of "
                f"{settings.max_prompts}",
                param="prompt",
                code="invalid_value",
            )
        single = prompts[prompt_index]
        if isinstance(single, str):
            prompt = single
        else:
            prompt, token_ids = None, single
        requested, default = body.max_tokens, _COMPLETIONS_DEFAULT_MAX_TOKENS
        param = "prompt"
    supplied: list[int] = []  # ids the client sent: the one rule checks them against the vocab
    if token_ids is not None:
        supplied = token_ids
    else:
        assert prompt is not None
        token_ids = await _tokenize(tokenizer, prompt, body.add_special_tokens)
    if (kept := body.truncated(token_ids, tokenizer.max_model_len)) is not token_ids:
        # the job's prompt is its kept ids: echo shows their text, not the request's
        prompt, token_ids = None, kept
        supplied = kept if supplied else []
    prompt_tokens = len(token_ids)
    if prompt_tokens == 0:
        raise InvalidRequest("The prompt is empty", param=param)
    rule = Rule.ALIAS if model != body.model else Rule.REQUESTED
    if adapter is not None:
        rule = Rule.ADAPTER  # and no fast path: the adapter belongs to its base
    elif prompt is not None and wants_fast_path(state.routing, model, prompt_tokens):
        # token ids a client sent belong to the model it named: only text takes the fast path
        fast = state.routing.fast_path
        assert fast is not None
        depth = await state.depths.of(fast.model) if fast.max_depth else None
        model, rule = route(state.routing, body.model, prompt_tokens, depth)
        if model == fast.model:
            small = tokenizer_for(state, model)
            if small is not tokenizer:  # its own template and vocabulary
                if isinstance(body, ChatCompletionRequest):
                    assert messages is not None and tools is not None
                    template = _template(small, body)
                    reading = call_reading(tools, settings.tool_call_parser, template)
                    prompt = chat_prompt(small, messages, tools, body, variables)
                    reasoning = reasoning_reading(
                        settings.reasoning_parser, prompt, variables, body.include_reasoning
                    )
                token_ids = await _tokenize(small, prompt, body.add_special_tokens)
                tokenizer, token_ids = small, body.truncated(token_ids, small.max_model_len)
                prompt_tokens = len(token_ids)
    state.metrics.routed.labels(body.model, model, rule.value).inc()
    guide = _one_guide(asked, tools)
    model_limits = await state.limits.of(model, tokenizer)
    max_tokens = resolve_max_tokens(
        requested, default, settings.max_tokens_cap, prompt_tokens, model_limits.context, param
    )
    head = _job_head(settings, model, tenant, body, live=live, idempotency_key=idempotency_key)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),  # -1: vLLM's off
        seed=None if body.seed is None else _child_seed(body.seed, choice),
        stop=body.stop_strings,
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=body.logit_bias_ids,
        min_tokens=body.min_tokens,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        logprobs=body.logprobs_count,
        guide=None if guide is None else guide[0],
        min_p=body.min_p or 0.0,
        allowed_token_ids=tuple(sorted(set(body.allowed_token_ids or ()))),
        bad_words=tuple(body.bad_words or ()),
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        cache_salt=body.cache_salt,
        prompt_logprobs=_prompt_logprobs(body),
    )
    refused = limits.refusal(
        prompt_tokens,
        sampling,
        model_limits,
        param,
        token_ids=supplied,
        adapter="" if adapter is None else adapter.name,
    )
    if refused is not None and guide is not None:
        refused = _as_guided_by(refused, guide[1])
    limits.check(refused)
    if guide is not None:
        # after the limits rule: a model whose engine has no structured outputs refuses the
        # request by name without the gateway compiling anything; the tools' schema (built
        # from their `parameters`) is checked as any other, named by `tools`
        await structured.check(guide[0], "tools" if guide[1] == "tool_choice" else guide[1])
    return JobSpec(
        **head,
        prompt=prompt,
        prompt_token_ids=token_ids,
        sampling=sampling,
        stream=not live or bool(body.stream),  # a sync call reads only the result
        prefix_key=_affinity_key(
            _salted(state.prefixes.key(model, tokenizer, token_ids, messages), sampling), adapter
        ),
        calls=reading,
        reasoning=reasoning,
        adapter="" if adapter is None else adapter.name,
        adapter_path="" if adapter is None else adapter.path,
    )


def refuse_untrusted_template(settings: GatewaySettings, chat_template: str | None) -> None:
    """A request's own chat template is rendered in the gateway, so only where the operator
    trusts clients with its time (vLLM's --trust-request-chat-template); else 400."""
    if chat_template is not None and not settings.trust_request_chat_template:
        raise InvalidRequest(
            "Chat template is passed with request, but this server does not trust "
            "request chat templates (TOKENYARD_GATEWAY_TRUST_REQUEST_CHAT_TEMPLATE)",
            param="chat_template",
            code="unsupported_parameter",
        )


async def resolve_model(state: GatewayState, asked: str | None) -> tuple[str, AdapterRecord | None]:
    """The served model a request runs on (an alias resolved; none named: see `model_named`),
    and the LoRA adapter it runs with when `asked` names one; a name neither serves is left
    for `tokenizer_for` to 404."""
    model = model_named(state, asked)
    if model in state.served.models:
        return model, None
    adapter = await state.adapters.find(model)
    return (model, None) if adapter is None else (adapter.base, adapter)


async def _base_model(state: GatewayState, asked: str | None, task: str) -> str:
    """The model a pooling request runs on: an adapter's name is refused (400, not an unknown
    model's 404), since adapters are loaded for generation only."""
    model, adapter = await resolve_model(state, asked)
    if adapter is not None:
        raise InvalidRequest(
            f"The model '{adapter.name}' is a LoRA adapter: it runs completions, not {task}",
            param="model",
        )
    return model


def _affinity_key(prefix_key: str, adapter: AdapterRecord | None) -> str:
    """An adapter's jobs are keyed by the adapter, not their prefix: the broker's prefix
    affinity (broker/policy.py) then holds them, for a bounded wait, for the worker that last
    claimed one, which has the adapter loaded (a reload costs more than a prefix's prefill,
    and an adapter's KV blocks are its own anyway)."""
    if adapter is None:
        return prefix_key
    return "lora-" + hashlib.blake2b(adapter.name.encode(), digest_size=12).hexdigest()


def chat_prompt(
    tokenizer: EngineTokenizer,
    messages: list[dict[str, Any]],
    tools: Tools,
    body: ChatCompletionRequest,
    variables: dict[str, Any],
) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools.template(),
            variables=variables,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template=body.chat_template,
        )
    except Exception as exc:  # a template may reject e.g. the order of roles, or a variable
        param = "messages" if body.chat_template is None else "chat_template"
        raise InvalidRequest(f"cannot apply the chat template: {exc}", param=param) from exc


def _prompt_logprobs(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The prompt logprobs asked: vLLM's field, or completions' echo with logprobs (the
    echoed prompt's logprobs come first, as vLLM shows them)."""
    if body.prompt_logprobs is None and isinstance(body, CompletionRequest) and body.echo:
        return body.logprobs
    return body.prompt_logprobs


def _template(tokenizer: EngineTokenizer, body: ChatCompletionRequest) -> str:
    """The chat template the prompt is rendered with: the request's own, else the model's."""
    return tokenizer.chat_template if body.chat_template is None else body.chat_template


def _salted(prefix_key: str, sampling: SamplingParams) -> str:
    """A salted job's prefix key: its cached prefix is not another salt's, nor unsalted."""
    if not prefix_key or sampling.cache_salt is None:
        return prefix_key
    salted = f"{prefix_key}\0{sampling.cache_salt}".encode()
    return hashlib.blake2b(salted, digest_size=12).hexdigest()


def _one_guide(asked: tuple[Guide, str] | None, tools: Tools | None) -> tuple[Guide, str] | None:
    """The request's one decoding constraint and the parameter that asked for it: a structured
    output, or the tools' (`tool_choice` required or named); both at once are 400."""
    by_tools = None if tools is None else tools.guide()
    if by_tools is None:
        return asked
    if asked is not None:
        raise InvalidRequest(
            f"Only one structured output constraint is allowed per request; got "
            f"'{asked[1]}' and 'tool_choice'",
            param=asked[1],
        )
    return by_tools, "tool_choice"


def _as_guided_by(refused: InvalidRequest, param: str) -> InvalidRequest:
    """A refusal of constrained decoding naming the parameter that asked for it (the one rule
    names `response_format`, the usual way to ask; tools, `structured_outputs` and vLLM's
    `guided_*` ask too)."""
    if refused.param != "response_format" or param == "response_format":
        return refused
    if param == "tool_choice":
        message = f"tool_choice 'required' or a named function needs structured outputs: {refused}"
    else:
        message = f"{param} needs structured outputs: {refused}"
    return InvalidRequest(message, param=param, code=refused.code)


async def admit_embeddings(
    state: GatewayState,
    body: EmbeddingRequest,
    tenant: Tenant,
    *,
    live: bool,
    idempotency_key: str | None = None,
) -> JobSpec:
    """An embeddings job for a validated request: its inputs' token ids one after another (the
    worker does not tokenize again; cut as `truncate_prompt_tokens` asks), checked by the one
    rule against the model's limits, with the vector options it asks."""
    body.refuse_unsupported()
    inputs = body.inputs()
    model = await _base_model(state, body.model, "embeddings")
    tokenizer = tokenizer_for(state, model)
    model_limits = await state.limits.of(model, tokenizer)
    keep = _kept_tokens(body.truncate_prompt_tokens, model_limits)
    side = body.truncation_side or "left"
    supplied: list[int] = []  # ids the client sent: checked against the vocabulary
    texts = [x for x in inputs if isinstance(x, str)]
    if not texts:
        ids = [_cut(x, keep, side) for x in inputs if isinstance(x, list)]
        supplied = [i for x in ids for i in x]
    else:

        def encode() -> list[list[int]]:
            return [_encode_cut(tokenizer, text, keep, side) for text in texts]

        small = sum(map(len, texts)) <= _INLINE_CHARS
        ids = encode() if small else await anyio.to_thread.run_sync(encode)
    lengths = [len(x) for x in ids]
    rule = Rule.ALIAS if model != body.model else Rule.REQUESTED
    state.metrics.routed.labels(body.model, model, rule.value).inc()
    pooling = None
    if body.dimensions is not None or body.normalized is not None:
        pooling = PoolingOptions(dimensions=body.dimensions, normalize=body.normalized)
    limits.check(
        limits.embedding_refusal(
            lengths, model_limits, "input", token_ids=supplied, pooling=pooling
        )
    )
    return _pooling_job(
        state, model, tenant, body, ids, pooling, live=live, idempotency_key=idempotency_key
    )


async def admit_scores(
    state: GatewayState,
    body: ScoreRequest | RerankRequest,
    tenant: Tenant,
    *,
    live: bool,
    idempotency_key: str | None = None,
) -> JobSpec:
    """A scoring job (/v1/score, /v1/rerank) for a validated request: each (query, document)
    pair one input, encoded as the cross-encoder reads a pair, as an embeddings job's inputs
    run; a model that does not score is refused by name."""
    body.refuse_unsupported()
    pairs, param = body.pairs()
    model = await _base_model(state, body.model, "scores")
    tokenizer = tokenizer_for(state, model)
    model_limits = await state.limits.of(model, tokenizer)
    if not model_limits.scores:
        raise limits.not_a_cross_encoder(body.model or model)
    if not isinstance(tokenizer, TruncatingTokenizer):
        raise InvalidRequest(
            f"The model '{model}' has no tokenizer that encodes text pairs", param="model"
        )
    keep = _kept_tokens(body.truncate_prompt_tokens, model_limits)

    def encode() -> list[tuple[list[int], int]]:
        return [tokenizer.encode_pair(a, b, keep, body.side) for a, b in pairs]

    small = sum(len(a) + len(b) for a, b in pairs) <= _INLINE_CHARS
    encoded = encode() if small else await anyio.to_thread.run_sync(encode)
    ids = [x for x, _ in encoded]
    lengths = [len(x) for x in ids]
    rule = Rule.ALIAS if model != body.model else Rule.REQUESTED
    state.metrics.routed.labels(body.model or model, model, rule.value).inc()
    pooling = PoolingOptions(
        score=True, activation=body.activated, second=tuple(s for _, s in encoded)
    )
    limits.check(limits.embedding_refusal(lengths, model_limits, param, pooling=pooling))
    return _pooling_job(
        state, model, tenant, body, ids, pooling, live=live, idempotency_key=idempotency_key
    )


def model_named(state: GatewayState, asked: str | None) -> str:
    """The model a request names (an alias resolved); none named (vLLM's routes make `model`
    optional): the one this gateway serves (several: 400, the request must say which)."""
    if asked is None:
        if len(state.served.models) != 1:
            raise InvalidRequest(
                "'model' is required: this server serves several models", param="model"
            )
        return state.served.models[0]
    return resolve_alias(state.routing, asked)


def _kept_tokens(asked: int | None, model_limits: ModelLimits) -> int | None:
    """The tokens `truncate_prompt_tokens` keeps of each input (-1: the model's context), or
    None (no cut); more than the context is refused, as vLLM refuses it."""
    if asked is None:
        return None
    context = model_limits.max_model_len
    if asked > context:
        raise InvalidRequest(
            f"truncate_prompt_tokens={asked} cannot be greater than max_model_len={context}. "
            "Please request a smaller truncation size.",
            param="truncate_prompt_tokens",
        )
    return context if asked < 0 else asked


def _cut(ids: list[int], keep: int | None, side: str) -> list[int]:
    if keep is None or len(ids) <= keep:
        return ids
    return ids[-keep:] if side == "left" else ids[:keep]


def _encode_cut(tokenizer: EngineTokenizer, text: str, keep: int | None, side: str) -> list[int]:
    """A text's ids, cut to `keep` on `side` as the tokenizer truncates (its special tokens
    kept), or, where it cannot, as the ids themselves are cut."""
    ids = tokenizer.encode(text)
    if keep is None or len(ids) <= keep:
        return ids
    if isinstance(tokenizer, TruncatingTokenizer):
        return tokenizer.encode_truncated(text, keep, side)
    return _cut(ids, keep, side)


def _pooling_job(
    state: GatewayState,
    model: str,
    tenant: Tenant,
    body: EmbeddingRequest | ScoreRequest | RerankRequest,
    ids: list[list[int]],
    pooling: PoolingOptions | None,
    *,
    live: bool,
    idempotency_key: str | None,
) -> JobSpec:
    """An embeddings or scoring job of these inputs' ids (one after another)."""
    head = _job_head(
        state.settings, model, tenant, body, live=live, idempotency_key=idempotency_key
    )
    return JobSpec(
        **head,
        prompt_token_ids=[i for x in ids for i in x],
        input_lengths=[len(x) for x in ids],
        # nothing is generated: greedy marks the job deterministic (the response cache's rule)
        sampling=SamplingParams(max_tokens=0, temperature=0.0),
        stream=False,  # no tokens to follow: every reader reads the result
        pooling=pooling,
    )


def _child_seed(seed: int, choice: int) -> int:
    """seed + choice, wrapped into the signed 64-bit range engines take."""
    return (seed + choice + (1 << 63)) % (1 << 64) - (1 << 63)


class _Scheduled(Protocol):
    """What every request body says of its job's place and time."""

    @property
    def priority_class(self) -> Priority | None: ...

    @property
    def deadline(self) -> float | None: ...


class _JobHead(TypedDict):
    id: str
    model: str
    tenant: str
    weight: float
    priority: Priority
    created_at: float
    deadline: float | None
    idempotency_key: str | None


def _job_head(
    settings: GatewaySettings,
    model: str,
    tenant: Tenant,
    body: _Scheduled,
    *,
    live: bool,
    idempotency_key: str | None,
) -> _JobHead:
    """What every job starts with, whatever it runs: a new id, the tenant's place in the
    model's lanes (its share, the priority it may have), when it was made and by when it must
    start (one already passed is refused here: `_deadline`), and the idempotency key it is
    entered under."""
    now = time.time()
    return _JobHead(
        id=new_job_id(model),
        model=model,
        tenant=tenant.name,
        weight=tenant.weight,
        priority=tenant.lane_priority(body.priority_class),
        created_at=now,
        deadline=_deadline(body.deadline, now, live, settings.request_timeout_s),
        idempotency_key=idempotency_key,
    )


def _deadline(asked: float | None, now: float, live: bool, timeout_s: float) -> float | None:
    """The job's deadline: the caller's, else a live call's request timeout. One that has
    passed cannot be met, however short the queue: 429 as shedding answers one the estimated
    wait misses (a value that is no unix time at all is 400, `DEADLINE_MIN`)."""
    if asked is not None and asked <= now:
        raise RateLimited(
            f"'deadline' passed {now - asked:.1f} s ago (unix seconds): the job cannot start by it",
            code="deadline_unmeetable",
            headers={},
        )
    if asked is None and live:
        return now + timeout_s
    return asked
