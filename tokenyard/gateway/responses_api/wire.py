"""OpenAI's Responses API on the wire: the request body, the response object and its SSE events.

Pure: no I/O. A response is one chat job; its events are numbered from the job's durable event
stream (see `ResponseEvents`), so every gateway numbers them alike and a stream resumes after
any `sequence_number`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, get_args

from pydantic import Field

from tokenyard.errors import InvalidRequest
from tokenyard.gateway import errors
from tokenyard.gateway.errors import unsupported
from tokenyard.gateway.protocol import (
    ChatCompletionRequest,
    NonEmptyStr,
    ReasoningEffort,
    Request,
)
from tokenyard.gateway.streaming import frame
from tokenyard.gateway.tools import (
    AnswerDelta,
    ContentDelta,
    Parsed,
    Reader,
    ReasoningDelta,
    ToolCall,
    Tools,
    call_reader,
    call_reading,
    parse_whole,
    read_function,
    read_tools,
    reasoning_reader,
    stable_call_ids,
)
from tokenyard.messages import (
    CallReading,
    FinishReason,
    JobResult,
    JobStatus,
    StoredResponse,
    TokenChunk,
    Turn,
)

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
        self.tool_spec()  # function tools and tool_choice, checked
        self.text_format()  # its shape; its schema is checked (compiled) at admission
        if self.truncation not in (None, "disabled"):
            raise unsupported("truncation", "other than 'disabled'")
        if self.include:
            raise unsupported("include")
        self.reasoning_effort()  # its shape
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

    def reasoning_effort(self) -> ReasoningEffort | None:
        """`reasoning.effort`: the chat template's variable, as chat's `reasoning_effort`
        passes it (vLLM's reading of the field); a summary is refused (the model's reasoning
        is shown whole, as `reasoning_text`, never summarised)."""
        reasoning = self.reasoning or {}
        for name in sorted(reasoning):
            if name not in ("effort", "summary", "generate_summary"):
                raise unsupported(f"reasoning.{name}")
            if name != "effort" and reasoning[name] is not None:
                raise unsupported(f"reasoning.{name}", "(the reasoning is shown whole)")
        effort = reasoning.get("effort")
        if effort is not None and effort not in get_args(ReasoningEffort):
            raise InvalidRequest(
                f"'reasoning.effort' must be one of {', '.join(get_args(ReasoningEffort))}",
                param="reasoning.effort",
            )
        return effort

    def turns(self) -> list[Turn]:
        """The input as conversation turns; an item or part that is not text is refused."""
        if isinstance(self.input, str):
            return [Turn("user", self.input)]
        if not self.input:
            raise InvalidRequest("'input' must not be empty", param="input")
        return [_turn(item, f"input.{i}") for i, item in enumerate(self.input)]

    def tool_spec(self) -> Tools:
        """The function tools, tool_choice and parallel_tool_calls, checked."""
        return response_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def stored_tools(self) -> str | None:
        """The tool fields as a stored response keeps them (None: no tools)."""
        if not self.tools:
            return None
        fields = {
            "tools": self.tools,
            "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        return json.dumps(fields)

    def text_format(self) -> dict[str, Any] | None:
        """`text.format` (None: plain text), its shape checked. A JSON object or schema goes
        to admission as chat's `response_format`, which checks the name, `strict` and the
        schema (xgrammar must compile it) as for chat."""
        text = self.text or {}
        for name in sorted(text):
            if name != "format":
                raise unsupported(f"text.{name}")
        fmt = text.get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict):
            raise InvalidRequest("'text.format' must be an object", param="text.format")
        kind = fmt.get("type")
        if kind not in _FORMAT_FIELDS:
            raise InvalidRequest(
                "'text.format.type' must be 'text', 'json_object' or 'json_schema'",
                param="text.format.type",
            )
        for name in sorted(fmt):
            if name not in _FORMAT_FIELDS[kind]:
                raise unsupported(f"text.format.{name}", f"with type {kind!r}")
        if kind == "json_schema":
            if "schema" not in fmt:
                raise InvalidRequest(
                    "'text.format.schema' is required with type 'json_schema'",
                    param="text.format.schema",
                )
            if not isinstance(fmt.get("description", ""), str):
                raise InvalidRequest(
                    "'text.format.description' must be a string",
                    param="text.format.description",
                )
        return None if kind == "text" else fmt

    def stored_format(self) -> str | None:
        """`text.format` as a stored response keeps it (JSON; None: plain text)."""
        fmt = self.text_format()
        return None if fmt is None else json.dumps(fmt)

    def chat_request(self, context: list[Turn]) -> ChatCompletionRequest:
        """The chat completion this response runs as: instructions first, then the context."""
        messages = chat_messages(context)
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
        if (effort := self.reasoning_effort()) is not None:
            body["reasoning_effort"] = effort
        fmt = self.text_format()
        if fmt is not None:
            body["response_format"] = _response_format(fmt)
        tools = self.tool_spec()
        if tools.functions:
            body["tools"] = tools.template()
            body["tool_choice"] = _chat_choice(tools)
            body["parallel_tool_calls"] = tools.parallel
        return ChatCompletionRequest.model_validate(body)


# the fields of each `text.format` type, as OpenAI defines them
_FORMAT_FIELDS = {
    "text": ("type",),
    "json_object": ("type",),
    "json_schema": ("type", "name", "schema", "strict", "description"),
}


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """`text.format` (JSON output) as chat's `response_format`: the same structured output."""
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    fields = ("name", "schema", "strict")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in fields if k in fmt}}


# -- function tools -----------------------------------------------------------------------------
# the context's turns that carry a function call, or its output, as their item's JSON
CALL, CALL_OUTPUT = "function_call", "function_call_output"
# a context's turn that carries a reasoning item's text (the assistant's, before its answer)
REASONING = "reasoning"


def response_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> Tools:
    """The Responses API's tool fields (flat function tools: `{"type": "function", "name",
    "parameters", ...}`), checked as chat's are; 400 naming the field as the client sent it."""
    functions = []
    for i, tool in enumerate(tools or ()):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise InvalidRequest(f"'{where}' must be an object", param=where)
        if tool.get("type") != "function":
            raise unsupported(f"{where}.type", f"{tool.get('type')!r} (only function tools)")
        definition = {k: v for k, v in tool.items() if k != "type"}
        functions.append(
            {
                "type": "function",
                "function": read_function(definition, where).template()["function"],
            }
        )
    choice = tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    elif isinstance(choice, dict):
        raise unsupported("tool_choice", f"of type {choice.get('type')!r}")
    return read_tools(functions, choice, parallel)


def _chat_choice(tools: Tools) -> Any:
    if tools.choice == "named":
        return {"type": "function", "function": {"name": tools.named}}
    return tools.choice


def response_reader(
    stored: StoredResponse, parser_setting: str, chat_template: str
) -> Reader | None:
    """A fresh stream reading a stored response's output for its reasoning, then function
    calls (None: it is all text): as its job's `ReasoningReading` and `CallReading`, decided
    at admission and kept with the response, say, whatever the gateway's parsers or the
    model's template are now; its call ids come from the job id, the same on every reading
    (as `job_reader`'s). A response stored before the call reading was kept is decided from
    its stored tools with `parser_setting` and `chat_template`, the gateway's now."""
    reading = stored.calls
    if reading is None:
        reading = _reading_of_tools(stored, parser_setting, chat_template)
    calls = None if reading is None else call_reader(reading, stable_call_ids(stored.job_id))
    if stored.reasoning is None:
        return calls
    return reasoning_reader(stored.reasoning, calls)


def _reading_of_tools(
    stored: StoredResponse, parser_setting: str, chat_template: str
) -> CallReading | None:
    # (a response with tools and tool_choice none keeps no reading either: none again here)
    if stored.tools is None:
        return None
    fields = json.loads(stored.tools)
    try:
        tools = response_tools(
            fields["tools"], fields["tool_choice"], fields["parallel_tool_calls"]
        )
        return call_reading(tools, parser_setting, chat_template)
    except InvalidRequest:  # not readable with today's setting and template: its text
        return None


def chat_messages(context: list[Turn]) -> list[dict[str, Any]]:
    """A context as chat messages: function calls join the assistant message before them
    (as its `tool_calls`), their outputs are `tool` messages."""
    messages: list[dict[str, Any]] = []
    for turn in context:
        last = messages[-1] if messages else None
        if turn.role == REASONING:
            # the assistant message it opens (its content and calls join it), as vLLM reads
            # a reasoning item; the chat template decides whether earlier turns show it
            if last is not None and last["role"] == "assistant" and "reasoning" not in last:
                last["reasoning"] = turn.content
            else:
                messages.append({"role": "assistant", "content": "", "reasoning": turn.content})
        elif turn.role == "assistant" and _open_reasoning(last):
            assert last is not None
            last["content"] = turn.content
        elif turn.role == CALL:
            item = json.loads(turn.content)
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif turn.role == CALL_OUTPUT:
            item = json.loads(turn.content)
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
        else:
            messages.append({"role": turn.role, "content": turn.content})
    return messages


def _open_reasoning(message: dict[str, Any] | None) -> bool:
    """Whether `message` is a reasoning item's assistant message still without its text."""
    return (
        message is not None
        and message["role"] == "assistant"
        and "reasoning" in message
        and message["content"] == ""
        and "tool_calls" not in message
    )


def call_turn(call_id: str, name: str, arguments: str) -> Turn:
    return Turn(CALL, json.dumps({"call_id": call_id, "name": name, "arguments": arguments}))


def _call_item(item: dict[str, Any], param: str) -> Turn:
    """A `function_call` input item (a call the model made earlier) or its output."""
    kind = item["type"]
    fields = ("call_id", "name", "arguments") if kind == CALL else ("call_id", "output")
    for name in sorted(item):
        if name not in (*fields, "type", "id", "status"):
            raise unsupported(f"{param}.{name}")
    values = {}
    for name in fields:
        value = item.get(name)
        if name == "output" and isinstance(value, list):
            value = _text_of(value, f"{param}.output")
        if not isinstance(value, str) or (name != "output" and not value):
            raise InvalidRequest(f"'{param}.{name}' must be a string", param=f"{param}.{name}")
        values[name] = value
    if kind == CALL:
        return call_turn(values["call_id"], values["name"], values["arguments"])
    return Turn(CALL_OUTPUT, json.dumps(values))


def _turn(item: dict[str, Any], param: str) -> Turn:
    """One input item: a message, as EasyInputMessage or the `type: "message"` item."""
    kind = item.get("type", "message")
    if kind in (CALL, CALL_OUTPUT):
        return _call_item(item, param)
    if kind == REASONING:
        return _reasoning_item(item, param)
    if kind != "message":
        raise unsupported(
            f"{param}.type",
            f"{kind!r} (only messages, reasoning, function calls and their outputs)",
        )
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
    return Turn(_ROLES[role], _text_of(content, f"{param}.content"))


def _reasoning_item(item: dict[str, Any], param: str) -> Turn:
    """A `reasoning` input item (an earlier answer's, handed back): its text, from `content`
    (else its summary, as vLLM reads one), joins the assistant message after it."""
    for name in sorted(item):
        if name not in ("type", "id", "summary", "content", "encrypted_content", "status"):
            raise unsupported(f"{param}.{name}")
    if item.get("encrypted_content") is not None:
        raise unsupported(f"{param}.encrypted_content", "(reasoning is never encrypted here)")
    for name in ("content", "summary"):
        parts = item.get(name)
        if parts is not None and not isinstance(parts, list):
            raise InvalidRequest(f"'{param}.{name}' must be a list", param=f"{param}.{name}")
    content, summary = item.get("content") or [], item.get("summary") or []
    field, parts = ("content", content) if content else ("summary", summary)
    texts = []
    for j, part in enumerate(parts):
        where = f"{param}.{field}.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("reasoning_text", "summary_text"):
            raise unsupported(f"{where}.type", f"{kind!r} (only reasoning or summary text)")
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"'{where}.text' must be a string", param=f"{where}.text")
        texts.append(part["text"])
    return Turn(REASONING, "".join(texts))


def _text_of(parts: list[Any], param: str) -> str:
    texts: list[str] = []
    for j, part in enumerate(parts):
        where = f"{param}.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise unsupported(f"{where}.type", f"{kind!r} (only text parts)")
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"'{where}.text' must be a string", param=f"{where}.text")
        texts.append(text)
    return "".join(texts)


# Admission names the chat request's fields; the client sent these.
_PARAMS = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "prompt": "input",
    "response_format": "text.format",
    "response_format.type": "text.format.type",
    "response_format.json_schema": "text.format",
    "response_format.json_schema.name": "text.format.name",
    "response_format.json_schema.strict": "text.format.strict",
    "response_format.json_schema.schema": "text.format.schema",
}


def renamed(exc: InvalidRequest) -> InvalidRequest:
    """An admission error with the parameter named as the Responses API calls it."""
    if exc.param is not None and exc.param.startswith("messages."):
        # a message's field: its index counts the instructions and merged calls
        return InvalidRequest(exc.message, param="input", code=exc.code)
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
        "input_tokens_details": {
            "cached_tokens": result.cached_tokens or 0,
            "cache_write_tokens": 0,
        },
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


def function_call_item(job_id: str, index: int, call: ToolCall, status: str) -> dict[str, Any]:
    """An output item: a call the model made (its `call_id` answers in a later input)."""
    return {
        "id": f"fc_{job_id}_{index}",
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def reasoning_item(job_id: str, text: str, status: str) -> dict[str, Any]:
    """An output item: the model's reasoning, whole (vLLM's shape: no summary, the text as
    one `reasoning_text` part)."""
    return {
        "id": "rs_" + job_id,
        "type": "reasoning",
        "summary": [],
        "content": [] if status == "in_progress" else [_reasoning_part(text)],
        "status": status,
    }


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _message_id(job_id: str, index: int) -> str:
    return "msg_" + job_id if index == 0 else f"msg_{job_id}_{index}"


def output_items(job_id: str, parsed: Parsed, status: str) -> list[dict[str, Any]]:
    """The output of an answer read for reasoning or calls: its reasoning (if any), its text
    (if any; an empty message when there is nothing at all), then its calls, as vLLM lists
    them. Each item ended when the next began: only the last one carries the answer's own
    status (incomplete, when it was cut off)."""
    items = []
    if parsed.reasoning:
        items.append(reasoning_item(job_id, parsed.reasoning, "completed"))
    if parsed.content or not (parsed.calls or items):
        message = message_item(job_id, parsed.content or "", "completed")
        items.append({**message, "id": _message_id(job_id, len(items))})
    items += [function_call_item(job_id, i, c, "completed") for i, c in enumerate(parsed.calls)]
    items[-1]["status"] = status
    return items


def response_body(
    stored: StoredResponse,
    result: JobResult | None,
    job: JobStatus | None = None,
    reader: Reader | None = None,
) -> dict[str, Any]:
    """The response object: its request's settings, and its output once the job ended;
    `reader` (fresh) reads the output for reasoning and function calls."""
    status = status_of(result, job)
    output: list[dict[str, Any]] = []
    if result is not None and result.status is JobStatus.SUCCEEDED:
        item_status = "incomplete" if status == "incomplete" else "completed"
        if reader is None:
            output.append(message_item(stored.job_id, result.text, item_status))
        else:
            output = output_items(stored.job_id, parse_whole(reader, result.text), item_status)
    tools = json.loads(stored.tools) if stored.tools else {}
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
        "model": stored.adapter or stored.model,
        "output": output,
        "parallel_tool_calls": tools.get("parallel_tool_calls") is not False if tools else False,
        "previous_response_id": stored.previous_response_id,
        "store": stored.store,
        "temperature": stored.temperature,
        "text": {"format": json.loads(stored.text_format or '{"type": "text"}')},
        "tool_choice": (tools.get("tool_choice") or "auto") if tools else "none",
        "tools": [_function_tool(t) for t in tools.get("tools", [])],
        "top_p": stored.top_p,
        "truncation": "disabled",
        "usage": None if result is None else usage(result),
        "user": None,
    }


def _function_tool(tool: dict[str, Any]) -> dict[str, Any]:
    # as OpenAI echoes a function tool: every field present
    return {
        "type": "function",
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
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


class ToolResponseEvents(ResponseEvents):
    """The events of a response whose output is read for reasoning or function calls: items
    open as the answer shows them (a `reasoning` item at its first reasoning, its text as
    `response.reasoning_text.delta`; a message at its first text; a `function_call` at each
    call's name, its arguments as `response.function_call_arguments.delta`), numbered as
    `ResponseEvents` numbers (the same job events always give the same items and numbers)."""

    def __init__(self, stored: StoredResponse, reader: Reader, starting_after: int = -1):
        super().__init__(stored, starting_after)
        self.reader = reader
        self.items: list[dict[str, Any]] = []  # the closed output items
        self.open: dict[str, Any] | None = None
        self.text = ""  # of the open message or reasoning
        self.calls = 0

    def start(self) -> list[bytes]:
        opened = response_body(self.stored, None, JobStatus.RUNNING)
        return [
            *self._event("response.created", {"response": {**opened, "status": "in_progress"}}),
            *self._event("response.in_progress", {"response": opened}),
        ]

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    def _open_message(self) -> list[bytes]:
        job = self.stored.job_id
        self.open = {
            **message_item(job, "", "in_progress"),
            "id": _message_id(job, len(self.items)),
        }
        self.text = ""
        return [
            *self._event(
                "response.output_item.added", {"output_index": len(self.items), "item": self.open}
            ),
            *self._event(
                "response.content_part.added",
                {**self._where(), "content_index": 0, "part": _text_part("")},
            ),
        ]

    def _open_reasoning(self) -> list[bytes]:
        self.open = reasoning_item(self.stored.job_id, "", "in_progress")
        self.text = ""
        return [
            *self._event(
                "response.output_item.added", {"output_index": len(self.items), "item": self.open}
            ),
            *self._event(
                "response.content_part.added",
                {**self._where(), "content_index": 0, "part": _reasoning_part("")},
            ),
        ]

    def _close(self, status: str = "completed") -> list[bytes]:
        item = self.open
        if item is None:
            return []
        where = self._where()
        if item["type"] == "reasoning":
            done = {**item, "status": status, "content": [_reasoning_part(self.text)]}
            frames = [
                *self._event(
                    "response.reasoning_text.done",
                    {**where, "content_index": 0, "text": self.text},
                ),
                *self._event(
                    "response.content_part.done",
                    {**where, "content_index": 0, "part": _reasoning_part(self.text)},
                ),
            ]
        elif item["type"] == "message":
            done = {**item, "status": status, "content": [_text_part(self.text)]}
            frames = [
                *self._event(
                    "response.output_text.done",
                    {**where, "content_index": 0, "text": self.text, "logprobs": []},
                ),
                *self._event(
                    "response.content_part.done",
                    {**where, "content_index": 0, "part": _text_part(self.text)},
                ),
            ]
        else:
            done = {**item, "status": status}
            frames = self._event(
                "response.function_call_arguments.done", {**where, "arguments": item["arguments"]}
            )
        frames += self._event(
            "response.output_item.done", {"output_index": len(self.items), "item": done}
        )
        self.items.append(done)
        self.open = None
        return frames

    def _text_delta(self, text: str, kind: str, event: str, **extra: Any) -> list[bytes]:
        """Text of the open item of `kind` (reasoning or message), which opens one of that
        kind first (closing another): alike for the answer's and its reasoning's text."""
        frames: list[bytes] = []
        if self.open is None or self.open["type"] != kind:
            frames += self._close()  # before the new item: it takes the next output index
            frames += self._open_reasoning() if kind == "reasoning" else self._open_message()
        self.text += text
        return frames + self._event(
            event, {**self._where(), "content_index": 0, "delta": text, **extra}
        )

    def _deltas(self, deltas: Sequence[AnswerDelta]) -> list[bytes]:
        frames: list[bytes] = []
        for d in deltas:
            if isinstance(d, ReasoningDelta):
                frames += self._text_delta(d.text, "reasoning", "response.reasoning_text.delta")
            elif isinstance(d, ContentDelta):
                frames += self._text_delta(
                    d.text, "message", "response.output_text.delta", logprobs=[]
                )
            elif d.id is not None and d.name is not None:
                frames += self._close()
                call = ToolCall(d.id, d.name, "")
                self.open = function_call_item(self.stored.job_id, d.index, call, "in_progress")
                frames += self._event(
                    "response.output_item.added",
                    {"output_index": len(self.items), "item": self.open},
                )
            elif self.open is not None and self.open["type"] == "function_call":
                self.open["arguments"] += d.arguments
                frames += self._event(
                    "response.function_call_arguments.delta",
                    {**self._where(), "delta": d.arguments},
                )
        return frames

    def tokens(self, event_id: str, chunk: TokenChunk) -> list[bytes]:
        return self._deltas(self.reader.feed(chunk.text))

    def finish(self, event_id: str, result: JobResult) -> list[bytes]:
        body = response_body(self.stored, result)
        if result.status is not JobStatus.SUCCEEDED:
            return self._event("response.failed", {"response": body})
        status = "incomplete" if body["status"] == "incomplete" else "completed"
        frames = self._deltas(self.reader.finish())
        if not self.items and self.open is None:
            frames += self._open_message()  # an empty answer is one empty message
        frames += self._close(status)
        body["output"] = self.items
        return [*frames, *self._event(f"response.{body['status']}", {"response": body})]
