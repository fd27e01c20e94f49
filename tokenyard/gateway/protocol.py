"""OpenAI-compatible request models and every response body the gateway sends.

Requests are pydantic models that accept unknown fields so the gateway can refuse them by
name; fields OpenAI defines but tokenyard does not implement are declared and refused unless
they hold their neutral value.
"""

from __future__ import annotations

import array
import base64
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from tokenyard.engines.base import EngineTokenizer
from tokenyard.errors import InvalidRequest
from tokenyard.gateway.errors import error_body, unsupported, validation_error
from tokenyard.gateway.jsonbody import check_json
from tokenyard.gateway.tools.parsers import Parsed
from tokenyard.gateway.tools.request import History, Tools, read_tools
from tokenyard.limits import DEADLINE_MIN, MAX_CACHE_SALT, MAX_LOGPROBS
from tokenyard.messages import (
    FinishReason,
    JobRecord,
    JobResult,
    JobSpec,
    JobStatus,
    Priority,
    PromptLogprob,
    TokenChunk,
    TokenLogprob,
)

NonEmptyStr = Annotated[str, Field(min_length=1)]
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def _int64(value: int) -> int:
    # the job crosses the broker as msgpack and engines take 64-bit seeds: a wider value would
    # fail later, in encoding or in a worker, instead of here as the client's own error
    if not INT64_MIN <= value <= INT64_MAX:
        raise PydanticCustomError(
            "int64_range", "must be a signed 64-bit integer (from -2**63 to 2**63 - 1)"
        )
    return value


Int64 = Annotated[int, AfterValidator(_int64)]
# unix seconds, a time (the limit says why): a passed one is admission's refusal (429)
Deadline = Annotated[float, Field(allow_inf_nan=False, ge=DEADLINE_MIN)]


class Request(BaseModel):
    """The base of every request model: unknown fields are kept, to be refused by name."""

    model_config = ConfigDict(extra="allow", strict=True)

    def refuse_unknown(self, known: Mapping[str, tuple[Any, ...]] | None = None) -> None:
        """Raise 400 naming the first field this server does not know; `known`: fields
        accepted (and ignored) while they hold one of these neutral values."""
        unknown = [
            name
            for name, value in (self.model_extra or {}).items()
            if known is None or name not in known or not _neutral(value, known[name])
        ]
        if unknown:
            name = sorted(unknown)[0]
            raise InvalidRequest(
                f"Unrecognized request argument supplied: {name}",
                param=name,
                code="unknown_parameter",
            )


class StreamOptions(Request):
    include_usage: bool = False


class _Common(Request):
    """Fields shared by completions and chat completions."""

    model: NonEmptyStr
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    # choices per call: each its own job (see routes/openai.py), bounded by the gateway's max_n
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[NonEmptyStr], Field(max_length=16)] | None = None
    seed: Int64 | None = None
    user: str | None = None
    # the ranges of these are checked once, with the model's vocabulary, in tokenyard.limits
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # structured outputs: OpenAI's, and vLLM's (see gateway/structured.py)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # extensions vLLM also accepts (top_k -1 is vLLM's "off", as 0)
    top_k: Annotated[Int64, Field(ge=-1)] | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    # -- vLLM's extra fields (`extra_body`); their ranges against the model: tokenyard.limits
    min_p: float | None = None
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    bad_words: list[str] | None = None
    # detokenization: the worker decodes every engine's tokens with these switches
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # the prompt: its last (`truncation_side` left, the default) or first N tokens; -1: as
    # many as the model's context takes; add_special_tokens None: the route's default
    truncate_prompt_tokens: Annotated[Int64, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    add_special_tokens: bool | None = None
    # each prompt token's logprob and this many likeliest, as vLLM shows them (not streamed)
    prompt_logprobs: int | None = None
    # logprobs name each token "token_id:N" (any token, whatever its bytes)
    return_tokens_as_token_ids: bool | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT)] | None = None
    # vLLM's extension: each choice also carries the generated token ids (the remote engine
    # of another tokenyard needs them to decode, resume and count exactly)
    return_token_ids: bool = False
    # tokenyard: a lane priority (capped by the tenant's tier), or vLLM's integer (lower is
    # earlier: < 0 high, 0 the tenant's default, > 0 low); a deadline (unix seconds)
    priority: Literal["high", "normal", "low"] | Int64 | None = None
    deadline: Deadline | None = None
    # tokenyard: false opts a deterministic request out of the response cache and collapsing
    cache: bool | None = None

    def refuse_unsupported(self) -> None:
        """Raise 400 naming the first field this server does not implement."""
        refuse_vllm_only(self.model_extra)
        self.refuse_unknown({name: neutral for name, (neutral, _) in VLLM_ONLY.items()})
        if self.prompt_logprobs and self.stream:
            raise InvalidRequest(
                "'prompt_logprobs' are not available when 'stream' is true",
                param="prompt_logprobs",
            )
        if self.truncate_prompt_tokens == 0:
            raise InvalidRequest(
                "truncate_prompt_tokens must be -1 (the model's context) or at least 1",
                param="truncate_prompt_tokens",
            )
        if self.truncation_side is not None and self.truncate_prompt_tokens is None:
            raise InvalidRequest(
                "'truncation_side' needs 'truncate_prompt_tokens'", param="truncation_side"
            )
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest(
                "'stream_options' is only allowed when 'stream' is true", param="stream_options"
            )

    def refuse_choices(self, why: str) -> None:
        """Raise 400 unless one choice is asked: a job read later is one job per id."""
        if self.n != 1:
            raise unsupported("n", f"other than 1 {why}")

    @property
    def logit_bias_ids(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) sorted by id; a key that is not an integer is 400
        (the ids' and biases' ranges are the limits rule's)."""
        if not self.logit_bias:
            return ()
        pairs: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            digits = key[1:] if key[:1] in "+-" else key
            if not (digits.isascii() and digits.isdigit()) or len(digits) > 19:
                raise InvalidRequest(
                    f"logit_bias keys must be token ids (integers), not {key[:40]!r}",
                    param="logit_bias",
                    code="invalid_value",
                )
            pairs[int(key)] = float(bias)
        return tuple(sorted(pairs.items()))

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def priority_class(self) -> Priority | None:
        return priority_class(self.priority)

    def truncated(self, token_ids: list[int], context: int) -> list[int]:
        """The prompt as `truncate_prompt_tokens` keeps it (vLLM's rule; `context`: the
        model's, what -1 asks for)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return token_ids
        keep = context if keep == -1 else keep
        if len(token_ids) <= keep:
            return token_ids
        return token_ids[:keep] if self.truncation_side == "right" else token_ids[-keep:]


def priority_class(asked: str | int | None) -> Priority | None:
    """A request's `priority` as a lane: tokenyard's name, or vLLM's integer (lower is
    earlier): below 0 high, above 0 low, 0 (vLLM's default) none asked."""
    if asked is None:
        return None
    if isinstance(asked, int):
        return None if asked == 0 else Priority.HIGH if asked < 0 else Priority.LOW
    return Priority[asked.upper()]


# vLLM's request fields tokenyard does not implement, refused by name with why (any other
# unknown field is an unknown parameter) unless they hold their neutral value
VLLM_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "(no beam search here)"),
    "length_penalty": ((1, 1.0), "(a beam search parameter; no beam search here)"),
    "watermarking": ((None, False), "(no watermarking here)"),
    "logprob_token_ids": ((None,), "(logprobs are of the chosen and the most likely tokens)"),
    "prompt_embeds": ((None,), "(prompts are text or token ids)"),
    "repetition_detection": ((None,), "(no n-gram repetition detection here)"),
    "thinking_token_budget": ((None, -1), "(no thinking budget here)"),
    "stream_interval": ((None, 1), "(each engine step's tokens are one chunk)"),
    "kv_transfer_params": ((None,), "(no disaggregated serving here)"),
    "ec_transfer_params": ((None,), "(no disaggregated serving here)"),
    "vllm_xargs": ((None,), "(no vLLM extensions here)"),
    "request_id": ((None,), "(tokenyard names every job; see X-Job-Id)"),
    "session_id": ((None,), "(no sessions here)"),
    "routed_experts_prompt_start": ((0,), "(no routed-expert data here)"),
    "return_token_offsets": ((None, False), "(only vLLM's render endpoints)"),
    "return_mm_kwargs": ((True,), "(only vLLM's render endpoints)"),
    "return_prompt_text": ((None, False), "(the prompt's text is not returned)"),
    "media_io_kwargs": ((None,), "(text models only)"),
    "mm_processor_kwargs": ((None,), "(text models only)"),
    "documents": ((None,), "(no documents in chat templates here)"),
    "echo": ((False,), "(on chat: no echo of the last message)"),  # completions declare theirs
}


def refuse_vllm_only(extra: Mapping[str, Any] | None) -> None:
    """Raise 400 naming the first vLLM field given that tokenyard does not implement."""
    for name in sorted(extra or ()):
        known = VLLM_ONLY.get(name)
        if known is not None and extra is not None and not _neutral(extra[name], known[0]):
            raise unsupported(name, known[1])


def _neutral(value: Any, neutrals: tuple[Any, ...]) -> bool:
    return any(type(value) is type(v) and value == v for v in neutrals)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo and self.logprobs is not None and self.stream:
            # the prompt's logprobs come with the whole answer only
            raise unsupported("logprobs", "together with 'echo' when streamed")
        if self.best_of is not None and self.best_of != self.n:
            # every choice is returned: there is no ranking among more candidates than n
            raise unsupported("best_of", "other than equal to 'n'")
        if self.suffix:
            raise unsupported("suffix")

    @property
    def logprobs_count(self) -> int | None:
        """How many alternatives per token the request asks for; None: no logprobs."""
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """Every prompt, as text or token ids: a list of strings or of id lists is several
        (vLLM's batched completions: each prompt its own jobs, its choices in order)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequest("'prompt' must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [[x for x in p if isinstance(x, int)]]
        return [x if isinstance(x, str) else list(x) for x in p]  # type: ignore[arg-type]

    def refuse_prompts(self, why: str) -> None:
        """Raise 400 unless one prompt is given: a job read later is one job per id."""
        if len(self.prompts()) != 1:
            raise unsupported("prompt", f"with more than one prompt {why}")


class TextPart(Request):
    type: Literal["text"]
    text: str


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a `tool` message answers
    # an assistant's reasoning, as answers carry it (vLLM's name, and DeepSeek's earlier one)
    reasoning: str | None = None
    reasoning_content: str | None = None

    def text(self, index: int) -> str:
        """The message as plain text; only text content parts are accepted."""
        param = f"messages.{index}.content"
        if self.model_extra:
            name = sorted(self.model_extra)[0]
            raise unsupported(f"messages.{index}.{name}")
        if self.content is None:
            if self.role == "assistant" and self.tool_calls:
                return ""  # an answer that is only calls
            raise InvalidRequest("message content must not be null", param=param)
        if isinstance(self.content, str):
            return self.content
        texts: list[str] = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text":
                raise unsupported(f"{param}.{j}", f"of type {part.get('type')!r}")
            try:
                texts.append(TextPart.model_validate(part).text)
            except ValidationError as exc:
                raise validation_error(exc.errors()) from exc
        return "".join(texts)


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
# apply_chat_template's own arguments, which the gateway sets: not a template's variables
TEMPLATE_ARGUMENTS = frozenset(
    (
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    )
)


class ChatTemplateInput(Request):
    """What a chat template renders, as vLLM's chat requests take it (a chat completion, and
    /tokenize with messages: its prompt is the chat completion's): the messages, the tools,
    the template's switches and variables, and a request's own template (see the gateway's
    trust_request_chat_template). Each request refuses both switches set in vLLM's words for
    its endpoint."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None


# bases last to first lay out the fields: the common ones lead, then the template's input
class ChatCompletionRequest(ChatTemplateInput, _Common):
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # reasoning models: the effort reaches the chat template as a variable, beside
    # chat_template_kwargs (vLLM's field); the answer's reasoning is split off by the gateway's
    # reasoning parser
    reasoning_effort: ReasoningEffort | None = None
    include_reasoning: bool = True
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("'top_logprobs' needs 'logprobs' to be true", param="top_logprobs")
        if self.functions:
            raise unsupported("functions", "(deprecated: use 'tools')")
        for name in ("function_call", "audio", "prediction"):
            if getattr(self, name) not in (None, "none"):
                raise unsupported(name)
        if self.modalities not in (None, ["text"]):
            raise unsupported("modalities", "other than ['text']")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest(
                "Cannot set both 'continue_final_message' and 'add_generation_prompt' to true",
                param="continue_final_message",
            )

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    def tool_spec(self) -> Tools:
        """The request's tools and tool_choice, checked (400 naming the bad one)."""
        return read_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's own variables: `chat_template_kwargs`, and `reasoning_effort`
        with the `enable_thinking` it implies unless the kwargs set that (as vLLM passes
        them). A variable the server sets itself is 400 naming it."""
        kwargs = dict(self.chat_template_kwargs or {})
        for key in kwargs:
            if key in TEMPLATE_ARGUMENTS:
                raise InvalidRequest(
                    f"'chat_template_kwargs.{key}' is set by the server, not by a request",
                    param=f"chat_template_kwargs.{key}",
                    code="invalid_value",
                )
        if self.reasoning_effort is not None:
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them; 'developer' is the newer 'system'. An
        assistant's tool calls carry their arguments as dicts, a tool's result the id (and
        function name) of the call it answers, which must be made earlier."""
        out: list[dict[str, Any]] = []
        history = History()
        for i, m in enumerate(self.messages):
            role = "system" if m.role == "developer" else m.role
            message: dict[str, Any] = {"role": role, "content": m.text(i)}
            if m.tool_calls is not None and m.role != "assistant":
                raise InvalidRequest(
                    "only assistant messages carry 'tool_calls'", param=f"messages.{i}.tool_calls"
                )
            if m.tool_calls:
                message["tool_calls"] = history.assistant_calls(
                    m.tool_calls, f"messages.{i}.tool_calls"
                )
            thought = m.reasoning if m.reasoning is not None else m.reasoning_content
            if thought is not None:
                if m.role != "assistant":
                    field = "reasoning" if m.reasoning is not None else "reasoning_content"
                    raise InvalidRequest(
                        f"only assistant messages carry '{field}'",
                        param=f"messages.{i}.{field}",
                    )
                # Qwen3's and DeepSeek's templates read `reasoning_content`; vLLM's own name
                # for it is `reasoning`
                message["reasoning_content"] = message["reasoning"] = thought
            if m.role == "tool":
                name = history.result(m.tool_call_id, f"messages.{i}.tool_call_id")
                message["tool_call_id"] = m.tool_call_id
                message["name"] = name
            elif m.tool_call_id is not None:
                raise InvalidRequest(
                    "only tool messages carry 'tool_call_id'", param=f"messages.{i}.tool_call_id"
                )
            out.append(message)
        return out


def parse(kind: type[Request], body: bytes, *, checked: bool = False) -> Any:
    """Validate a JSON body into `kind`; malformed JSON or an invalid value is 400. `checked`:
    the caller already passed `body` through `check_json`."""
    if not body.strip():
        raise InvalidRequest(
            "The request body is empty; a JSON object is required", code="invalid_json"
        )
    if not checked:
        check_json(body)
    try:
        return kind.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from exc


# -- responses --------------------------------------------------------------------------------
Kind = Literal["completion", "chat"]
ID_PREFIX: Mapping[Kind, str] = {"completion": "cmpl-", "chat": "chatcmpl-"}


def response_id(kind: Kind, job_id: str) -> str:
    return ID_PREFIX[kind] + job_id


def openai_finish_reason(reason: FinishReason | None) -> str | None:
    """OpenAI knows stop and length; anything else surfaces as an error, not a reason."""
    if reason is FinishReason.LENGTH:
        return "length"
    if reason is None:
        return None
    return "stop"


def tool_calls_finish_reason(reason: str | None) -> str | None:
    """An answer that ended by itself with tool calls ends for them, as OpenAI says."""
    return "tool_calls" if reason == "stop" else reason


def reasoning_fields(reasoning: str) -> dict[str, str]:
    """A chat message's (or delta's) reasoning: `reasoning`, vLLM's name for it since late
    2025, and `reasoning_content`, its name before (and DeepSeek's), which many clients read."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def usage(result: JobResult) -> dict[str, Any]:
    return usage_of_choices([result])


def usage_of_choices(results: Sequence[JobResult], per_prompt: int | None = None) -> dict[str, Any]:
    """One call's usage: the choices of a prompt share it, counted once (as OpenAI counts
    it); `per_prompt`: choices of each prompt of a batched call, prompt-major (None: one);
    with `prompt_tokens_details.cached_tokens` where the engine said how much of the prompt its
    prefix cache held (each prompt's first choice's)."""
    step = per_prompt or len(results) or 1
    prompt = sum(r.prompt_tokens for r in results[::step])
    completion = sum(r.completion_tokens for r in results)
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    cached = results[0].cached_tokens if results else None
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


@dataclass(frozen=True)
class Rendering:
    """How a request asked its choices to be shown, the same for every choice: with token ids
    (vLLM's `return_token_ids`), with logprobs (`token_text` names their tokens), with the
    prompt's text before the output (completions' `echo`)."""

    token_ids: bool = False
    token_text: Callable[[int], str] | None = None
    echo: str | None = None
    # names the tokens of the prompt's logprobs (vLLM's `prompt_logprobs`); None: not asked
    prompt_text: Callable[[int], str] | None = None
    # echo with logprobs: the prompt's ids, whose logprobs come before the output's (as vLLM)
    echo_ids: Sequence[int] | None = None


PLAIN = Rendering()


def rendering(
    spec: JobSpec,
    tokenizer: EngineTokenizer | None,
    *,
    echo: bool,
    token_ids: bool,
    tokens_as_ids: bool = False,
) -> Rendering:
    """How a job's choices are shown, from its spec and the request's `echo` and
    `return_token_ids`: logprobs when the job asked for them, named by the tokenizer of the
    model that ran it (an alias or the fast path may have chosen another than the one named)
    or, with `tokens_as_ids` (vLLM's `return_tokens_as_token_ids`), as "token_id:N"; the
    echoed prompt as its text (token ids decoded)."""
    text = None
    if echo:
        if spec.prompt is not None:
            text = spec.prompt
        elif tokenizer is not None:
            text = tokenizer.decode(spec.prompt_token_ids or [])
    namer = None
    if tokenizer is not None:
        namer = _token_as_id if tokens_as_ids else tokenizer.token_text
    logprobs = spec.sampling.logprobs is not None
    return Rendering(
        token_ids=token_ids,
        token_text=namer if logprobs else None,
        echo=text,
        prompt_text=namer if spec.sampling.prompt_logprobs is not None else None,
        echo_ids=spec.prompt_token_ids if echo and logprobs else None,
    )


def prompt_logprobs_body(
    result: JobResult, text: Callable[[int], str]
) -> list[dict[str, dict[str, Any]] | None]:
    """A result's prompt logprobs as vLLM shows them: None for the first token, then per
    token {token id: {logprob, rank, decoded_token}} for it and the most likely ones."""
    shown: list[dict[str, dict[str, Any]] | None] = [None]
    for lp in result.prompt_logprobs or ():
        position = {
            str(t): {"logprob": _logprob(v), "rank": rank, "decoded_token": text(t)}
            for rank, (t, v) in enumerate(lp.top, start=1)
        }
        position[str(lp.token_id)] = {
            "logprob": _logprob(lp.logprob),
            "rank": lp.rank,
            "decoded_token": text(lp.token_id),
        }
        shown.append(position)
    return shown


def _token_as_id(token_id: int) -> str:
    return f"token_id:{token_id}"


# the floor of a shown logprob: JSON has no -inf (vLLM shows the same floor)
_LOGPROB_FLOOR = -9999.0


def _logprob(value: float) -> float:
    return max(value, _LOGPROB_FLOOR)


def _named(text: Callable[[int], str], token_id: int, logprob: float) -> dict[str, Any]:
    token = text(token_id)
    return {
        "token": token,
        "logprob": _logprob(logprob),
        "bytes": list(token.encode("utf-8", errors="replace")),
    }


def chat_logprobs(logprobs: Sequence[TokenLogprob], text: Callable[[int], str]) -> dict[str, Any]:
    """A chat choice's `logprobs`, as OpenAI shows them: each token with its alternatives."""
    return {
        "content": [
            {
                **_named(text, lp.token_id, lp.logprob),
                "top_logprobs": [_named(text, i, v) for i, v in lp.top],
            }
            for lp in logprobs
        ],
        "refusal": None,
    }


def completion_logprobs(
    logprobs: Sequence[TokenLogprob], text: Callable[[int], str], offset: int = 0
) -> dict[str, Any]:
    """A completion choice's `logprobs`, as OpenAI's legacy shape: parallel lists, each
    position's alternatives as {token: logprob} (the chosen token among them, as vLLM), and
    each token's offset in the choice's text starting from `offset`."""
    tokens: list[str] = []
    offsets: list[int] = []
    tops: list[dict[str, float]] = []
    for lp in logprobs:
        token = text(lp.token_id)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        top = {text(i): _logprob(v) for i, v in lp.top}
        top.setdefault(token, _logprob(lp.logprob))
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(lp.logprob) for lp in logprobs],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def echoed_logprobs(
    prompt: Sequence[int],
    logprobs: Sequence[PromptLogprob],
    text: Callable[[int], str],
    generated: dict[str, Any],
) -> dict[str, Any]:
    """A completion choice's `logprobs` with echo: the prompt's tokens first (the first one
    with no logprob, as vLLM shows it), then the generated ones (`generated`, whose offsets
    this moves past the prompt's)."""
    tokens = [text(t) for t in prompt]
    offsets = []
    at = 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    tops: list[dict[str, float] | None] = [None]
    for lp in logprobs:
        top = {text(i): _logprob(v) for i, v in lp.top}
        top.setdefault(text(lp.token_id), _logprob(lp.logprob))
        tops.append(top)
    return {
        "tokens": tokens + generated["tokens"],
        "token_logprobs": [None, *(_logprob(lp.logprob) for lp in logprobs)]
        + generated["token_logprobs"],
        "top_logprobs": tops + generated["top_logprobs"],
        "text_offset": offsets + [at + o for o in generated["text_offset"]],
    }


def choice_logprobs(
    kind: Kind, logprobs: Sequence[TokenLogprob] | None, how: Rendering, offset: int = 0
) -> dict[str, Any] | None:
    """A choice's (or a chunk's) `logprobs` in the shape of its endpoint; None unless asked."""
    if how.token_text is None:
        return None
    if kind == "chat":
        return chat_logprobs(logprobs or (), how.token_text)
    return completion_logprobs(logprobs or (), how.token_text, offset)


def completion_body(
    kind: Kind,
    job_id: str,
    model: str,
    created: int,
    results: Sequence[JobResult],
    how: Rendering | Sequence[Rendering] = PLAIN,
    parsed: Sequence[Parsed | None] = (),
    per_prompt: int | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) completion or chat completion: a choice per result, in order;
    `how`: the choices' rendering, or each choice's; `parsed`: each chat answer read for
    tool calls (when the request offered tools); `per_prompt`: see `usage_of_choices`."""
    hows = [how] * len(results) if isinstance(how, Rendering) else list(how)
    choices: list[dict[str, Any]] = []
    for index, result in enumerate(results):
        how = hows[index]
        choice: dict[str, Any] = {
            "index": index,
            "logprobs": choice_logprobs(kind, result.logprobs, how),
            "finish_reason": openai_finish_reason(result.finish_reason),
        }
        if how.echo_ids and how.token_text is not None and choice["logprobs"] is not None:
            choice["logprobs"] = echoed_logprobs(
                how.echo_ids, result.prompt_logprobs or (), how.token_text, choice["logprobs"]
            )
        if how.token_ids:
            choice["token_ids"] = result.token_ids
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": result.text}
            read = parsed[index] if index < len(parsed) else None
            if read is not None:
                message: dict[str, Any] = {"role": "assistant", "content": read.content}
                if read.calls:
                    message["tool_calls"] = [c.openai() for c in read.calls]
                    choice["finish_reason"] = tool_calls_finish_reason(choice["finish_reason"])
                if read.reasoning is not None:
                    message.update(reasoning_fields(read.reasoning))
                choice["message"] = message
        else:
            choice["text"] = (how.echo or "") + result.text
            if how.prompt_text is not None:
                choice["prompt_logprobs"] = prompt_logprobs_body(result, how.prompt_text)
        choices.append(choice)
    body: dict[str, Any] = {
        "id": response_id(kind, job_id),
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": usage_of_choices(results, per_prompt),
    }
    if kind == "chat" and results and hows and hows[0].prompt_text is not None:
        # the conversation's one prompt: shown once, beside the choices (as vLLM)
        body["prompt_logprobs"] = prompt_logprobs_body(results[0], hows[0].prompt_text)
    return body


def chunk_body(
    kind: Kind,
    job_id: str,
    model: str,
    created: int,
    *,
    index: int = 0,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    usage_of: Sequence[JobResult] | None = None,
    per_prompt: int | None = None,
    no_choices: bool = False,
    token_ids: list[int] | None = None,
    logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    reasoning: str | None = None,
) -> dict[str, Any]:
    """One streamed chunk of choice `index`; `no_choices` is the trailing usage-only chunk;
    `tool_calls`: a chat chunk's `delta.tool_calls` items; `reasoning`: a piece of a chat
    answer's reasoning."""
    choices: list[dict[str, Any]] = []
    if not no_choices:
        choice: dict[str, Any] = {
            "index": index,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        if token_ids is not None:
            choice["token_ids"] = token_ids
        if kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
                delta["content"] = ""
            if text is not None:
                delta["content"] = text
            if tool_calls is not None:
                delta["tool_calls"] = tool_calls
            if reasoning is not None:
                delta.update(reasoning_fields(reasoning))
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choices.append(choice)
    return {
        "id": response_id(kind, job_id),
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": None if usage_of is None else usage_of_choices(usage_of, per_prompt),
    }


def result_error(result: JobResult) -> tuple[int, dict[str, Any]] | None:
    """The HTTP status and OpenAI error of a result that is not a success, else None."""
    status = result.status
    if status is JobStatus.SUCCEEDED:
        return None
    if status is JobStatus.FAILED:
        return 400, error_body(
            result.error or "the request failed", "invalid_request_error", None, "job_failed"
        )
    if status is JobStatus.CANCELLED:
        return 409, error_body("the job was cancelled", "conflict_error", None, "job_cancelled")
    if status is JobStatus.EXPIRED:
        return 503, error_body(
            "the job waited in the queue past its deadline",
            "service_unavailable",
            None,
            "queue_timeout",
        )
    detail = (result.error or "")[:300]
    return 500, error_body(
        f"the job failed on every attempt{': ' + detail if detail else ''}",
        "server_error",
        None,
        "job_dead",
    )


def result_json(result: JobResult) -> dict[str, Any]:
    """A job result as the jobs API shows it."""
    failed = result_error(result)
    return {
        "status": result.status.value,
        "text": result.text,
        "finish_reason": None if result.finish_reason is None else result.finish_reason.value,
        "usage": usage(result),
        "error": None if failed is None else failed[1]["error"],
    }


def model_card(
    model: str,
    created: int | None = None,
    *,
    root: str | None = None,
    max_model_len: int | None = None,
    parent: str | None = None,
) -> dict[str, Any]:
    """A /v1/models entry, with vLLM's fields: `root` the model it serves (a served name's
    directory or hub id; a LoRA adapter's: where it loads from), `parent` (a LoRA adapter's
    base model; else null), `max_model_len` the context a prompt
    and its output must fit, `permission` vLLM's one default grant."""
    created = created or int(time.time())
    return {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "tokenyard",
        "root": root if root is not None else model,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": f"modelperm-{model}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }


def token_event_body(
    chunk: TokenChunk, token_text: Callable[[int], str] | None = None
) -> dict[str, Any]:
    """The `tokens` event of a job's own event stream; with the job's logprobs, when it asked
    for them, in the chat shape (`token_text` names the tokens)."""
    body: dict[str, Any] = {"text": chunk.text, "token_ids": chunk.token_ids}
    if chunk.logprobs is not None and token_text is not None:
        body["logprobs"] = chat_logprobs(chunk.logprobs, token_text)["content"]
    return body


def job_body(job_id: str, record: JobRecord) -> dict[str, Any]:
    """A job as GET /v1/jobs/{id} shows it: status, result and timings."""
    enq, start, end = record.enqueued_at or None, record.started_at, record.finished_at
    return {
        **_job_fields(record.spec),
        "id": job_id,
        "status": record.status.value,
        "deliveries": record.deliveries,
        "preemptions": record.preemptions,
        "cancel_requested": record.cancel_requested,
        "result": None if record.result is None else result_json(record.result),
        "timings": {
            "enqueued_at": enq,
            "started_at": start,
            "finished_at": end,
            "queue_time": None if enq is None or start is None else max(0.0, start - enq),
            "e2e": None if enq is None or end is None else max(0.0, end - enq),
        },
    }


def queued_job_body(spec: JobSpec) -> dict[str, Any]:
    """A job as POST /v1/jobs answers it, just queued; its timings come with GET."""
    timings = dict.fromkeys(("enqueued_at", "started_at", "finished_at", "queue_time", "e2e"))
    return {
        **_job_fields(spec),
        "status": JobStatus.QUEUED.value,
        "deliveries": 0,
        "preemptions": 0,
        "cancel_requested": False,
        "result": None,
        "timings": timings,
    }


def _job_fields(spec: JobSpec) -> dict[str, Any]:
    return {
        "id": spec.id,
        "object": "job",
        "model": spec.adapter or spec.model,  # a LoRA adapter's name, as it was asked
        "tenant": spec.tenant,
        "priority": spec.priority.name.lower(),
        "created_at": spec.created_at,
        "deadline": spec.deadline,
        "events_url": f"/v1/jobs/{spec.id}/events",
    }


def cancel_body(job_id: str, status: str) -> dict[str, Any]:
    """The answer to DELETE /v1/jobs/{id}."""
    return {"id": job_id, "object": "job", "status": status}


def models_body(
    models: Sequence[str],
    created: int,
    roots: Mapping[str, str] | None = None,
    contexts: Mapping[str, int] | None = None,
    parents: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """GET /v1/models; `roots`: each name's model source, `contexts`: its context length,
    `parents`: a LoRA adapter's base model."""
    roots, contexts, parents = roots or {}, contexts or {}, parents or {}
    data = [
        model_card(
            m, created, root=roots.get(m), max_model_len=contexts.get(m), parent=parents.get(m)
        )
        for m in models
    ]
    return {"object": "list", "data": data}


# -- embeddings -------------------------------------------------------------------------------
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on one request's inputs


class EmbeddingRequest(Request):
    """POST /v1/embeddings: one input or many, as text or token ids."""

    model: NonEmptyStr
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    # a matryoshka model's vectors shortened (the model's limits say whether it is one)
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    # vLLM's: L2-normalise (None: as the model pools; `use_activation` is its newer name), and
    # each input cut to its last n tokens (-1: the model's context), or first n (`right`)
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    # tokenyard, as on the completions routes: lane priority, deadline, cache opt-out
    priority: Literal["high", "normal", "low"] | None = None
    deadline: Deadline | None = None
    cache: bool | None = None

    def refuse_unsupported(self) -> None:
        """Raise 400 naming the first field this server does not implement."""
        self.refuse_unknown()
        refuse_no_truncation(self.truncate_prompt_tokens)
        if None not in (self.normalize, self.use_activation) and (
            self.normalize != self.use_activation
        ):
            raise InvalidRequest(
                "'normalize' and 'use_activation' are one option: give one, or the same value",
                param="use_activation",
            )

    @property
    def normalized(self) -> bool | None:
        """Whether the vectors are L2-normalised (None: as the model pools)."""
        return self.normalize if self.normalize is not None else self.use_activation

    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs, each text or token ids; an empty input or too many are refused."""
        raw = self.input
        if isinstance(raw, str):
            raw = [raw]
        if not raw:
            raise InvalidRequest("'input' must not be empty", param="input")
        if all(isinstance(x, int) for x in raw):
            return [[x for x in raw if isinstance(x, int)]]
        if len(raw) > MAX_EMBEDDING_INPUTS:
            raise InvalidRequest(
                f"'input' has {len(raw)} items; at most {MAX_EMBEDDING_INPUTS} are allowed",
                param="input",
            )
        if any(not x for x in raw):
            raise InvalidRequest("'input' must not contain an empty input", param="input")
        return raw  # type: ignore[return-value]

    @property
    def priority_class(self) -> Priority | None:
        return None if self.priority is None else Priority[self.priority.upper()]


def refuse_no_truncation(keep: int | None) -> None:
    """`truncate_prompt_tokens` 0 would leave nothing to pool: -1 or at least 1 (vLLM)."""
    if keep == 0:
        raise InvalidRequest(
            "'truncate_prompt_tokens' must be -1 (the model's context) or at least 1",
            param="truncate_prompt_tokens",
        )


def _vector(data: bytes) -> list[float]:
    values = array.array("f")
    values.frombytes(data)
    if sys.byteorder == "big":  # the bytes are little-endian, as OpenAI's base64 is
        values.byteswap()
    return values.tolist()


def embedding_body(model: str, result: JobResult, encoding_format: str = "float") -> dict[str, Any]:
    """An embeddings job's answer, in OpenAI's shape: a vector per input, in input order."""
    vectors = result.embeddings or []
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": base64.b64encode(v).decode()
            if encoding_format == "base64"
            else _vector(v),
        }
        for i, v in enumerate(vectors)
    ]
    tokens = result.prompt_tokens
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
