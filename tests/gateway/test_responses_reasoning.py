"""The Responses API with a reasoning parser (the gateway's qwen3), with the official openai
client against a real gateway and a scripted sim worker that writes `<think>…</think>` and an
answer: the reasoning is a `reasoning` item before the message (and calls), sync, streamed as
`response.reasoning_text.delta` events, stored, resumed, and handed back as input."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.responses import ResponseReasoningItem, ResponseStreamEvent

from tests.gateway.conftest import MODEL, Stack, run_stack
from tests.gateway.sse import events as sse_events
from tests.gateway.test_tools import FLAT_TOOLS, ScriptedEngine
from tokenyard.broker.redis.embedded import EmbeddedServer

THOUGHT = "The user asks about Paris; a look at the weather helps."
SAID = "Let me look."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCRIPT = f"<think>{THOUGHT}</think>{SAID}\n{CALL}"
ASK = "Weather in Paris?"


@pytest.fixture(scope="module")
def stack(valkey: EmbeddedServer) -> Iterator[Stack]:
    engine = ScriptedEngine(SCRIPT)
    with run_stack(
        valkey, engines=[lambda: engine], cache=False, collapse=False, reasoning_parser="qwen3"
    ) as s:
        yield s


def client_of(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def _reasoning(item: Any) -> str:
    assert isinstance(item, ResponseReasoningItem), item
    assert item.summary == [] and item.content is not None
    return "".join(part.text for part in item.content)


def _shape(output: list[Any]) -> list[dict[str, Any]]:
    """Output items without their ids (each response names its own items and calls)."""
    own = ("id", "call_id")
    return [{k: v for k, v in item.model_dump().items() if k not in own} for item in output]


def test_the_reasoning_is_an_item_before_the_message(stack: Stack) -> None:
    client = client_of(stack)
    whole = client.responses.create(model=MODEL, input=ASK)
    assert whole.status == "completed"
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert _reasoning(whole.output[0]) == THOUGHT
    assert whole.output[0].status == "completed"
    # without tools the rest is the message, the call's text included
    assert whole.output_text == f"{SAID}\n{CALL}"
    assert whole.output[0].id != whole.output[1].id
    # read back: the same items
    again = client.responses.retrieve(whole.id)
    assert [i.model_dump() for i in again.output] == [i.model_dump() for i in whole.output]

    # streamed: the reasoning's events first, then the message's; the completed response's
    # output is the sync one's
    stream = list(client.responses.create(model=MODEL, input=ASK, stream=True))
    assert [e.sequence_number for e in stream] == list(range(len(stream)))
    kinds = [e.type for e in stream]
    first_text = kinds.index("response.output_text.delta")
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
    ]
    reasoning_done = kinds.index("response.reasoning_text.done")
    assert kinds[reasoning_done : reasoning_done + 5] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert reasoning_done < first_text
    assert _joined(stream, "response.reasoning_text.delta") == THOUGHT
    assert _joined(stream, "response.output_text.delta") == f"{SAID}\n{CALL}"
    added = [e for e in stream if e.type == "response.output_item.added"]
    assert [(e.output_index, e.item.type) for e in added] == [(0, "reasoning"), (1, "message")]
    part = next(e for e in stream if e.type == "response.content_part.added")
    assert part.part.type == "reasoning_text" and part.output_index == 0
    done = next(e for e in stream if e.type == "response.reasoning_text.done")
    assert done.text == THOUGHT and done.item_id == added[0].item.id
    final = stream[-1]
    assert final.type == "response.completed"
    assert _shape(final.response.output) == _shape(whole.output)


def _joined(stream: list[ResponseStreamEvent], kind: str) -> str:
    return "".join(getattr(e, "delta", "") for e in stream if e.type == kind)


def test_a_streamed_response_resumes_inside_its_reasoning(stack: Stack) -> None:
    client = client_of(stack)
    stream = list(client.responses.create(model=MODEL, input=ASK, stream=True, background=True))
    response_id = stream[0].response.id  # type: ignore[union-attr]
    deltas = [e for e in stream if e.type == "response.reasoning_text.delta"]
    cut = deltas[len(deltas) // 2].sequence_number
    with (
        stack.client() as http,
        http.stream(
            "GET", f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": cut}
        ) as got,
    ):
        tail = [json.loads(e.data) for e in sse_events(got)]
    assert [e["sequence_number"] for e in tail] == list(range(cut + 1, len(stream)))
    assert [e["type"] for e in tail] == [e.type for e in stream[cut + 1 :]]
    said = "".join(e["delta"] for e in tail if e["type"] == "response.reasoning_text.delta")
    assert THOUGHT.endswith(said) and said


def test_reasoning_comes_before_the_calls(stack: Stack) -> None:
    client = client_of(stack)
    whole = client.responses.create(model=MODEL, input=ASK, tools=FLAT_TOOLS)
    assert [item.type for item in whole.output] == ["reasoning", "message", "function_call"]
    assert _reasoning(whole.output[0]) == THOUGHT and whole.output_text == SAID
    call = whole.output[2]
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    stream = list(client.responses.create(model=MODEL, input=ASK, tools=FLAT_TOOLS, stream=True))
    final = stream[-1]
    assert final.type == "response.completed"
    assert _shape(final.response.output) == _shape(whole.output)
    # the call's id is the response's own: its output answers it in the next response, and
    # the reasoning goes with the conversation (a previous_response_id, or the items handed
    # back as input, as the openai-agents SDK hands them)
    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": "18C"}]
    chained = client.responses.create(
        model=MODEL, previous_response_id=whole.id, input=answer, tools=FLAT_TOOLS
    )
    assert chained.status == "completed"
    items: list[Any] = [
        {"role": "user", "content": ASK},
        *(item.model_dump(exclude_none=True) for item in whole.output),
        *answer,
    ]
    handed = client.responses.create(model=MODEL, input=items, tools=FLAT_TOOLS)
    assert handed.status == "completed"
    assert [item.type for item in handed.output] == ["reasoning", "message", "function_call"]


def test_reasoning_effort_reaches_the_template(stack: Stack) -> None:
    """`reasoning.effort` is chat's `reasoning_effort`: `none` turns thinking off in the
    template (the sim's closes the reasoning in the prompt, as Qwen3's does), so the answer
    is read as content only; a summary is refused by name."""
    client = client_of(stack)
    off = client.responses.create(model=MODEL, input=ASK, reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["message"]
    assert off.output_text == SCRIPT
    on = client.responses.create(model=MODEL, input=ASK, reasoning={"effort": "low"})
    assert [item.type for item in on.output] == ["reasoning", "message"]
    for reasoning, param in (
        ({"summary": "auto"}, "reasoning.summary"),
        ({"effort": "huge"}, "reasoning.effort"),
        ({"budget": 3}, "reasoning.budget"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, input=ASK, reasoning=reasoning)  # type: ignore[arg-type]
        assert refused.value.body["param"] == param  # type: ignore[index]
    bad = {"type": "reasoning", "summary": [], "encrypted_content": "x"}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input=[bad])  # type: ignore[list-item]
    assert refused.value.body["param"] == "input.0.encrypted_content"  # type: ignore[index]
