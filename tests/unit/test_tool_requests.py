"""A request's tools, tool_choice and tool history: checked, and read as templates and the
decoding constraint want them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenyard.errors import InvalidRequest
from tokenyard.gateway.tools import (
    CallStream,
    History,
    NamedCallStream,
    ToolCallStream,
    Tools,
    call_reader,
    call_reading,
    job_reader,
    parse_whole,
)
from tokenyard.gateway.tools import read_tools as read
from tokenyard.messages import CallReading, JobSpec, decode, encode

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}


def tool(name: str, parameters: Any = WEATHER, **extra: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters, **extra}}


def refused(param: str, *args: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        read(*args)
    assert info.value.param == param


def test_tools_are_checked_naming_the_bad_field() -> None:
    refused("tools.0.function.name", [tool("bad name")], None, None)
    refused("tools.1.function.name", [tool("a"), {"type": "function", "function": {}}], None, None)
    refused("tools.0.function.name", [tool("x" * 65)], None, None)
    refused("tools.0.type", [{"type": "code_interpreter"}], None, None)
    refused("tools.0.function.parameters", [tool("a", {"type": "string"})], None, None)
    refused("tools.0.function.parameters", [tool("a", [1])], None, None)
    refused("tools.0.function.strict", [tool("a", strict="yes")], None, None)
    refused("tools.1.function.name", [tool("a"), tool("a")], None, None)
    refused("tool_choice", [tool("a")], {"type": "function", "function": {"name": "b"}}, None)
    refused("tool_choice", [tool("a")], "sometimes", None)
    refused("tool_choice", None, "required", None)


def test_choices() -> None:
    assert read([tool("a")], None, None).choice == "auto"
    assert not read([tool("a")], "none", None).parses
    assert not read(None, None, None).parses
    named = read([tool("a"), tool("b")], {"type": "function", "function": {"name": "b"}}, None)
    assert (named.choice, named.named) == ("named", "b")
    assert read([tool("a")], "required", False).parallel is False


def test_a_named_choice_constrains_to_the_functions_arguments() -> None:
    tools = read([tool("a"), tool("b", {})], {"type": "function", "function": {"name": "a"}}, None)
    guide = tools.guide()
    assert guide is not None and guide.json is not None
    assert json.loads(guide.json) == WEATHER
    empty = read([tool("b", None)], {"type": "function", "function": {"name": "b"}}, None)
    assert empty.guide() is not None
    assert json.loads(empty.guide().json or "") == {"type": "object", "properties": {}}  # type: ignore[union-attr]


def test_required_constrains_to_an_array_of_calls_as_vllm_builds_it() -> None:
    guide = read([tool("a"), tool("b", {})], "required", None).guide()
    assert guide is not None and guide.json is not None
    schema = json.loads(guide.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    branches = schema["items"]["anyOf"]
    assert [b["properties"]["name"]["enum"] for b in branches] == [["a"], ["b"]]
    assert branches[0]["properties"]["parameters"] == WEATHER
    one = read([tool("a")], "required", False).guide()
    assert one is not None and json.loads(one.json or "")["maxItems"] == 1
    assert read([tool("a")], "auto", None).guide() is None


def test_templates_get_openai_shaped_tools() -> None:
    tools = read([tool("a", description="Look up")], None, None)
    assert tools.template() == [
        {
            "type": "function",
            "function": {"name": "a", "parameters": WEATHER, "description": "Look up"},
        }
    ]
    assert read(None, None, None).template() is None


def test_history_parses_arguments_and_matches_results_to_calls() -> None:
    history = History()
    calls = history.assistant_calls(
        [{"id": "c1", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}}],
        "messages.1.tool_calls",
    )
    function = {"name": "a", "arguments": {"x": 1}}
    assert calls == [{"id": "c1", "type": "function", "function": function}]
    assert history.result("c1", "messages.2.tool_call_id") == "a"
    with pytest.raises(InvalidRequest) as info:
        history.result("c2", "messages.3.tool_call_id")
    assert info.value.param == "messages.3.tool_call_id"
    with pytest.raises(InvalidRequest) as info:
        history.assistant_calls(
            [{"id": "c3", "function": {"name": "a", "arguments": "{oops"}}], "messages.4.tool_calls"
        )
    assert info.value.param == "messages.4.tool_calls.0.function.arguments"


def answer_reader(tools: Tools, setting: str, template: str) -> CallStream | None:
    """The reader a request's answer gets: the reading decided once, then its stream."""
    reading = call_reading(tools, setting, template)
    return None if reading is None else call_reader(reading)


def test_the_reader_follows_the_choice_and_the_template() -> None:
    hermes = "... <tool_call> ..."
    assert answer_reader(read([tool("a")], "none", None), "auto", hermes) is None
    assert isinstance(answer_reader(read([tool("a")], None, None), "auto", hermes), ToolCallStream)
    single = answer_reader(read([tool("a")], None, False), "auto", hermes)
    assert isinstance(single, ToolCallStream) and single.max_calls == 1
    named = read([tool("a")], {"type": "function", "function": {"name": "a"}}, None)
    assert isinstance(answer_reader(named, "auto", ""), NamedCallStream)
    required = answer_reader(read([tool("a")], "required", None), "auto", "")
    assert isinstance(required, ToolCallStream) and required.parser == "required"
    with pytest.raises(InvalidRequest, match="--tool-call-parser") as info:
        answer_reader(read([tool("a")], None, None), "auto", "{{ messages }}")
    assert info.value.param == "tool_choice"


def test_a_job_keeps_how_its_answer_is_read() -> None:
    hermes = "... <tool_call> ..."
    assert call_reading(read([tool("a")], "none", None), "auto", hermes) is None
    assert call_reading(read([tool("a")], None, False), "auto", hermes) == CallReading(
        parser="hermes", parallel=False
    )
    named = read([tool("a")], {"type": "function", "function": {"name": "a"}}, None)
    assert call_reading(named, "mistral", "") == CallReading(parser="named", function="a")
    assert call_reading(read([tool("a")], "required", None), "auto", "").parser == "required"
    # the reading crosses the wire with the job; a job recorded without it reads as content
    spec = JobSpec(id="j1", model="m", calls=CallReading(parser="hermes", parallel=False))
    assert decode(encode(spec), JobSpec).calls == spec.calls
    assert decode(encode(JobSpec(id="j1", model="m")), JobSpec).calls is None
    assert job_reader(JobSpec(id="j1", model="m")) is None
    # every reading of one job names its calls alike; another job's differ
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call>' * 2
    single = job_reader(spec)
    assert isinstance(single, ToolCallStream) and single.max_calls == 1

    def ids(job: JobSpec, followed: str | None = None) -> list[str]:
        reader = job_reader(job, followed)
        assert reader is not None
        return [c.id for c in parse_whole(reader, text).calls]

    many = JobSpec(id="j1", model="m", calls=CallReading(parser="hermes"))
    assert ids(many) == ids(many) and len(set(ids(many))) == 2
    assert ids(many, "j2") != ids(many) and ids(many, "j1") == ids(many)
