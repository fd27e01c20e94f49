"""Anthropic's Messages API on the wire (gateway/anthropic.py): the chat request a message runs
as, its stop reason, and its events; pure, no server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenyard.engines.sim import SimTokenizer
from tokenyard.errors import InvalidRequest
from tokenyard.gateway.anthropic import MessageEvents, MessageRequest, Reply, matched_stop
from tokenyard.gateway.errors import anthropic_error
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
    chat = request(
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
    chat = request(tools=[WEATHER], tool_choice=choice).chat_request()
    assert chat.tool_choice == openai
    assert request(tools=[WEATHER], tool_choice=choice).offers_tools == (choice["type"] != "none")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
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


class ToolReply(Reply):
    """A reply whose output parses as one tool call (what the tools parser gives)."""

    def content(self, text: str) -> list[dict[str, Any]]:
        return [
            {"type": "text", "text": "Sure."},
            {"type": "tool_use", "id": "toolu_x", "name": "weather", "input": {"city": "P"}},
        ]


def test_held_events_send_whole_blocks_at_the_end() -> None:
    renderer = MessageEvents(ToolReply("j", "m", 4), hold=True)
    start = events(renderer.start())
    assert [e["type"] for e in start] == ["message_start", "ping"]
    assert renderer.tokens("1-0", TokenChunk(token_ids=[5], text="x")) == []
    end = events(renderer.finish("1-1", result("x", completion_tokens=9)))
    assert [e["type"] for e in end] == [
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert end[1]["delta"] == {"type": "text_delta", "text": "Sure."}
    assert end[3]["content_block"] == {
        "type": "tool_use",
        "id": "toolu_x",
        "name": "weather",
        "input": {},
    }
    assert end[4] == {
        "type": "content_block_delta",
        "index": 1,
        "delta": {"type": "input_json_delta", "partial_json": '{"city": "P"}'},
    }
    assert end[6]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert end[6]["usage"] == {"input_tokens": 4, "output_tokens": 9}


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
