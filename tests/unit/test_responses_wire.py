"""The Responses API's wire shapes parse with the official openai types, for every ending."""

from __future__ import annotations

import json

import msgspec
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tokenyard.gateway.responses_api.wire import ResponseEvents, response_body, response_reader
from tokenyard.gateway.tools import stable_call_ids
from tokenyard.messages import (
    CallReading,
    FinishReason,
    JobResult,
    JobStatus,
    ReasoningReading,
    StoredResponse,
    TokenChunk,
    Turn,
    decode,
    encode,
)

EVENTS: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)
STORED = StoredResponse(
    id="resp_j", job_id="j", tenant="t", model="m", created_at=1.0, context=[Turn("user", "hi")]
)


def _parse(frames: list[bytes]) -> list[ResponseStreamEvent]:
    out = []
    for raw in frames:
        event, data = raw.decode().strip().split("\n")
        parsed = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
        assert event == f"event: {parsed.type}"
        out.append(parsed)
    return out


def _run(result: JobResult, starting_after: int = -1) -> list[ResponseStreamEvent]:
    events = ResponseEvents(STORED, starting_after)
    frames = events.start()
    for text in ("a", "", "b"):  # "": an incomplete UTF-8 character takes no number
        frames += events.tokens("1-0", TokenChunk(token_ids=[1], text=text))
    return _parse(frames + events.finish("2-0", result))


@pytest.mark.parametrize(
    ("result", "status", "last"),
    [
        (JobResult(status=JobStatus.SUCCEEDED, finish_reason=FinishReason.STOP, text="ab"),
         "completed", "response.completed"),
        (JobResult(status=JobStatus.SUCCEEDED, finish_reason=FinishReason.LENGTH, text="ab"),
         "incomplete", "response.incomplete"),
        (JobResult(status=JobStatus.DEAD, error="boom"), "failed", "response.failed"),
        (JobResult(status=JobStatus.FAILED, error="bad"), "failed", "response.failed"),
        (JobResult(status=JobStatus.CANCELLED), "cancelled", "response.failed"),
    ],
)  # fmt: skip
def test_every_ending_parses(result: JobResult, status: str, last: str) -> None:
    events = _run(result)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == last
    body = Response.model_validate(response_body(STORED, result))
    assert body.status == status
    if result.status is JobStatus.SUCCEEDED:
        assert body.output_text == "ab" and len(events) == 10
    else:
        assert body.output == [] and len(events) == 7


def test_starting_after_drops_exactly_the_events_up_to_it() -> None:
    result = JobResult(status=JobStatus.SUCCEEDED, finish_reason=FinishReason.STOP, text="ab")
    whole = _run(result)
    for n in range(-1, len(whole) + 1):
        assert _run(result, n) == whole[n + 1 :]


def test_queued_and_running_bodies() -> None:
    assert Response.model_validate(response_body(STORED, None)).status == "queued"
    running = response_body(STORED, None, JobStatus.RUNNING)
    assert Response.model_validate(running).status == "in_progress"


def test_function_call_events_parse_with_the_openai_types() -> None:
    from tokenyard.gateway.responses_api.wire import ToolResponseEvents
    from tokenyard.gateway.tools import stable_call_ids, tool_call_stream

    stored = StoredResponse(
        id="resp_j",
        job_id="j",
        tenant="t",
        model="m",
        created_at=1.0,
        context=[Turn("user", "hi")],
        tools=json.dumps(
            {
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                "tool_choice": "auto",
                "parallel_tool_calls": None,
            }
        ),
    )
    events = ToolResponseEvents(stored, tool_call_stream("hermes", make_id=stable_call_ids("j")))
    frames = events.start()
    text = 'Sure. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    for piece in (text[:9], text[9:30], text[30:]):
        frames += events.tokens("1-0", TokenChunk(token_ids=[1], text=piece))
    result = JobResult(status=JobStatus.SUCCEEDED, finish_reason=FinishReason.STOP, text=text)
    parsed = _parse(frames + events.finish("2-0", result))
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    final = parsed[-1]
    assert final.type == "response.completed"
    assert [i.type for i in final.response.output] == ["message", "function_call"]
    call = final.response.output[1]
    assert call.type == "function_call" and call.arguments == '{"a": 1}'
    assert call.call_id == stable_call_ids("j")()
    assert final.response.tools[0].name == "f"  # type: ignore[union-attr]


# -- reading a stored response's output for function calls ---------------------------------------
HERMES_TEMPLATE = "<tool_call>{name, arguments}</tool_call>"  # a template that shows Hermes'
CALLED = 'Sure. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'


def _with_tools(tool_choice: object = "auto", calls: CallReading | None = None) -> StoredResponse:
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    fields = {"tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": None}
    return msgspec.structs.replace(STORED, tools=json.dumps(fields), calls=calls)


def _read(stored: StoredResponse, setting: str, template: str) -> list[dict[str, object]]:
    result = JobResult(status=JobStatus.SUCCEEDED, finish_reason=FinishReason.STOP, text=CALLED)
    reader = response_reader(stored, setting, template)
    body = response_body(stored, result, reader=reader)
    Response.model_validate(body)
    return list(body["output"])


def test_a_kept_reading_reads_alike_whatever_the_setting_now() -> None:
    stored = _with_tools(calls=CallReading(parser="hermes"))
    read = _read(stored, "auto", HERMES_TEMPLATE)
    assert [i["type"] for i in read] == ["message", "function_call"]
    assert read[1]["call_id"] == stable_call_ids("j")()  # from the job id: the same each time
    # the parser setting changed, or the template shows no format any more: read alike
    for setting, template in (("llama3_json", HERMES_TEMPLATE), ("mistral", ""), ("auto", "")):
        assert _read(stored, setting, template) == read
    # tool_choice none, or no tools: kept as no reading, and all text whatever the setting
    for plain in (_with_tools("none"), STORED):
        assert [i["type"] for i in _read(plain, "hermes", HERMES_TEMPLATE)] == ["message"]


def test_a_response_stored_before_readings_were_kept_is_decided_from_its_tools() -> None:
    old = _with_tools()  # no reading kept: decided with the setting and template now
    assert [i["type"] for i in _read(old, "auto", HERMES_TEMPLATE)] == ["message", "function_call"]
    assert [i["type"] for i in _read(old, "hermes", "")] == ["message", "function_call"]
    assert _read(old, "auto", "{{ messages }}")[0]["content"][0]["text"] == CALLED  # type: ignore[index]


def test_a_stored_response_written_before_the_reading_was_kept_decodes() -> None:
    stored = _with_tools(calls=CallReading(parser="required", parallel=False))
    assert decode(encode(stored), StoredResponse) == stored
    fields = msgspec.to_builtins(stored)
    del fields["calls"]  # as a gateway before this field wrote it
    old = decode(msgspec.msgpack.encode(fields), StoredResponse)
    assert old == msgspec.structs.replace(stored, calls=None)


# -- reasoning -----------------------------------------------------------------------------------
THOUGHT_TEXT = "<think>It is warm.</think>Sunny."


def test_reasoning_events_parse_with_the_openai_types_however_the_text_splits() -> None:
    """The reasoning item and its `response.reasoning_text.*` events validate as the openai
    client's types, and a stream split anywhere (mid-tag too) ends with the sync output."""
    from tokenyard.gateway.responses_api.wire import ToolResponseEvents

    stored = msgspec.structs.replace(STORED, reasoning=ReasoningReading(parser="deepseek_r1"))
    result = JobResult(
        status=JobStatus.SUCCEEDED, finish_reason=FinishReason.STOP, text=THOUGHT_TEXT
    )
    whole = response_body(stored, result, reader=response_reader(stored, "", ""))
    Response.model_validate(whole)
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": "It is warm."}]
    assert whole["output"][1]["content"][0]["text"] == "Sunny."
    for cut in range(1, len(THOUGHT_TEXT)):
        reader = response_reader(stored, "", "")
        assert reader is not None
        events = ToolResponseEvents(stored, reader)
        frames = events.start()
        for piece in (THOUGHT_TEXT[:cut], THOUGHT_TEXT[cut:]):
            frames += events.tokens("1-0", TokenChunk(token_ids=[1], text=piece))
        parsed = _parse(frames + events.finish("2-0", result))
        assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
        final = parsed[-1]
        assert final.type == "response.completed"
        assert final.response.model_dump() == Response.model_validate(whole).model_dump()
        said = "".join(e.delta for e in parsed if e.type == "response.reasoning_text.delta")
        assert said == "It is warm.", cut


def test_an_answer_cut_off_while_thinking_is_its_reasoning_alone() -> None:
    """deepseek_r1: no `</think>`, all reasoning: the one item, with the response's status
    (incomplete), and no empty message after it (as vLLM answers), streamed alike."""
    from tokenyard.gateway.responses_api.wire import ToolResponseEvents

    stored = msgspec.structs.replace(STORED, reasoning=ReasoningReading(parser="deepseek_r1"))
    result = JobResult(
        status=JobStatus.SUCCEEDED, finish_reason=FinishReason.LENGTH, text="still thinking"
    )
    whole = response_body(stored, result, reader=response_reader(stored, "", ""))
    assert [(i["type"], i["status"]) for i in whole["output"]] == [("reasoning", "incomplete")]
    reader = response_reader(stored, "", "")
    assert reader is not None
    events = ToolResponseEvents(stored, reader)
    frames = events.start() + events.tokens("1-0", TokenChunk(token_ids=[1], text=result.text))
    final = _parse(frames + events.finish("2-0", result))[-1]
    assert final.type == "response.incomplete"
    assert final.response.model_dump() == Response.model_validate(whole).model_dump()


def test_reasoning_turns_join_the_assistant_message_they_open() -> None:
    from tokenyard.gateway.responses_api.wire import REASONING, call_turn, chat_messages

    context = [
        Turn("user", "hi"),
        Turn(REASONING, "think a"),
        Turn("assistant", "said a"),
        Turn("user", "and?"),
        Turn(REASONING, "think b"),
        call_turn("c1", "f", "{}"),
        Turn("function_call_output", json.dumps({"call_id": "c1", "output": "ok"})),
        Turn(REASONING, "only thought"),
    ]
    messages = chat_messages(context)
    assert messages[1] == {"role": "assistant", "content": "said a", "reasoning": "think a"}
    assert messages[3]["reasoning"] == "think b" and messages[3]["content"] == ""
    assert messages[3]["tool_calls"][0]["id"] == "c1"
    assert messages[4]["role"] == "tool"
    assert messages[5] == {"role": "assistant", "content": "", "reasoning": "only thought"}


def test_a_stored_response_written_before_reasoning_was_kept_decodes() -> None:
    stored = msgspec.structs.replace(STORED, reasoning=ReasoningReading(parser="qwen3"))
    assert decode(encode(stored), StoredResponse) == stored
    fields = msgspec.to_builtins(stored)
    del fields["reasoning"]
    old = decode(msgspec.msgpack.encode(fields), StoredResponse)
    assert old == STORED and response_reader(old, "", "") is None
