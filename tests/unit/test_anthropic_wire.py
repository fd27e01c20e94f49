"""Anthropic's Messages API on the wire (gateway/anthropic.py): the chat request a message runs
as, its stop reason, and its events; pure, no server."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tokenyard.engines.sim import SimTokenizer
from tokenyard.errors import InvalidRequest
from tokenyard.gateway.anthropic import (
    MessageEvents,
    MessageRequest,
    Reply,
    matched_stop,
    signature,
)
from tokenyard.gateway.errors import anthropic_error
from tokenyard.gateway.tools import ReasoningStream, tool_call_stream
from tokenyard.messages import FinishReason, JobResult, JobStatus, TokenChunk

TOK = SimTokenizer()
WEATHER = {
    "name": "weather",
    "description": "the weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def request(**fields: Any) -> MessageRequest:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return MessageRequest.model_validate({**body, **fields})


def test_a_history_with_tool_use_becomes_openai_tool_calls_and_tool_messages() -> None:
    chat, places = request(
        system=[{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
        messages=[
            {"role": "user", "content": "weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Looking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "weather",
                        "input": {"city": "P"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "thanks"},
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                ],
            },
        ],
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
        metadata={"user_id": "u1"},
        top_k=5,
        priority="low",
    ).chat_request()
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "P"}'},
                }
            ],
        },
        # the tool's result answers the call first, then the user's text
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "thanks"},
    ]
    assert chat.tools == [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "parameters": WEATHER["input_schema"],
                "description": "the weather in a city",
            },
        }
    ]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert (chat.stop, chat.user, chat.top_k, chat.priority) == (["END"], "u1", 5, "low")
    assert chat.max_tokens == 8
    # a refusal of the chat request names what the client wrote
    assert [places.name(f"messages.{i}") for i in range(5)] == [
        "system",
        "messages.0",
        "messages.1",
        "messages.2.content.1",
        "messages.2",
    ]
    assert places.name("messages.3.tool_call_id") == "messages.2.content.1.tool_use_id"
    assert places.name("messages.2.tool_calls.0.function.arguments") == (
        "messages.1.content.1.input"
    )
    assert places.name("messages.2.tool_calls.0.function.name") == "messages.1.content.1.name"
    assert places.name("messages.2.tool_calls.0") == "messages.1.content.1"
    assert places.name("tools.0.function.parameters") == "tools.0.input_schema"
    assert places.name("tools.1.function.name") == "tools.1.name"
    assert places.name("tools.0") == "tools.0"
    assert places.name("stop") == "stop_sequences"
    assert places.name("parallel_tool_calls") == "tool_choice.disable_parallel_tool_use"
    assert places.name("max_tokens") == "max_tokens"
    refused = places.renamed(
        InvalidRequest("'messages.3.tool_call_id' is bad", param="messages.3.tool_call_id")
    )
    assert (refused.param, refused.message) == (
        "messages.2.content.1.tool_use_id",
        "'messages.2.content.1.tool_use_id' is bad",
    )


@pytest.mark.parametrize(
    ("choice", "openai"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        (
            {"type": "tool", "name": "weather"},
            {"type": "function", "function": {"name": "weather"}},
        ),
    ],
)
def test_tool_choice(choice: dict[str, Any], openai: Any) -> None:
    chat, _ = request(tools=[WEATHER], tool_choice=choice).chat_request()
    assert chat.tool_choice == openai


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024, "x": 1}}, "thinking.x"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "thinking", "thinking": "t"}]},
                ]
            },
            "messages.0.content.0",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages.0.content.0"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "y": 1}]}]},
            "messages.0.content.0.y",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages.0.content.0.text",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}],
                    }
                ]
            },
            "messages.0.content.0",
        ),
        ({"system": [{"type": "tool_result", "tool_use_id": "a"}]}, "system.0"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
        ({"tools": [{**WEATHER, "name": "no spaces"}]}, "tools.0.name"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"}}, "tool_choice.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "auto", "x": 1}}, "tool_choice.x"),
        ({"metadata": {"user_id": "u", "plan": "pro"}}, "metadata.plan"),
        ({"output_config": {}}, "output_config"),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "{"}]},
            "messages.1",
        ),
    ],
)
def test_what_is_refused_is_named(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        request(**fields).chat_request()
    assert refused.value.param == param, refused.value.message


def result(text: str, reason: FinishReason = FinishReason.STOP, **fields: Any) -> JobResult:
    return JobResult(
        status=JobStatus.SUCCEEDED,
        finish_reason=reason,
        text=text,
        token_ids=fields.pop("token_ids", TOK.encode(text)),
        completion_tokens=fields.pop("completion_tokens", len(text)),
        **fields,
    )


def test_the_stop_sequence_that_matched_is_the_first_in_the_tokens() -> None:
    # the tokens hold the stop string the text leaves out, and what followed it in that token
    done = result("abc", token_ids=TOK.encode("abcXYZ!"), completion_tokens=7)
    assert matched_stop(["Z!", "XY", "X"], done, TOK.decode) == "X"
    assert matched_stop(["Q"], done, TOK.decode) is None
    assert matched_stop([], done, TOK.decode) is None
    assert matched_stop(["X"], result("abc", FinishReason.LENGTH), TOK.decode) is None
    reply = Reply("j1", "m", 3, stops=["XY"], decode=TOK.decode)
    assert reply.stop(done, reply.content(done.text)) == ("stop_sequence", "XY")
    assert reply.stop(result("abc"), []) == ("end_turn", None)
    assert reply.stop(result("abc", FinishReason.LENGTH), []) == ("max_tokens", None)
    assert reply.body(done) == {
        "id": "msg_j1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [{"type": "text", "text": "abc"}],
        "stop_reason": "stop_sequence",
        "stop_sequence": "XY",
        "usage": {"input_tokens": 3, "output_tokens": 7},
    }


def events(frames: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for f in frames:
        head, data = f.decode().strip().split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert head == f"event: {body['type']}"
        out.append(body)
    return out


SCRIPT = (
    "Let me look.\n<tool_call>\n"
    '{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>'
)


def hermes() -> Reply:
    return Reply("j", "m", 4, reader=lambda: tool_call_stream("hermes", make_id=ids()))


def ids() -> Callable[[], str]:
    made = iter(range(100))
    return lambda: f"toolu_{next(made)}"


def test_tool_calls_are_tool_use_blocks_whole_and_streamed() -> None:
    done = result(SCRIPT, completion_tokens=9)
    whole = hermes().body(done)
    assert whole["content"] == [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_0", "name": "weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_1", "name": "time", "input": {}},
    ]
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("tool_use", None)
    # cut off by max_tokens: the length ended it, whatever it holds
    assert hermes().body(result(SCRIPT, FinishReason.LENGTH))["stop_reason"] == "max_tokens"

    renderer = MessageEvents(hermes())
    frames = renderer.start()
    for ch in SCRIPT:  # a byte a token, as the sim engine writes
        frames += renderer.tokens("1-0", TokenChunk(token_ids=[5], text=ch))
    streamed = events([*frames, *renderer.finish("1-1", done)])
    kinds = [e["type"] for e in streamed]
    assert kinds[:2] == ["message_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in streamed if e["type"] == "content_block_start"]
    assert [e["content_block"] for e in starts] == [
        {"type": "text", "text": ""},
        {"type": "tool_use", "id": "toolu_0", "name": "weather", "input": {}},
        {"type": "tool_use", "id": "toolu_1", "name": "time", "input": {}},
    ]
    stops = [e["index"] for e in streamed if e["type"] == "content_block_stop"]
    assert stops == [0, 1, 2]
    deltas = [e for e in streamed if e["type"] == "content_block_delta"]
    text = "".join(e["delta"]["text"] for e in deltas if e["index"] == 0)
    assert text == "Let me look."
    partial = "".join(e["delta"]["partial_json"] for e in deltas if e["index"] == 1)
    assert json.loads(partial) == {"city": "Paris"}
    assert {e["delta"]["type"] for e in deltas if e["index"] > 0} == {"input_json_delta"}
    assert streamed[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert streamed[-2]["usage"] == {"input_tokens": 4, "output_tokens": 9}


def test_a_broken_call_is_text_and_no_text_is_an_empty_block() -> None:
    broken = '<tool_call>\n{"name": "weather", "arguments": {"city"</tool_call>'
    assert hermes().content(broken) == [{"type": "text", "text": broken}]
    assert hermes().content("") == [{"type": "text", "text": ""}]
    renderer = MessageEvents(hermes())
    quiet = events([*renderer.start(), *renderer.finish("1", result(""))])
    assert [e["type"] for e in quiet] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert quiet[-2]["delta"]["stop_reason"] == "end_turn"


def test_failures_are_anthropic_error_events() -> None:
    renderer = MessageEvents(Reply("j", "m", 1))
    failed = JobResult(status=JobStatus.EXPIRED, finish_reason=FinishReason.EXPIRED)
    [error] = events(renderer.finish("1-1", failed))
    assert error["error"]["type"] == "overloaded_error"
    [timeout] = events(renderer.failure("the request timed out", "timeout", 504))
    assert timeout == {
        "type": "error",
        "error": {"type": "timeout_error", "message": "the request timed out"},
    }


@pytest.mark.parametrize(
    ("status", "answered", "type_"),
    [
        (400, 400, "invalid_request_error"),
        (401, 401, "authentication_error"),
        (403, 403, "permission_error"),
        (404, 404, "not_found_error"),
        (405, 405, "invalid_request_error"),
        (409, 409, "invalid_request_error"),
        (413, 413, "request_too_large"),
        (429, 429, "rate_limit_error"),
        (500, 500, "api_error"),
        (503, 529, "overloaded_error"),
        (504, 504, "timeout_error"),
    ],
)
def test_anthropic_error_statuses(status: int, answered: int, type_: str) -> None:
    assert anthropic_error(status, "m") == (
        answered,
        {"type": "error", "error": {"type": type_, "message": "m"}},
    )


def thinker() -> Reply:
    calls = tool_call_stream("hermes", make_id=ids())
    return Reply("j", "m", 4, reader=lambda: ReasoningStream("qwen3", calls))


def test_reasoning_is_a_thinking_block_whole_and_streamed() -> None:
    text = "<think>Paris, so weather.</think>\n\n" + SCRIPT
    done = result(text, completion_tokens=9)
    whole = thinker().body(done)
    thought = "Paris, so weather."
    assert whole["content"][0] == {
        "type": "thinking",
        "thinking": thought,
        "signature": signature(thought),
    }
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert whole["content"][1] == {"type": "text", "text": "\n\nLet me look."}
    assert whole["stop_reason"] == "tool_use"

    renderer = MessageEvents(thinker())
    frames = renderer.start()
    for ch in text:
        frames += renderer.tokens("1-0", TokenChunk(token_ids=[5], text=ch))
    streamed = events([*frames, *renderer.finish("1-1", done)])
    starts = [e["content_block"] for e in streamed if e["type"] == "content_block_start"]
    assert starts[0] == {"type": "thinking", "thinking": ""}
    deltas = [e["delta"] for e in streamed if e["type"] == "content_block_delta"]
    thinking = [d for d in deltas if d["type"] == "thinking_delta"]
    assert "".join(d["thinking"] for d in thinking) == thought
    # the signature closes the thinking block, before its stop
    at = next(i for i, e in enumerate(streamed) if e.get("delta", {}).get("signature"))
    assert streamed[at]["delta"] == {"type": "signature_delta", "signature": signature(thought)}
    assert streamed[at + 1] == {"type": "content_block_stop", "index": 0}


def test_thinking_history_and_a_disabled_thinking_reach_the_chat_request() -> None:
    chat, _ = request(
        messages=[
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "greet back", "signature": "abc"},
                    {"type": "text", "text": "hello"},
                ],
            },
            {"role": "user", "content": "bye"},
        ],
        thinking={"type": "disabled"},
    ).chat_request()
    assert chat.messages[1].reasoning == "greet back"
    assert chat.template_messages()[1]["reasoning_content"] == "greet back"
    assert chat.reasoning_effort == "none"
    assert chat.template_kwargs() == {"reasoning_effort": "none", "enable_thinking": False}
    enabled, _ = request(thinking={"type": "enabled", "budget_tokens": 2048}).chat_request()
    assert enabled.reasoning_effort is None
