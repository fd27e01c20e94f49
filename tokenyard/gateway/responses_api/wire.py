"""OpenAI's Responses API on the wire: the request body, the response object and its SSE events.

Pure: no I/O. A response is one chat job; its events are numbered from the job's durable event
stream (see `ResponseEvents`), so every gateway numbers them alike and a stream resumes after
any `sequence_number`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from tokenyard.errors import InvalidRequest
from tokenyard.gateway import errors
from tokenyard.gateway.errors import unsupported
from tokenyard.gateway.protocol import ChatCompletionRequest, NonEmptyStr, Request
from tokenyard.gateway.streaming import frame
from tokenyard.messages import FinishReason, JobResult, JobStatus, StoredResponse, TokenChunk, Turn

ID_PREFIX = "resp_"
METADATA_MAX = 16  # pairs, as OpenAI allows
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text")


def response_id(job_id: str) -> str:
    return ID_PREFIX + job_id


def job_id_of(raw: str) -> str | None:
    """The job id a response id names; None when it is no response id."""
    return raw[len(ID_PREFIX) :] if raw.startswith(ID_PREFIX) else None


class ResponseRequest(Request):
    """POST /v1/responses; every field OpenAI defines that is not here is refused by name."""

    model: NonEmptyStr
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    background: bool = False
    store: bool = True
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = None
    previous_response_id: NonEmptyStr | None = None
    # OpenAI's, taken only at their neutral value (clients and frameworks send them so)
    user: str | None = None
    safety_identifier: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    truncation: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    top_logprobs: int | None = None
    stream_options: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        """Raise 400 naming the first field or combination this server does not take."""
        self.refuse_unknown()
        if self.tools:
            raise unsupported("tools", "(tool calling)")
        if self.tool_choice not in (None, "none", "auto"):
            raise unsupported("tool_choice")
        if self.text not in (None, {}, {"format": {"type": "text"}}):
            raise unsupported("text", "other than {'format': {'type': 'text'}}")
        if self.truncation not in (None, "disabled"):
            raise unsupported("truncation", "other than 'disabled'")
        if self.include:
            raise unsupported("include")
        if self.reasoning:
            raise unsupported("reasoning")
        if self.service_tier not in (None, "auto", "default"):
            raise unsupported("service_tier")
        if self.top_logprobs:
            raise unsupported("top_logprobs")
        if self.stream_options is not None:
            if not self.stream:
                raise InvalidRequest(
                    "'stream_options' is only allowed when 'stream' is true",
                    param="stream_options",
                )
            for name in sorted(self.stream_options):
                if name != "include_obfuscation":  # no obfuscation padding is ever sent
                    raise unsupported(f"stream_options.{name}")
        if self.background and not self.store:
            raise InvalidRequest(
                "Background mode requires 'store' to be true (it is read later)", param="store"
            )
        if self.metadata is not None:
            if len(self.metadata) > METADATA_MAX:
                raise InvalidRequest(
                    f"'metadata' holds at most {METADATA_MAX} pairs", param="metadata"
                )
            if any(len(k) > 64 for k in self.metadata):
                raise InvalidRequest("'metadata' keys are at most 64 characters", param="metadata")

    def turns(self) -> list[Turn]:
        """The input as conversation turns; an item or part that is not text is refused."""
        if isinstance(self.input, str):
            return [Turn("user", self.input)]
        if not self.input:
            raise InvalidRequest("'input' must not be empty", param="input")
        return [_turn(item, f"input.{i}") for i, item in enumerate(self.input)]

    def chat_request(self, context: list[Turn]) -> ChatCompletionRequest:
        """The chat completion this response runs as: instructions first, then the context."""
        messages = [{"role": t.role, "content": t.content} for t in context]
        if self.instructions is not None:
            messages.insert(0, {"role": "system", "content": self.instructions})
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "stream": self.stream,
            # a response is its own job: its id, stored record and numbered events name it
            "cache": False,
        }
        for name, value in (
            ("max_tokens", self.max_output_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
        ):
            if value is not None:
                body[name] = value
        return ChatCompletionRequest.model_validate(body)


def _turn(item: dict[str, Any], param: str) -> Turn:
    """One input item: a message, as EasyInputMessage or the `type: "message"` item."""
    kind = item.get("type", "message")
    if kind != "message":
        raise unsupported(f"{param}.type", f"{kind!r} (only messages)")
    for name in sorted(item):
        if name not in ("type", "role", "content", "id", "status"):
            raise unsupported(f"{param}.{name}")
    role = item.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise InvalidRequest(
            f"'{param}.role' must be one of {', '.join(_ROLES)}", param=f"{param}.role"
        )
    content = item.get("content")
    if isinstance(content, str):
        return Turn(_ROLES[role], content)
    if not isinstance(content, list):
        raise InvalidRequest(
            f"'{param}.content' must be a string or a list of text parts", param=f"{param}.content"
        )
    texts: list[str] = []
    for j, part in enumerate(content):
        where = f"{param}.content.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise unsupported(f"{where}.type", f"{kind!r} (only text parts)")
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"'{where}.text' must be a string", param=f"{where}.text")
        texts.append(text)
    return Turn(_ROLES[role], "".join(texts))


# Admission names the chat request's fields; the client sent these.
_PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "prompt": "input"}


def renamed(exc: InvalidRequest) -> InvalidRequest:
    """An admission error with the parameter named as the Responses API calls it."""
    return errors.renamed(exc, _PARAMS)


# -- the response object ------------------------------------------------------------------------


def status_of(result: JobResult | None, job: JobStatus | None) -> str:
    """The response's status from its job's result, else from the job's state."""
    if result is None:
        return "in_progress" if job is JobStatus.RUNNING else "queued"
    if result.status is JobStatus.SUCCEEDED:
        return "incomplete" if result.finish_reason is FinishReason.LENGTH else "completed"
    if result.status is JobStatus.CANCELLED:
        return "cancelled"
    return "failed"


def usage(result: JobResult) -> dict[str, Any]:
    return {
        "input_tokens": result.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def _error(result: JobResult) -> dict[str, Any] | None:
    if result.status in (JobStatus.SUCCEEDED, JobStatus.CANCELLED):
        return None
    if result.status is JobStatus.FAILED:
        return {"code": "invalid_prompt", "message": result.error or "the request failed"}
    if result.status is JobStatus.EXPIRED:
        return {"code": "server_error", "message": "the job waited in the queue too long"}
    detail = (result.error or "")[:300]
    message = f"the job failed on every attempt{': ' + detail if detail else ''}"
    return {"code": "server_error", "message": message}


def message_item(job_id: str, text: str, status: str) -> dict[str, Any]:
    """The one output message: the assistant's text."""
    return {
        "id": "msg_" + job_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if status == "in_progress" else [_text_part(text)],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_body(
    stored: StoredResponse, result: JobResult | None, job: JobStatus | None = None
) -> dict[str, Any]:
    """The response object: its request's settings, and its output once the job ended."""
    status = status_of(result, job)
    output: list[dict[str, Any]] = []
    if result is not None and result.status is JobStatus.SUCCEEDED:
        item_status = "incomplete" if status == "incomplete" else "completed"
        output.append(message_item(stored.job_id, result.text, item_status))
    return {
        "id": stored.id,
        "object": "response",
        "created_at": int(stored.created_at),
        "status": status,
        "background": stored.background,
        "completed_at": None if stored.completed_at is None else int(stored.completed_at),
        "error": None if result is None else _error(result),
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete" else None),
        "instructions": stored.instructions,
        "max_output_tokens": stored.max_output_tokens,
        "metadata": stored.metadata or {},
        "model": stored.model,
        "output": output,
        "parallel_tool_calls": False,
        "previous_response_id": stored.previous_response_id,
        "store": stored.store,
        "temperature": stored.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": "none",
        "tools": [],
        "top_p": stored.top_p,
        "truncation": "disabled",
        "usage": None if result is None else usage(result),
        "user": None,
    }


def deleted_body(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "deleted": True}


# -- the event stream -----------------------------------------------------------------------------


class ResponseEvents:
    """A response's SSE events, numbered from its job's event stream (a `Renderer`).

    Numbering: 0 `response.created`, 1 `response.in_progress`, 2 `response.output_item.added`,
    3 `response.content_part.added`, then one `response.output_text.delta` per token event
    with text, in stream order, then the closing events. A stream read from its start numbers
    alike on every gateway and after every restart, so `starting_after` drops exactly the
    events a client had; the job's events are read from the start for that.
    """

    def __init__(self, stored: StoredResponse, starting_after: int = -1) -> None:
        self.stored = stored
        self.starting_after = starting_after
        self.next = 0  # the sequence number of the next event
        self.item = message_item(stored.job_id, "", "in_progress")

    def _event(self, type_: str, body: dict[str, Any]) -> list[bytes]:
        seq = self.next
        self.next += 1
        if seq <= self.starting_after:
            return []
        return [frame({"type": type_, "sequence_number": seq, **body}, event=type_)]

    def _part(self, **body: Any) -> dict[str, Any]:
        return {"item_id": self.item["id"], "output_index": 0, "content_index": 0, **body}

    def start(self) -> list[bytes]:
        opened = response_body(self.stored, None, JobStatus.RUNNING)
        return [
            *self._event("response.created", {"response": {**opened, "status": "in_progress"}}),
            *self._event("response.in_progress", {"response": opened}),
            *self._event("response.output_item.added", {"output_index": 0, "item": self.item}),
            *self._event("response.content_part.added", self._part(part=_text_part(""))),
        ]

    def tokens(self, event_id: str, chunk: TokenChunk) -> list[bytes]:
        if not chunk.text:
            return []  # an incomplete UTF-8 character: its text comes with a later event
        return self._event("response.output_text.delta", self._part(delta=chunk.text, logprobs=[]))

    def finish(self, event_id: str, result: JobResult) -> list[bytes]:
        body = response_body(self.stored, result)
        if result.status is not JobStatus.SUCCEEDED:
            return self._event("response.failed", {"response": body})
        item = body["output"][0]
        text = result.text
        return [
            *self._event("response.output_text.done", self._part(text=text, logprobs=[])),
            *self._event("response.content_part.done", self._part(part=_text_part(text))),
            *self._event("response.output_item.done", {"output_index": 0, "item": item}),
            *self._event(f"response.{body['status']}", {"response": body}),
        ]

    def ended(self) -> list[bytes]:
        return []

    def failure(self, message: str, code: str, status: int) -> list[bytes]:
        # a transport failure, not an event of the job: it takes no number from the stream
        body = {"type": "error", "sequence_number": self.next, "code": code, "message": message}
        return [frame({**body, "param": None}, event="error")]
