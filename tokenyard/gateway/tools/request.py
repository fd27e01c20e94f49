"""The request side of tool calling: a request's `tools`, `tool_choice` and
`parallel_tool_calls` checked and read, the decoding constraint `tool_choice` asks for, and a
conversation's tool calls and tool results as Hugging Face chat templates take them.

Every refusal is 400 naming the parameter, as OpenAI answers. Inputs are the request's JSON
values (dicts and lists), so any API (chat completions, responses, Anthropic's messages) can
hand over its own after mapping its names onto OpenAI's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tokenyard.errors import InvalidRequest
from tokenyard.gateway.tools.parsers import (
    CallStream,
    ToolCallStream,
    ToolParserError,
    choose_parser,
    new_call_id,
    stable_call_ids,
    tool_call_stream,
)
from tokenyard.gateway.tools.reasoning import Reader, reasoning_reader
from tokenyard.messages import CallReading, Guide, JobSpec

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name
MAX_TOOLS = 128  # OpenAI's bound on one request's tools

Choice = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class Function:
    """One function tool; `parameters` is its arguments' JSON schema."""

    name: str
    parameters: Mapping[str, Any]
    description: str | None = None
    strict: bool | None = None

    def template(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI's own shape, as transformers expects)."""
        function: dict[str, Any] = {"name": self.name, "parameters": dict(self.parameters)}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class Tools:
    """A request's tools and what it asks of them.

    `choice` `none`: as vLLM by default (`exclude_tools_when_tool_choice_none` off), the tools
    are still shown to the model, but its answer is not read for calls. `auto`: the answer is
    read for calls in the model's own format. `required` and `named`: decoding is constrained
    (`guide`) and the answer is read in the shape the constraint gives.
    """

    functions: tuple[Function, ...]
    choice: Choice
    named: str | None = None  # the function `tool_choice` names
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """Whether the answer is read for calls."""
        return bool(self.functions) and self.choice != "none"

    def template(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template, None when there are none."""
        return [f.template() for f in self.functions] or None

    def guide(self) -> Guide | None:
        """The decoding constraint of `required` and named choices, as vLLM builds it."""
        if self.choice == "named":
            function = next(f for f in self.functions if f.name == self.named)
            return Guide(json=_dumps(_arguments_schema(function)))
        if self.choice != "required":
            return None
        items = [
            {
                "properties": {
                    "name": {"type": "string", "enum": [f.name]},
                    "parameters": _arguments_schema(f),
                },
                "required": ["name", "parameters"],
            }
            for f in self.functions
        ]
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "anyOf": items},
        }
        if not self.parallel:
            schema["maxItems"] = 1
        return Guide(json=_dumps(schema))


def _arguments_schema(function: Function) -> dict[str, Any]:
    # an empty schema would let the arguments be any JSON: calls take an object
    return dict(function.parameters) or {"type": "object", "properties": {}}


def _dumps(value: Any) -> str:
    # keys in the request's order: the order the model writes the properties in, as vLLM
    return json.dumps(value, separators=(",", ":"))


def read_tools(
    tools: Sequence[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    *,
    tools_param: str = "tools",
    choice_param: str = "tool_choice",
) -> Tools:
    """A request's tool fields, checked: 400 naming the first bad one."""
    functions = tuple(
        _read_function(tool, f"{tools_param}.{i}") for i, tool in enumerate(tools or ())
    )
    if len(functions) > MAX_TOOLS:
        raise InvalidRequest(
            f"'{tools_param}' has {len(functions)} tools; at most {MAX_TOOLS} are allowed",
            param=tools_param,
        )
    names = [f.name for f in functions]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidRequest(
                f"Tool names must be unique; {name!r} is given twice",
                param=f"{tools_param}.{i}.function.name",
            )
    choice, named = _read_choice(tool_choice, choice_param)
    if not functions and choice in ("required", "named"):
        raise InvalidRequest(
            f"'{choice_param}' is only allowed when '{tools_param}' are given", param=choice_param
        )
    if named is not None and named not in names:
        raise InvalidRequest(
            f"'{choice_param}' names the function {named!r}, which is not in '{tools_param}'",
            param=choice_param,
        )
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequest("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    return Tools(
        functions,
        choice,
        named,
        parallel=True if parallel_tool_calls is None else parallel_tool_calls,
    )


def _read_function(tool: Any, param: str) -> Function:
    if not isinstance(tool, dict):
        raise InvalidRequest(f"'{param}' must be an object", param=param)
    if tool.get("type") != "function":
        raise InvalidRequest(
            f"'{param}.type' must be 'function' (the only tool type served)",
            param=f"{param}.type",
        )
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidRequest(f"'{param}.function' must be an object", param=f"{param}.function")
    return read_function(function, f"{param}.function")


def read_function(function: Mapping[str, Any], param: str) -> Function:
    """A function's definition (`name`, `description`, `parameters`, `strict`), checked."""
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequest(
            f"'{param}.name' must be 1 to 64 letters, digits, underscores or dashes",
            param=f"{param}.name",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest(
            f"'{param}.description' must be a string", param=f"{param}.description"
        )
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, dict) or not _is_object_schema(parameters):
        raise InvalidRequest(
            f"'{param}.parameters' must be a JSON schema of an object", param=f"{param}.parameters"
        )
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest(f"'{param}.strict' must be a boolean", param=f"{param}.strict")
    extra = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if extra:
        raise InvalidRequest(
            f"Unrecognized argument supplied: {param}.{extra[0]}",
            param=f"{param}.{extra[0]}",
            code="unknown_parameter",
        )
    return Function(name, parameters, description, strict)


def _is_object_schema(schema: Mapping[str, Any]) -> bool:
    # a schema's own validity is xgrammar's to judge when it compiles one; here only what
    # any reading needs: arguments are a JSON object, so a schema naming another type fails
    kind = schema.get("type", "object")
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


def _read_choice(value: Any, param: str) -> tuple[Choice, str | None]:
    if value is None or value == "auto":
        return "auto", None
    if value in ("none", "required"):
        return value, None
    if isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if isinstance(name, str):
            return "named", name
    raise InvalidRequest(
        f"'{param}' must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        param=param,
    )


# -- history: the assistant's calls and the tools' results --------------------------------------
@dataclass
class History:
    """Reads a conversation's tool calls and results in order: a result must answer a call
    made earlier in it (`tool_call_id`), as OpenAI checks."""

    calls: dict[str, str]  # call id → function name

    def __init__(self) -> None:
        self.calls = {}

    def assistant_calls(self, tool_calls: Sequence[Any], param: str) -> list[dict[str, Any]]:
        """An assistant message's `tool_calls`, as templates take them: `function.arguments`
        parsed to a dict (transformers' templates render it with `tojson`)."""
        out = []
        for j, call in enumerate(tool_calls):
            where = f"{param}.{j}"
            if not isinstance(call, dict):
                raise InvalidRequest(f"'{where}' must be an object", param=where)
            call_id = call.get("id")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequest(
                    f"'{where}.id' must be a non-empty string", param=f"{where}.id"
                )
            if call.get("type", "function") != "function":
                raise InvalidRequest(f"'{where}.type' must be 'function'", param=f"{where}.type")
            function = call.get("function")
            if not isinstance(function, dict):
                raise InvalidRequest(
                    f"'{where}.function' must be an object", param=f"{where}.function"
                )
            name = function.get("name")
            if not isinstance(name, str) or not name:
                raise InvalidRequest(
                    f"'{where}.function.name' must be a non-empty string",
                    param=f"{where}.function.name",
                )
            arguments = parse_arguments(function.get("arguments"), f"{where}.function.arguments")
            self.calls[call_id] = name
            out.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
        return out

    def result(self, tool_call_id: Any, param: str) -> str:
        """The name of the function a `tool` message answers; its id must be an earlier call's."""
        if not isinstance(tool_call_id, str) or not tool_call_id:
            raise InvalidRequest(
                "a 'tool' message must carry the 'tool_call_id' of the call it answers",
                param=param,
            )
        name = self.calls.get(tool_call_id)
        if name is None:
            raise InvalidRequest(
                f"tool_call_id {tool_call_id!r} answers no tool call made earlier in the "
                "conversation (an assistant message's 'tool_calls')",
                param=param,
            )
        return name


def parse_arguments(arguments: Any, param: str) -> dict[str, Any]:
    """A call's `arguments` (JSON text of an object, or the object) as a dict."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise InvalidRequest(f"'{param}' is not valid JSON", param=param) from None
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"'{param}' must be a JSON object", param=param)
    return arguments


def call_reading(tools: Tools, parser_setting: str, chat_template: str) -> CallReading | None:
    """How the answer of a request with these tools is read (the one decision; a job keeps
    it in `JobSpec.calls`): None when it is not read for calls (no tools, or `tool_choice`
    none).

    `auto` needs the model's format: `parser_setting` (the gateway's `tool_call_parser`), or
    with `auto` the one `chat_template` shows; a template that shows none is 400 saying
    which setting to pass.
    """
    if not tools.parses:
        return None
    if tools.choice == "named":
        return CallReading(parser="named", function=tools.named)
    if tools.choice == "required":
        return CallReading(parser="required", parallel=tools.parallel)
    try:
        parser = choose_parser(parser_setting, chat_template)
    except ToolParserError as exc:
        raise InvalidRequest(str(exc), param="tool_choice", code="tool_parser_unknown") from exc
    return CallReading(parser=parser, parallel=tools.parallel)


def call_reader(reading: CallReading, make_id: Callable[[], str] = new_call_id) -> CallStream:
    """A fresh stream reading one answer as `reading` says (use it once)."""
    if reading.parser == "named":
        assert reading.function is not None
        return tool_call_stream("", named=reading.function, make_id=make_id)
    stream = tool_call_stream(reading.parser, make_id=make_id)
    if not reading.parallel and isinstance(stream, ToolCallStream):
        stream.max_calls = 1  # (`required`'s schema already allows one call only)
    return stream


def job_reader(spec: JobSpec, job_id: str | None = None) -> Reader | None:
    """What reads a job's answer for its reasoning, then tool calls (None: all content). Its
    calls are named from the job's id (`job_id`: the job followed, when a call joined
    another's), so every reading of one answer (the live call, the jobs API's stream and a
    resume of it, a batch's output) gives the same ids."""
    calls = None
    if spec.calls is not None:
        calls = call_reader(spec.calls, stable_call_ids(job_id or spec.id))
    if spec.reasoning is None:
        return calls
    return reasoning_reader(spec.reasoning, calls)
