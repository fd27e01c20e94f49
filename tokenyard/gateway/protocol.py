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
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from tokenyard.errors import InvalidRequest
from tokenyard.gateway.errors import error_body, unsupported, validation_error
from tokenyard.gateway.jsonbody import check_json
from tokenyard.gateway.tools.parsers import Parsed
from tokenyard.gateway.tools.request import History, Tools, read_tools
from tokenyard.messages import (
    FinishReason,
    JobRecord,
    JobResult,
    JobSpec,
    JobStatus,
    Priority,
    TokenChunk,
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


class Request(BaseModel):
    """The base of every request model: unknown fields are kept, to be refused by name."""

    model_config = ConfigDict(extra="allow", strict=True)

    def refuse_unknown(self) -> None:
        """Raise 400 naming the first field this server does not know."""
        if self.model_extra:
            name = sorted(self.model_extra)[0]
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
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[NonEmptyStr], Field(max_length=16)] | None = None
    seed: Int64 | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # extensions vLLM also accepts
    top_k: Annotated[Int64, Field(ge=0)] | None = None
    ignore_eos: bool = False
    # vLLM's extension: each choice also carries the generated token ids (the remote engine
    # of another tokenyard needs them to decode, resume and count exactly)
    return_token_ids: bool = False
    # tokenyard: a lane priority (capped by the tenant's tier) and a deadline (unix seconds)
    priority: Literal["high", "normal", "low"] | None = None
    deadline: Annotated[float, Field(allow_inf_nan=False)] | None = None
    # tokenyard: false opts a deterministic request out of the response cache and collapsing
    cache: bool | None = None

    def refuse_unsupported(self) -> None:
        """Raise 400 naming the first field this server does not implement."""
        self.refuse_unknown()
        if self.n != 1:
            raise unsupported("n", "other than 1")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0.0):
                raise unsupported(name)
        if self.logit_bias:
            raise unsupported("logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest(
                "'stream_options' is only allowed when 'stream' is true", param="stream_options"
            )

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
        return None if self.priority is None else Priority[self.priority.upper()]


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise unsupported("echo")
        if self.logprobs is not None:
            raise unsupported("logprobs")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", "other than 1")
        if self.suffix:
            raise unsupported("suffix")

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids; several prompts in one call are refused."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise InvalidRequest("'prompt' must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [x for x in p if isinstance(x, int)]
        if len(p) != 1:
            raise unsupported("prompt", "with more than one prompt per request")
        only = p[0]
        return only if isinstance(only, str) else list(only)  # type: ignore[arg-type]


class TextPart(Request):
    type: Literal["text"]
    text: str


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a `tool` message answers

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


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs or self.top_logprobs is not None:
            raise unsupported("logprobs")
        if self.functions:
            raise unsupported("functions", "(deprecated: use 'tools')")
        for name in ("function_call", "audio", "prediction", "reasoning_effort"):
            if getattr(self, name) not in (None, "none"):
                raise unsupported(name)
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise unsupported("response_format", "other than {'type': 'text'}")
        if self.modalities not in (None, ["text"]):
            raise unsupported("modalities", "other than ['text']")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    def tool_spec(self) -> Tools:
        """The request's tools and tool_choice, checked (400 naming the bad one)."""
        return read_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

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


def usage(result: JobResult) -> dict[str, int]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def completion_body(
    kind: Kind,
    job_id: str,
    model: str,
    created: int,
    result: JobResult,
    *,
    token_ids: bool = False,
    parsed: Parsed | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) completion or chat completion; `parsed`: the chat answer read
    for tool calls."""
    choice: dict[str, Any] = {
        "index": 0,
        "logprobs": None,
        "finish_reason": openai_finish_reason(result.finish_reason),
    }
    if token_ids:
        choice["token_ids"] = result.token_ids
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": result.text}
        if parsed is not None and parsed.calls:
            choice["message"] = {
                "role": "assistant",
                "content": parsed.content,
                "tool_calls": [c.openai() for c in parsed.calls],
            }
            choice["finish_reason"] = tool_calls_finish_reason(choice["finish_reason"])
        obj = "chat.completion"
    else:
        choice["text"] = result.text
        obj = "text_completion"
    return {
        "id": response_id(kind, job_id),
        "object": obj,
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [choice],
        "usage": usage(result),
    }


def chunk_body(
    kind: Kind,
    job_id: str,
    model: str,
    created: int,
    *,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    usage_of: JobResult | None = None,
    no_choices: bool = False,
    token_ids: list[int] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One streamed chunk; `no_choices` is the trailing usage-only chunk; `tool_calls`: a
    chat chunk's `delta.tool_calls` items."""
    choices: list[dict[str, Any]] = []
    if not no_choices:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
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
        "usage": None if usage_of is None else usage(usage_of),
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


def model_card(model: str, created: int | None = None) -> dict[str, Any]:
    return {
        "id": model,
        "object": "model",
        "created": created or int(time.time()),
        "owned_by": "tokenyard",
    }


def token_event_body(chunk: TokenChunk) -> dict[str, Any]:
    """The `tokens` event of a job's own event stream."""
    return {"text": chunk.text, "token_ids": chunk.token_ids}


def job_body(job_id: str, record: JobRecord) -> dict[str, Any]:
    """A job as GET /v1/jobs/{id} shows it: status, result and timings."""
    enq, start, end = record.enqueued_at or None, record.started_at, record.finished_at
    return {
        **_job_fields(record.spec),
        "id": job_id,
        "status": record.status.value,
        "deliveries": record.deliveries,
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
        "cancel_requested": False,
        "result": None,
        "timings": timings,
    }


def _job_fields(spec: JobSpec) -> dict[str, Any]:
    return {
        "id": spec.id,
        "object": "job",
        "model": spec.model,
        "tenant": spec.tenant,
        "priority": spec.priority.name.lower(),
        "created_at": spec.created_at,
        "deadline": spec.deadline,
        "events_url": f"/v1/jobs/{spec.id}/events",
    }


def cancel_body(job_id: str, status: str) -> dict[str, Any]:
    """The answer to DELETE /v1/jobs/{id}."""
    return {"id": job_id, "object": "job", "status": status}


def models_body(models: Sequence[str], created: int) -> dict[str, Any]:
    """GET /v1/models."""
    return {"object": "list", "data": [model_card(m, created) for m in models]}


# -- embeddings -------------------------------------------------------------------------------
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on one request's inputs


class EmbeddingRequest(Request):
    """POST /v1/embeddings: one input or many, as text or token ids."""

    model: NonEmptyStr
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    # tokenyard, as on the completions routes: lane priority, deadline, cache opt-out
    priority: Literal["high", "normal", "low"] | None = None
    deadline: Annotated[float, Field(allow_inf_nan=False)] | None = None
    cache: bool | None = None

    def refuse_unsupported(self) -> None:
        """Raise 400 naming the first field this server does not implement."""
        self.refuse_unknown()
        if self.dimensions is not None:
            raise unsupported("dimensions", "(the model's own size only)")

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
