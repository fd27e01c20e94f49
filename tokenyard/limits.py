"""The one rule for what a model can take, applied alike by the gateway, the worker and engines.

Workers publish their `ModelLimits` in their heartbeat; the gateway checks each request against
the loosest live worker of its model (a request that fits one worker must be accepted), the
worker's scheduler against its own engine, and engines against themselves. All three answer
with the same `InvalidRequest`, so a client sees one message whichever place refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenyard.errors import InvalidRequest
from tokenyard.messages import Feature, ModelLimits, PoolingOptions, SamplingParams


def context_length_exceeded(
    prompt_tokens: int, max_tokens: int, max_model_len: int, param: str = "prompt"
) -> InvalidRequest:
    """OpenAI's wording and code for a request longer than the model's context."""
    return too_long(
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
        f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
        param,
    )


def too_long(message: str, param: str) -> InvalidRequest:
    """A request of more tokens than the model takes: OpenAI's code for it, whatever the limit."""
    return InvalidRequest(message, param=param, code="context_length_exceeded")


def refusal(
    prompt_tokens: int,
    params: SamplingParams,
    limits: ModelLimits,
    param: str = "prompt",
    *,
    token_ids: Sequence[int] = (),
    adapter: str = "",
) -> InvalidRequest | None:
    """Why a request cannot run on a model with these limits, or None when it can.

    `token_ids`, when given, are the prompt's ids: one the model's embedding does not have
    would fail every sequence batched with it, so it is refused here. `adapter` names the
    LoRA adapter the request runs with: an engine that runs none refuses it here, by name,
    rather than at the worker after the job was queued.
    """
    if not limits.generates:
        serves = (
            "scores only (POST /v1/score, /v1/rerank)"
            if limits.scores
            else ("embeddings only (POST /v1/embeddings)")
        )
        return InvalidRequest(
            f"This model serves {serves}",
            param="model",
            code="model_not_supported",
        )
    if prompt_tokens < 1:
        return InvalidRequest("The prompt is empty", param=param)
    if (bad := _bad_ids(token_ids, limits, param)) is not None:
        return bad
    if params.max_tokens < 1:
        return InvalidRequest("max_tokens must be at least 1", param="max_tokens")
    if params.temperature < 0:
        return InvalidRequest("temperature must not be negative", param="temperature")
    if not 0.0 < params.top_p <= 1.0:
        return InvalidRequest("top_p must be in (0, 1]", param="top_p")
    if params.top_k < 0:
        return InvalidRequest("top_k must not be negative", param="top_k")
    if (bad := _bad_decoding(params, limits)) is not None:
        return bad
    if adapter and not limits.adapters:
        return InvalidRequest(
            f"The model '{adapter}' is a LoRA adapter, and {_engine(limits)} serving its base "
            "runs none",
            param="model",
            code="unsupported_parameter",
        )
    if prompt_tokens + params.max_tokens > limits.context:
        return context_length_exceeded(prompt_tokens, params.max_tokens, limits.context, param)
    return None


MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs, and vLLM's default max_logprobs
MAX_CACHE_SALT = 1024  # vLLM's bound on a cache_salt's length
# the smallest `deadline` (unix seconds, 2001-09-09) a request may give: a smaller number is a
# duration sent as a time (400); a time past it that has passed cannot be met (429)
DEADLINE_MIN = 1_000_000_000


def _bad_decoding(params: SamplingParams, limits: ModelLimits) -> InvalidRequest | None:
    """The optional decoding parameters: in range, and implemented by the model's engine."""
    wanted = params.features
    if not wanted:
        # each field checked below asks for a feature when it is not its default, and every
        # default is in range: a plain request (most of them, checked twice a job) is done
        return None
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= getattr(params, name) <= 2.0:
            return InvalidRequest(f"{name} must be in [-2, 2]", param=name)
    if not 0.0 < params.repetition_penalty <= 2.0:
        return InvalidRequest("repetition_penalty must be in (0, 2]", param="repetition_penalty")
    vocab = limits.vocab_size
    for token_id, bias in params.logit_bias:
        if token_id < 0 or (vocab and token_id >= vocab):
            return InvalidRequest(
                f"logit_bias names token {token_id}, not in [0, {vocab or 'vocab size'})",
                param="logit_bias",
            )
        if not -100.0 <= bias <= 100.0:
            return InvalidRequest("logit_bias values must be in [-100, 100]", param="logit_bias")
    if params.min_tokens < 0 or params.min_tokens > params.max_tokens:
        return InvalidRequest(
            f"min_tokens must be in [0, max_tokens] ({params.max_tokens})", param="min_tokens"
        )
    if any(t < 0 or (vocab and t >= vocab) for t in params.stop_token_ids):
        return InvalidRequest(
            f"stop_token_ids must be in [0, {vocab or 'vocab size'})", param="stop_token_ids"
        )
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_LOGPROBS:
        return InvalidRequest(f"logprobs must be in [0, {MAX_LOGPROBS}]", param="logprobs")
    if params.prompt_logprobs is not None and not 0 <= params.prompt_logprobs <= MAX_LOGPROBS:
        return InvalidRequest(
            f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]", param="prompt_logprobs"
        )
    if not 0.0 <= params.min_p <= 1.0:
        return InvalidRequest("min_p must be in [0, 1]", param="min_p")
    if any(t < 0 or (vocab and t >= vocab) for t in params.allowed_token_ids):
        return InvalidRequest(
            f"allowed_token_ids must be in [0, {vocab or 'vocab size'})",
            param="allowed_token_ids",
        )
    if any(not word.strip() for word in params.bad_words):
        return InvalidRequest("bad_words must not hold an empty word", param="bad_words")
    if params.cache_salt is not None and not 1 <= len(params.cache_salt) <= MAX_CACHE_SALT:
        return InvalidRequest(
            f"cache_salt must have 1 to {MAX_CACHE_SALT} characters", param="cache_salt"
        )
    missing = wanted - limits.features
    if missing:
        feature = min(missing)
        what = feature.value if feature is not Feature.DETOKENIZE else "its detokenization"
        return InvalidRequest(
            f"{what} is not supported by {_engine(limits)} serving this model",
            param=_feature_param(feature, params),
            code="unsupported_parameter",
        )
    return None


def _engine(limits: ModelLimits) -> str:
    return f"the {limits.engine} engine" if limits.engine else "this model's engine"


def _feature_param(feature: Feature, params: SamplingParams) -> str:
    """The request parameter that asked for a feature (a penalty: the first one set)."""
    if feature is Feature.PENALTIES:
        if params.presence_penalty:
            return "presence_penalty"
        return "frequency_penalty" if params.frequency_penalty else "repetition_penalty"
    if feature is Feature.STRUCTURED_OUTPUTS:
        return "response_format"  # the usual way to ask; admission names the one used
    if feature is Feature.DETOKENIZE:
        if not params.skip_special_tokens:
            return "skip_special_tokens"
        if not params.spaces_between_special_tokens:
            return "spaces_between_special_tokens"
        return "include_stop_str_in_output"
    return feature.value


def _bad_ids(token_ids: Sequence[int], limits: ModelLimits, param: str) -> InvalidRequest | None:
    vocab = limits.vocab_size
    if token_ids and (min(token_ids) < 0 or (vocab and max(token_ids) >= vocab)):
        return InvalidRequest(
            f"token ids must be in [0, {vocab or 'vocab size'})", param=param, code="invalid_prompt"
        )
    return None


def embedding_refusal(
    input_lengths: Sequence[int],
    limits: ModelLimits,
    param: str = "input",
    *,
    token_ids: Sequence[int] = (),
    pooling: PoolingOptions | None = None,
) -> InvalidRequest | None:
    """Why an embeddings or scoring job (inputs of these lengths; `pooling` its options)
    cannot run on a model with these limits, or None: the model must serve the task and the
    options, each input fit the context, all of them the token budget."""
    if pooling is not None and pooling.score:
        if not limits.scores:
            return not_a_cross_encoder()
        if len(pooling.second) != len(input_lengths):
            return InvalidRequest("each pair must say where its second text starts", param=param)
    elif not limits.embeds:
        return InvalidRequest(
            "This model does not serve embeddings", param="model", code="model_not_supported"
        )
    elif pooling is not None and pooling.dimensions is not None:
        return dimensions_refusal(pooling.dimensions, limits) or _input_refusal(
            input_lengths, limits, param, token_ids
        )
    return _input_refusal(input_lengths, limits, param, token_ids)


def _input_refusal(
    input_lengths: Sequence[int], limits: ModelLimits, param: str, token_ids: Sequence[int]
) -> InvalidRequest | None:
    if not input_lengths or min(input_lengths) < 1:
        return InvalidRequest("An input is empty", param=param)
    if (bad := _bad_ids(token_ids, limits, param)) is not None:
        return bad
    longest = max(input_lengths)
    if longest > limits.max_model_len:
        return too_long(
            f"This model's maximum context length is {limits.max_model_len} tokens, however "
            f"an input has {longest} tokens. Please reduce the input.",
            param,
        )
    total = sum(input_lengths)
    if total > limits.token_budget:
        return too_long(
            f"The inputs have {total} tokens together; this model takes at most "
            f"{limits.token_budget} in one request",
            param,
        )
    return None


def not_a_cross_encoder(model: str | None = None) -> InvalidRequest:
    """A scoring job for a model that does not score (no sequence-classification head)."""
    name = "This model" if model is None else f"The model '{model}'"
    return InvalidRequest(
        f"{name} is not a cross-encoder: it serves no scores (/v1/score, /v1/rerank)",
        param="model",
        code="model_not_supported",
    )


def dimensions_refusal(dimensions: int, limits: ModelLimits) -> InvalidRequest | None:
    """Why embeddings of this many dimensions cannot be had of a model, or None: shortening a
    vector keeps its meaning only for a matryoshka model (vLLM's rule and words)."""
    if not limits.matryoshka:
        return InvalidRequest(
            "This model does not support matryoshka representation, changing output "
            "dimensions will lead to poor results.",
            param="dimensions",
            code="unsupported_parameter",
        )
    allowed = limits.matryoshka_dimensions
    if allowed and dimensions not in allowed:
        return InvalidRequest(
            f"This model only supports {list(allowed)} matryoshka dimensions, use other "
            "output dimensions will lead to poor results.",
            param="dimensions",
            code="unsupported_parameter",
        )
    if dimensions < 1:
        return InvalidRequest("Dimensions must be greater than 0", param="dimensions")
    return None


def check(error: InvalidRequest | None) -> None:
    """Raise a refusal (`check(refusal(...))`), where the caller's answer to one is to raise."""
    if error is not None:
        raise error


def loosest(published: Iterable[ModelLimits]) -> ModelLimits | None:
    """What the most capable of several workers can take (None when there are none)."""
    every = list(published)
    if not every:
        return None
    return ModelLimits(
        max_model_len=max(x.max_model_len for x in every),
        max_seqs=max(x.max_seqs for x in every),
        token_budget=max(x.token_budget for x in every),
        vocab_size=min(x.vocab_size for x in every),
        generates=any(x.generates for x in every),
        embeds=any(x.embeds for x in every),
        scores=any(x.scores for x in every),
        adapters=any(x.adapters for x in every),
        matryoshka=any(x.matryoshka for x in every),
        matryoshka_dimensions=_loosest_dimensions(every),
        engine=every[0].engine if len({x.engine for x in every}) == 1 else "",
        features=frozenset().union(*(x.features for x in every)),
    )


def _loosest_dimensions(every: Sequence[ModelLimits]) -> tuple[int, ...]:
    """The sizes any of several workers allows to be asked: () (any) once one allows any."""
    shortening = [x for x in every if x.matryoshka]
    if any(not x.matryoshka_dimensions for x in shortening):
        return ()
    return tuple(sorted({d for x in shortening for d in x.matryoshka_dimensions}))
