"""Anthropic's Messages API on the wire: the request body (as the chat request it runs as), the
message that answers it and its SSE events.

Pure: no I/O. A message is one chat job admitted as the OpenAI chat route's are (the request is
translated into a `ChatCompletionRequest`); only its shapes are Anthropic's. Errors take
Anthropic's shape at the HTTP edge (`gateway/errors.py`, by path).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError

from tokenyard.errors import InvalidRequest
from tokenyard.gateway.errors import anthropic_error, renamed, unsupported, validation_error
from tokenyard.gateway.protocol import (
    ChatCompletionRequest,
    Deadline,
    Int64,
    NonEmptyStr,
    Request,
)
from tokenyard.gateway.protocol import result_error as openai_result_error
from tokenyard.gateway.streaming import frame
from tokenyard.gateway.tools import (
    AnswerDelta,
    ContentDelta,
    Reader,
    ReasoningDelta,
    ReasoningStream,
)
from tokenyard.messages import FinishReason, JobResult, TokenChunk

ID_PREFIX = "msg_"
STOP_SEQUENCES_MAX = 16  # the job's stop strings' bound (the chat request's `stop`)
# a tool's name, as Anthropic (and OpenAI, for a function) allows it
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"

Decode = Callable[[Sequence[int]], str]
M = TypeVar("M", bound=BaseModel)


def message_id(job_id: str) -> str:
    return ID_PREFIX + job_id


class Metadata(Request):
    user_id: str | None = None


class ToolChoice(Request):
    type: Literal["auto", "any", "tool", "none"]
    name: NonEmptyStr | None = None
    disable_parallel_tool_use: bool | None = None


class Message(Request):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class TextBlock(Request):
    type: Literal["text"]
    text: str
    # a prompt-caching hint: tokenyard's engines cache prefixes by themselves
    cache_control: dict[str, Any] | None = None
    citations: None = None  # what a client sends back of an answer's text block


class ToolUseBlock(Request):
    type: Literal["tool_use"]
    id: NonEmptyStr
    name: NonEmptyStr
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(Request):
    """An assistant's thinking, as an answer carried it: the conversation's reasoning."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # tokenyard's own (a digest): nothing to verify


class ToolResultBlock(Request):
    type: Literal["tool_result"]
    tool_use_id: NonEmptyStr
    content: str | list[dict[str, Any]] | None = None
    # taken, not rendered: no chat template has a place for it, the result's text is what
    # the model reads (an error's text says it failed)
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class Tool(Request):
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # the others are Anthropic's server tools
    cache_control: dict[str, Any] | None = None


_BLOCKS: Mapping[str, type[Request]] = {
    "text": TextBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
}


def _validate(model: type[M], data: Any, where: str) -> M:
    """`data` as `model`, an invalid value or an unknown field refused naming its place."""
    try:
        value = model.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": (*where.split("."), *e["loc"])} for e in exc.errors()]
        raise validation_error(errors) from exc
    if value.model_extra:
        raise unsupported(f"{where}.{sorted(value.model_extra)[0]}")
    return value


def _block(part: Any, where: str) -> Request:
    """One content block: text, tool_use, tool_result or thinking; any other (image,
    document, redacted_thinking, ...) is refused by its type."""
    kind = part.get("type") if isinstance(part, dict) else None
    model = _BLOCKS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise unsupported(where, f"of type {kind!r}")
    return _validate(model, part, where)


def _texts(content: str | list[dict[str, Any]] | None, where: str) -> str:
    """Content that may hold only text (the system prompt, a tool result) as one string."""
    if content is None or isinstance(content, str):
        return content or ""
    texts: list[str] = []
    for j, part in enumerate(content):
        block = _block(part, f"{where}.{j}")
        if not isinstance(block, TextBlock):
            raise unsupported(f"{where}.{j}", f"of type {part['type']!r} (only text here)")
        texts.append(block.text)
    return "".join(texts)


def _turns(message: Message, where: str, places: Places) -> list[dict[str, Any]]:
    """One message as chat messages: a user's tool results are `tool` messages (before its
    text, as Anthropic orders them), an assistant's tool uses its `tool_calls`."""
    if isinstance(message.content, str):
        places.add(where)
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    uses: list[str] = []  # each call's block
    for j, part in enumerate(message.content):
        block, at = _block(part, f"{where}.content.{j}"), f"{where}.content.{j}"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            if message.role != "assistant":
                raise InvalidRequest(f"'{at}': thinking blocks are the assistant's", param=at)
            thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise InvalidRequest(f"'{at}': tool_use blocks are the assistant's", param=at)
            arguments = json.dumps(block.input, ensure_ascii=False)
            function = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": function})
            uses.append(at)
        else:
            assert isinstance(block, ToolResultBlock)
            if message.role != "user":
                raise InvalidRequest(f"'{at}': tool_result blocks are the user's", param=at)
            text = _texts(block.content, f"{at}.content")
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
            places.add(at)
    turns = results
    if message.role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            turn["tool_calls"] = calls
        else:
            turn["content"] = turn["content"] or ""
        if thoughts:
            turn["reasoning"] = "".join(thoughts)  # (as vLLM hands it to the template)
        turns.append(turn)
        places.add(where, uses)
    elif texts or not results:
        turns.append({"role": "user", "content": "".join(texts)})
        places.add(where)
    return turns


# a chat request's field → the message request's (admission names the chat request's)
PARAMS = {
    "stop": "stop_sequences",
    "user": "metadata.user_id",
    "prompt": "messages",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
}
# a chat tool call's field → its tool_use block's; a function's → its tool's
_CALL_FIELDS = {"id": "id", "function.name": "name", "function.arguments": "input"}
_FUNCTION_FIELDS = {"parameters": "input_schema"}


class Places:
    """Where each chat message (and each of its tool calls) came from in the message request,
    so that a refusal of the chat request (admission's, the tools package's), which names the
    chat request's fields, names what the client wrote."""

    def __init__(self) -> None:
        self.messages: list[str] = []  # chat message i's source: a message, a block, "system"
        self.calls: dict[int, list[str]] = {}  # chat message i's calls' tool_use blocks

    def add(self, source: str, calls: Sequence[str] = ()) -> None:
        if calls:
            self.calls[len(self.messages)] = list(calls)
        self.messages.append(source)

    def name(self, param: str) -> str:
        """The message request's name of the chat request's `param`."""
        head, _, rest = param.partition(".")
        index, _, field = rest.partition(".")
        if head == "messages" and index.isdigit() and int(index) < len(self.messages):
            i = int(index)
            if field == "tool_call_id":
                return f"{self.messages[i]}.tool_use_id"
            kind, _, tail = field.partition(".")
            call, _, tail = tail.partition(".")
            uses = self.calls.get(i, [])
            if kind == "tool_calls" and call.isdigit() and int(call) < len(uses):
                use = uses[int(call)]
                return f"{use}.{_CALL_FIELDS[tail]}" if tail in _CALL_FIELDS else use
            return self.messages[i]
        if head == "tools" and index.isdigit():
            _, _, name = field.partition("function.")
            name = _FUNCTION_FIELDS.get(name, name)
            return f"tools.{index}.{name}" if name else f"tools.{index}"
        return PARAMS.get(param, param)

    def renamed(self, exc: InvalidRequest) -> InvalidRequest:
        if exc.param is None:
            return exc
        return renamed(exc, {exc.param: self.name(exc.param)})


def _function(tool: Tool) -> dict[str, Any]:
    """A tool as OpenAI's function."""
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return function


class Thinking(Request):
    type: Literal["enabled", "disabled"]
    # Anthropic's bound on the thinking's tokens: taken, not enforced (as vLLM); the
    # answer's max_tokens bounds thinking and text together
    budget_tokens: Annotated[int, Field(ge=1)] | None = None


class MessageRequest(Request):
    """POST /v1/messages; every field Anthropic defines that is not here is refused by name."""

    model: NonEmptyStr
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: Annotated[list[NonEmptyStr], Field(max_length=STOP_SEQUENCES_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[Int64, Field(ge=0)] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    # Anthropic's extended thinking: the reasoning a reasoning parser splits off is answered
    # as thinking blocks; `disabled` turns the template's thinking off (reasoning_effort none)
    thinking: Thinking | None = None
    # a prompt-caching hint for the whole request, as on a block
    cache_control: dict[str, Any] | None = None
    # tokenyard: a lane priority (capped by the tenant's tier), a deadline (unix seconds), and
    # false opts a deterministic request out of the response cache and collapsing
    priority: Literal["high", "normal", "low"] | None = None
    deadline: Deadline | None = None
    cache: bool | None = None

    def refuse_unsupported(self) -> None:
        """Raise 400 naming the first field this server does not take."""
        self.refuse_unknown()
        for i, message in enumerate(self.messages):
            if message.model_extra:
                raise unsupported(f"messages.{i}.{sorted(message.model_extra)[0]}")
        last = len(self.messages) - 1
        if self.messages[last].role == "assistant":
            # Anthropic continues a last assistant turn (a prefill); a chat template opens a
            # new one after it, which would answer something else than was asked
            raise unsupported(f"messages.{last}", "as an assistant's last turn (a prefill)")
        for name in ("metadata", "tool_choice", "thinking"):
            value = getattr(self, name)
            if value is not None and value.model_extra:
                raise unsupported(f"{name}.{sorted(value.model_extra)[0]}")
        choice = self.tool_choice
        if choice is not None:
            if (choice.type == "tool") != (choice.name is not None):
                raise InvalidRequest(
                    "'tool_choice.name' names the tool of tool_choice type 'tool', and only it",
                    param="tool_choice.name",
                )
            if choice.type in ("any", "tool") and not self.tools:
                raise InvalidRequest(
                    f"tool_choice type {choice.type!r} needs 'tools'", param="tool_choice"
                )

    @property
    def thinking_off(self) -> bool:
        return self.thinking is not None and self.thinking.type == "disabled"

    def tool_list(self) -> list[Tool]:
        tools: list[Tool] = []
        for i, raw in enumerate(self.tools or ()):
            kind = raw.get("type") if isinstance(raw, dict) else None
            if kind not in (None, "custom"):
                raise unsupported(f"tools.{i}", f"of type {kind!r} (only custom tools)")
            tools.append(_validate(Tool, raw, f"tools.{i}"))
        return tools

    def chat_request(self) -> tuple[ChatCompletionRequest, Places]:
        """The chat completion this message runs as: the system prompt first, then the turns;
        tool uses and results as OpenAI's tool calls and tool messages. `Places` names a
        refusal of it as the client wrote the request."""
        self.refuse_unsupported()
        messages: list[dict[str, Any]] = []
        places = Places()
        if self.system is not None:
            system = _texts(self.system, "system")
            if system:
                messages.append({"role": "system", "content": system})
                places.add("system")
        for i, message in enumerate(self.messages):
            messages.extend(_turns(message, f"messages.{i}", places))
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "stream": self.stream,
        }
        tools = self.tool_list()
        if tools:
            body["tools"] = [{"type": "function", "function": _function(t)} for t in tools]
        choice = self.tool_choice
        if choice is not None and tools:
            if choice.type == "tool":
                if choice.name not in {t.name for t in tools}:
                    raise InvalidRequest(
                        f"'tool_choice.name': {choice.name!r} is none of the tools",
                        param="tool_choice.name",
                    )
                body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                body["tool_choice"] = {"auto": "auto", "any": "required"}.get(choice.type, "none")
            if choice.disable_parallel_tool_use is not None:
                body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        for name, value in (
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("top_k", self.top_k),
            ("stop", self.stop_sequences),
            ("user", self.metadata.user_id if self.metadata is not None else None),
            ("priority", self.priority),
            ("deadline", self.deadline),
            ("cache", self.cache),
            ("reasoning_effort", "none" if self.thinking_off else None),
        ):
            if value is not None:
                body[name] = value
        try:
            return ChatCompletionRequest.model_validate(body), places
        except ValidationError as exc:
            raise places.renamed(validation_error(exc.errors())) from exc


# -- the message ------------------------------------------------------------------------------


def matched_stop(stops: Sequence[str], result: JobResult, decode: Decode) -> str | None:
    """The stop sequence that ended `result`, or None (an end of turn, or no stop sequences).

    The job's result says only that it stopped, and its text leaves the stop string out; its
    tokens still hold it. No stop string occurs in the emitted text (the first occurrence ends
    it), so the earliest one in the tokens' full text is the one that matched; of several
    starting there, the shortest, which a stream completes first."""
    if not stops or result.finish_reason is not FinishReason.STOP or not result.token_ids:
        return None
    full = decode(result.token_ids)
    found = [(at, len(s), s) for s in stops if (at := full.find(s)) >= 0]
    return min(found)[2] if found else None


def signature(thinking: str) -> str:
    """A thinking block's signature: a digest of its text."""
    return hashlib.sha256(thinking.encode()).hexdigest()[:32]


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


def result_error(result: JobResult) -> tuple[int, dict[str, Any]] | None:
    """The status and Anthropic error of a result that is not a success, else None."""
    failed = openai_result_error(result)
    if failed is None:
        return None
    return anthropic_error(failed[0], failed[1]["error"]["message"])


def _event(type_: str, **body: Any) -> bytes:
    return frame({"type": type_, **body}, event=type_)


class Blocks:
    """An answer's content blocks, built from what its parser reads (text, and tool calls
    announced then their arguments' JSON piece by piece), with the SSE events that stream
    them; the whole answer is the same machine fed at once, so both carry the same blocks."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._inputs: dict[int, str] = {}  # a tool_use block's index -> its input's JSON text
        self._of_call: dict[int, int] = {}  # a call's index (the parser's) -> its block's

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        frames = self._stop()
        self.blocks.append(block)
        index = len(self.blocks) - 1
        opened = {**block, "input": {}} if block["type"] == "tool_use" else block
        frames.append(_event("content_block_start", index=index, content_block=dict(opened)))
        return frames

    def _stop(self) -> list[bytes]:
        if not self.blocks:
            return []
        index = len(self.blocks) - 1
        frames = []
        last = self.blocks[-1]
        if last["type"] == "thinking":
            # Anthropic's clients keep a thinking block's signature and send it back; nothing
            # here checks it, so it is a digest of the thinking (the same for every reading)
            last["signature"] = signature(last["thinking"])
            delta = {"type": "signature_delta", "signature": last["signature"]}
            frames.append(_event("content_block_delta", index=index, delta=delta))
        return [*frames, _event("content_block_stop", index=index)]

    def open_text(self) -> list[bytes]:
        return self._start({"type": "text", "text": ""})

    def feed(self, deltas: Sequence[AnswerDelta]) -> list[bytes]:
        frames: list[bytes] = []
        for d in deltas:
            if isinstance(d, ReasoningDelta):
                if not d.text:
                    continue
                if not self.blocks or self.blocks[-1]["type"] != "thinking":
                    frames.extend(self._start({"type": "thinking", "thinking": ""}))
                self.blocks[-1]["thinking"] += d.text
                delta: dict[str, Any] = {"type": "thinking_delta", "thinking": d.text}
            elif isinstance(d, ContentDelta):
                if not d.text:
                    continue
                if not self.blocks or self.blocks[-1]["type"] != "text":
                    frames.extend(self.open_text())
                self.blocks[-1]["text"] += d.text
                delta = {"type": "text_delta", "text": d.text}
            else:
                if d.id is not None and d.name is not None:
                    frames.extend(self._start({"type": "tool_use", "id": d.id, "name": d.name}))
                    self._of_call[d.index] = len(self.blocks) - 1
                    self._inputs[len(self.blocks) - 1] = ""
                if not d.arguments:
                    continue
                index = self._of_call[d.index]
                if index != len(self.blocks) - 1:
                    continue  # the parsers finish a call before the next: never seen
                self._inputs[index] += d.arguments
                delta = {"type": "input_json_delta", "partial_json": d.arguments}
            frames.append(_event("content_block_delta", index=len(self.blocks) - 1, delta=delta))
        return frames

    def close(self) -> list[bytes]:
        """The last block's stop; an answer with no block at all has one empty text block
        (clients read `content[0]`)."""
        if not self.blocks:
            return [*self.open_text(), *self._stop()]
        return self._stop()

    def content(self) -> list[dict[str, Any]] | None:
        """The blocks, each tool_use with its input; None when an input is no JSON object."""
        out: list[dict[str, Any]] = []
        for index, block in enumerate(self.blocks):
            if block["type"] == "tool_use":
                try:
                    value = json.loads(self._inputs[index] or "{}")
                except ValueError:
                    return None
                if not isinstance(value, dict):
                    return None
                block = {**block, "input": value}
            out.append(block)
        return out


class Reply:
    """How one message answers from its job: its id and model, its input tokens (known at
    admission), what reads its tool calls (`reader` makes a fresh parser per answer, None:
    no tools) and what its stop reason needs (the stop sequences, the model's decode)."""

    def __init__(
        self,
        job_id: str,
        model: str,
        input_tokens: int,
        *,
        stops: Sequence[str] = (),
        decode: Decode | None = None,
        reader: Callable[[], Reader | None] | None = None,
    ) -> None:
        self.id = message_id(job_id)
        self.model = model
        self.input_tokens = input_tokens
        self.stops = tuple(stops)
        self.decode = decode
        self.reader = reader or (lambda: None)

    def content(self, text: str) -> list[dict[str, Any]]:
        """The answer's content blocks: its thinking, its text and the tool calls read from
        it. A call the parser found broken (malformed, cut off) leaves the whole text after
        the thinking as one text block, as the chat API answers it."""
        reader = self.reader()
        if reader is None:
            return [{"type": "text", "text": text}]
        blocks = Blocks()
        blocks.feed([*reader.feed(text), *reader.finish()])
        blocks.close()
        content = blocks.content()
        if reader.broken or content is None:
            said = "".join(reader.content) if isinstance(reader, ReasoningStream) else text
            thought = [b for b in blocks.blocks if b["type"] == "thinking"]
            return [*thought, {"type": "text", "text": said}]
        return content

    def stop(self, result: JobResult, content: list[dict[str, Any]]) -> tuple[str, str | None]:
        """The stop reason and the stop sequence that matched, if one did. A call cut off by
        max_tokens still ends for the length, as Anthropic answers it."""
        if result.finish_reason is FinishReason.LENGTH:
            return "max_tokens", None
        if any(block["type"] == "tool_use" for block in content):
            return "tool_use", None
        matched = None
        if self.decode is not None:
            matched = matched_stop(self.stops, result, self.decode)
        return ("stop_sequence", matched) if matched is not None else ("end_turn", None)

    def message(
        self,
        content: list[dict[str, Any]],
        stop_reason: str | None = None,
        stop_sequence: str | None = None,
        output_tokens: int = 0,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage(self.input_tokens, output_tokens),
        }

    def body(self, result: JobResult) -> dict[str, Any]:
        """The message of a succeeded job."""
        content = self.content(result.text)
        reason, sequence = self.stop(result, content)
        return self.message(content, reason, sequence, result.completion_tokens)


# -- the event stream ---------------------------------------------------------------------------


class MessageEvents:
    """A message's SSE events (a `Renderer`): message_start, a ping, its content blocks as
    they come (each content_block_start, its deltas, content_block_stop: text_delta for text,
    input_json_delta for a tool's input), then message_delta with the stop reason and usage,
    and message_stop; `error` for a failure.

    Text-only answers open their one text block at once, as Anthropic's streams do; with
    tools, a block opens when the parser knows what it is (text held back as maybe a call's
    start is sent once known)."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.reader = reply.reader()  # one answer, one fresh parser
        self.blocks = Blocks()

    def start(self) -> list[bytes]:
        frames = [_event("message_start", message=self.reply.message([]))]
        if self.reader is None:
            frames.extend(self.blocks.open_text())
        return [*frames, _event("ping")]

    def tokens(self, event_id: str, chunk: TokenChunk) -> list[bytes]:
        if self.reader is None:
            return self.blocks.feed([ContentDelta(chunk.text)])
        return self.blocks.feed(self.reader.feed(chunk.text))

    def finish(self, event_id: str, result: JobResult) -> list[bytes]:
        failed = result_error(result)
        if failed is not None:
            return [_event("error", error=failed[1]["error"])]
        frames = [] if self.reader is None else self.blocks.feed(self.reader.finish())
        frames.extend(self.blocks.close())
        reason, sequence = self.reply.stop(result, self.blocks.blocks)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        used = usage(self.reply.input_tokens, result.completion_tokens)
        frames.append(_event("message_delta", delta=delta, usage=used))
        frames.append(_event("message_stop"))
        return frames

    def ended(self) -> list[bytes]:
        return []  # a message stream is never resumed: its end is always seen

    def failure(self, message: str, code: str, status: int) -> list[bytes]:
        return [_event("error", error=anthropic_error(status, message)[1]["error"])]
