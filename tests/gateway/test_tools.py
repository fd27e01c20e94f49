"""Tool calling on /v1/chat/completions over real HTTP with the official openai client: a
scripted sim engine writes the calls (Hermes' format, which the sim tokenizer's template
shows), the gateway reads them, whole and streamed."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from tests.gateway import sse
from tests.gateway.conftest import MODEL, BareSim, Stack, run_stack
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.engines.base import EngineRequest
from tokenyard.engines.sim import SimEngine, SimTokenizer
from tokenyard.fleet.launch import wait_ready
from tokenyard.messages import Feature, SamplingParams

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS: list[Any] = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather in Paris and the time?"}]
SCRIPT = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


class ScriptedEngine(SimEngine):
    """Writes `script` (a byte a token), then ends; says it does structured outputs (it does
    not constrain anything) and keeps the sampling params it was given."""

    features = frozenset({Feature.STRUCTURED_OUTPUTS})

    def __init__(self, script: str) -> None:
        super().__init__(
            prefill_base=0.001, prefill_per_token=0.0, decode_base=0.0005, decode_per_seq=0.0
        )
        self.script = script.encode()
        self.params: list[SamplingParams] = []
        self._starts: dict[str, int] = {}

    def add(self, request: EngineRequest) -> None:
        self.params.append(request.params)
        super().add(request)

    def _token(self, seq: Any) -> int:
        at = seq.position - self._starts.setdefault(seq.seq_id, seq.position)
        if at >= len(self.script):
            return SimTokenizer.EOS
        return self.script[at] + SimTokenizer.OFFSET


@pytest.fixture
def scripted(valkey: EmbeddedServer) -> Iterator[tuple[Stack, ScriptedEngine]]:
    engine = ScriptedEngine(SCRIPT)
    with run_stack(valkey, engines=[lambda: engine], cache=False, collapse=False) as stack:
        yield stack, engine


def client_of(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def test_calls_are_read_from_the_answer(scripted: tuple[Stack, ScriptedEngine]) -> None:
    stack, engine = scripted
    whole = client_of(stack).chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,
        max_tokens=300,
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 2}  # type: ignore[union-attr]
    assert json.loads(calls[1].function.arguments) == {}  # type: ignore[union-attr]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert len({c.id for c in calls}) == 2
    assert engine.params[-1].guide is None  # auto: decoding is free


def test_streamed_calls_reassemble_with_the_clients_helper(
    scripted: tuple[Stack, ScriptedEngine],
) -> None:
    stack, _ = scripted
    client = client_of(stack)
    with client.chat.completions.stream(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,
        max_tokens=300,
    ) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [  # type: ignore[union-attr]
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_time", {}),
    ]
    # no piece of a call's markup is ever sent as content
    content = "".join(e.delta for e in events if e.type == "content.delta")
    assert content == "Let me look."
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert [e.name for e in done] == ["get_weather", "get_time"]

    # the raw chunks: an announcement with id, type and name, then argument fragments
    raw = client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,
        max_tokens=300,
        stream=True,
    )
    pieces = [t for c in raw if c.choices for t in c.choices[0].delta.tool_calls or []]
    heads = [p for p in pieces if p.id is not None]
    assert [(h.index, h.type, h.function.name, h.function.arguments) for h in heads] == [  # type: ignore[union-attr]
        (0, "function", "get_weather", ""),
        (1, "function", "get_time", ""),
    ]
    args = "".join(p.function.arguments or "" for p in pieces if p.index == 0)  # type: ignore[union-attr]
    assert json.loads(args) == {"city": "Paris", "days": 2}


def test_tool_choice_none_answers_with_the_text(scripted: tuple[Stack, ScriptedEngine]) -> None:
    stack, _ = scripted
    whole = client_of(stack).chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,
        tool_choice="none",
        max_tokens=300,
    )
    assert whole.choices[0].message.content == SCRIPT
    assert whole.choices[0].message.tool_calls is None
    assert whole.choices[0].finish_reason == "stop"


def test_required_and_named_choices_constrain_decoding(
    scripted: tuple[Stack, ScriptedEngine],
) -> None:
    stack, engine = scripted
    client = client_of(stack)
    # the scripted engine ignores the constraint: what matters here is the job's guide
    client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=300,
    )
    guide = engine.params[-1].guide
    assert guide is not None and guide.json is not None
    schema = json.loads(guide.json)
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    assert [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]] == [
        ["get_weather"],
        ["get_time"],
    ]
    named = client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=300,
    )
    guide = engine.params[-1].guide
    assert guide is not None and json.loads(guide.json or "") == WEATHER["function"]["parameters"]
    # the whole answer is the named function's arguments (here the script, not JSON)
    calls = named.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]  # type: ignore[union-attr]
    assert named.choices[0].message.content is None


def test_history_with_calls_and_results_renders_through_the_template(
    scripted: tuple[Stack, ScriptedEngine],
) -> None:
    stack, _ = scripted
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"},
    ]
    whole = client_of(stack).chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=300
    )
    tokenizer = SimTokenizer()
    rendered = tokenizer.apply_chat_template(
        [
            *ASK,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": "18C and sunny"},
        ],
        tools=TOOLS,
    )
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(tokenizer.encode(rendered))


def _bad(stack: Stack, **body: Any) -> dict[str, Any]:
    with stack.client() as http:
        reply = http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": ASK, "max_tokens": 8, **body},
        )
    assert reply.status_code == 400, reply.text
    error: dict[str, Any] = reply.json()["error"]
    return error


def test_bad_tool_input_is_400_naming_the_param(scripted: tuple[Stack, ScriptedEngine]) -> None:
    stack, _ = scripted
    named = {"type": "function", "function": {"name": "get_stock"}}
    assert _bad(stack, tools=TOOLS, tool_choice=named)["param"] == "tool_choice"
    nameless = {"type": "function", "function": {"parameters": {"type": "object"}}}
    assert _bad(stack, tools=[nameless])["param"] == "tools.0.function.name"
    orphan = [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "18C"}]
    assert _bad(stack, tools=TOOLS, messages=orphan)["param"] == "messages.1.tool_call_id"
    bad_args = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}
            ],
        },
    ]
    error = _bad(stack, tools=TOOLS, messages=bad_args)
    assert error["param"] == "messages.1.tool_calls.0.function.arguments"
    assert _bad(stack, tool_choice="required")["param"] == "tool_choice"


def test_a_tool_schema_the_engines_cannot_compile_is_refused_before_queueing(
    scripted: tuple[Stack, ScriptedEngine],
) -> None:
    stack, _ = scripted
    broken = {"type": "object", "properties": {"x": {"$ref": "#/$defs/nope"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": broken}}]
    error = _bad(stack, tools=tools, tool_choice="required")
    assert error["param"] == "tools" and error["code"] == "invalid_value"


def test_required_on_an_engine_without_structured_outputs_names_the_engine(
    valkey: EmbeddedServer,
) -> None:
    with run_stack(valkey, engines=[BareSim]) as bare:
        wait_ready(bare.url + "/readyz", timeout_s=60, interval_s=0.05)  # its limits published
        error = _bad(bare, tools=TOOLS, tool_choice="required")
    assert error["param"] == "tool_choice"
    assert "bare-sim engine" in error["message"]
    assert error["code"] == "unsupported_parameter"


def test_auto_needs_a_template_that_shows_the_format(valkey: EmbeddedServer) -> None:
    class Plain(SimTokenizer):
        @property
        def chat_template(self) -> str:
            return "{{ messages }}"

    with run_stack(valkey, tokenizer=Plain()) as plain:
        error = _bad(plain, tools=TOOLS)
        assert error["param"] == "tool_choice" and "--tool-call-parser" in error["message"]
    with run_stack(valkey, tokenizer=Plain(), tool_call_parser="hermes") as chosen:
        with chosen.client() as http:
            reply = http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": ASK, "max_tokens": 4, "tools": TOOLS},
            )
        assert reply.status_code == 200, reply.text


def test_batch_lines_read_tool_calls(valkey: EmbeddedServer, tmp_path: Path) -> None:
    engine = ScriptedEngine(SCRIPT)
    with run_stack(valkey, engines=[lambda: engine], files_dir=str(tmp_path)) as stack:
        client = client_of(stack)
        row = {
            "custom_id": "r1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 300},
        }
        data = json.dumps(row).encode() + b"\n"
        upload = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        end = time.monotonic() + 60
        while (batch := client.batches.retrieve(batch.id)).status != "completed":
            assert time.monotonic() < end and batch.status in (
                "validating",
                "in_progress",
                "finalizing",
            )
            time.sleep(0.05)
        assert batch.output_file_id is not None
        line = json.loads(client.files.content(batch.output_file_id).text)
        choice = line["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == [
            "get_weather",
            "get_time",
        ]


# -- the Responses API's function tools ----------------------------------------------------------
FLAT_TOOLS: list[Any] = [
    {"type": "function", **WEATHER["function"]},
    {"type": "function", "name": "get_time", "parameters": {"type": "object"}},
]


def test_responses_output_function_calls(scripted: tuple[Stack, ScriptedEngine]) -> None:
    stack, _ = scripted
    client = client_of(stack)
    response = client.responses.create(
        model=MODEL, input="Weather in Paris and the time?", tools=FLAT_TOOLS
    )
    kinds = [item.type for item in response.output]
    assert kinds == ["message", "function_call", "function_call"]
    assert response.output_text == "Let me look."
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_time", {}),
    ]
    assert response.tools[0].name == "get_weather"  # type: ignore[union-attr]
    # read again: the same items, the same call ids
    again = client.responses.retrieve(response.id)
    assert [i.model_dump() for i in again.output] == [i.model_dump() for i in response.output]

    # streamed: the same output, built from the events
    events = list(
        client.responses.create(
            model=MODEL, input="Weather in Paris and the time?", tools=FLAT_TOOLS, stream=True
        )
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1]
    assert final.type == "response.completed"
    streamed = final.response.output
    assert [i.type for i in streamed] == kinds
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args.split("}", 1)[0] + "}") == {"city": "Paris", "days": 2}
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Let me look."

    # the outputs answer the calls in a next response
    outputs: list[Any] = [
        {"type": "function_call_output", "call_id": c.call_id, "output": "18C"} for c in calls
    ]
    follow = client.responses.create(
        model=MODEL, previous_response_id=response.id, input=outputs, tools=FLAT_TOOLS
    )
    assert follow.status == "completed"
    # or the whole conversation given as input items
    items: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "18C"},
    ]
    assert client.responses.create(model=MODEL, input=items).status == "completed"


def test_stored_calls_read_alike_after_the_parser_setting_changes(valkey: EmbeddedServer) -> None:
    # a response's reading is kept with it: a gateway set otherwise (restarted on the same
    # broker) shows the same calls, and their outputs still answer them in a next response
    ask = "Weather in Paris and the time?"
    with run_stack(valkey, engines=[lambda: ScriptedEngine(SCRIPT)]) as first:
        client = client_of(first)
        # streamed, so its job's events keep its tokens for a streamed read later
        created = list(
            client.responses.create(model=MODEL, input=ask, tools=FLAT_TOOLS, stream=True)
        )
        assert created[-1].type == "response.completed"
        response = client.responses.retrieve(created[-1].response.id)
    output = [i.model_dump() for i in response.output]
    assert output == [i.model_dump() for i in created[-1].response.output]
    assert [i["type"] for i in output] == ["message", "function_call", "function_call"]
    with run_stack(
        valkey,
        engines=[lambda: ScriptedEngine(SCRIPT)],
        prefix=first.prefix,
        tool_call_parser="llama3_json",  # would read the Hermes answer as text
    ) as second:
        client = client_of(second)
        again = client.responses.retrieve(response.id)
        assert [i.model_dump() for i in again.output] == output
        with (
            second.client() as http,
            http.stream("GET", f"/v1/responses/{response.id}", params={"stream": "true"}) as got,
        ):
            events = [e.json() for e in sse.events(got)]
        assert events[-1]["type"] == "response.completed"
        streamed = events[-1]["response"]["output"]
        assert [i.get("call_id") for i in streamed] == [i.get("call_id") for i in output]
        outputs: list[Any] = [
            {"type": "function_call_output", "call_id": i["call_id"], "output": "18C"}
            for i in output[1:]
        ]
        follow = client.responses.create(
            model=MODEL, previous_response_id=response.id, input=outputs, tools=FLAT_TOOLS
        )
        assert follow.status == "completed"


def test_required_and_named_answers_stream_as_calls(valkey: EmbeddedServer) -> None:
    # what constrained decoding writes: a JSON array of calls, or the named one's arguments
    array = (
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    for script, choice, expected in (
        (array, "required", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
        (
            '{"city": "Lima", "days": 3}',
            {"type": "function", "function": {"name": "get_weather"}},
            [("get_weather", {"city": "Lima", "days": 3})],
        ),
    ):
        engine = ScriptedEngine(script)
        with run_stack(valkey, engines=[lambda e=engine: e]) as stack:  # type: ignore[misc]
            client = client_of(stack)
            with client.chat.completions.stream(
                model=MODEL,
                messages=ASK,  # type: ignore[arg-type]
                tools=TOOLS,
                tool_choice=choice,  # type: ignore[arg-type]
                max_tokens=300,
            ) as stream:
                final = stream.get_final_completion()
            choice_ = final.choices[0]
            assert choice_.finish_reason == "tool_calls"
            calls = choice_.message.tool_calls or []
            got = [(c.function.name, json.loads(c.function.arguments)) for c in calls]  # type: ignore[union-attr]
            assert got == expected
            assert not choice_.message.content


# -- the jobs API: a chat job with tools, followed and resumed -------------------------------------
def _chunks(http: httpx.Client, path: str, last_id: str = "0") -> list[tuple[str | None, Any]]:
    """The stream's chunks (each parsed by the openai client's type) with their event ids."""
    with http.stream("GET", path, headers={"Last-Event-ID": last_id}) as reply:
        assert reply.status_code == 200, reply.read()
        out = []
        for event in sse.events(reply):
            if event.data == "[DONE]":
                break
            ChatCompletionChunk.model_validate(event.json())
            out.append((event.id, event.json()))
        return out


def _read(chunks: list[tuple[str | None, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """The content and the calls (id, name, arguments) a stream's chunks add up to."""
    content = ""
    calls: list[dict[str, Any]] = []
    for _, chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for piece in delta.get("tool_calls") or []:
                if piece.get("id") is not None:
                    assert piece["index"] == len(calls)
                    calls.append({"id": piece["id"], "name": piece["function"]["name"]})
                    calls[-1]["arguments"] = ""
                calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
    return content, calls


def test_a_chat_job_with_tools_streams_its_calls_and_resumes_anywhere(
    scripted: tuple[Stack, ScriptedEngine],
) -> None:
    stack, _ = scripted
    with stack.client() as http:
        body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 300}
        queued = http.post("/v1/jobs", json=body)
        assert queued.status_code == 202, queued.text
        path = f"/v1/jobs/chatcmpl-{queued.json()['id']}/events"
        whole = _chunks(http, path)
        content, calls = _read(whole)
        assert content == "Let me look."
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Paris", "days": 2}),
            ("get_time", {}),
        ]
        assert whole[-1][1]["choices"][0]["finish_reason"] == "tool_calls"
        # read again: the same chunks, the same call ids
        assert _chunks(http, path) == whole
        # cut after any event and resumed there: the parse goes on where it stood (held-back
        # text, call indices, ids), so both halves make the unbroken stream, chunk for chunk
        ids = [i for i, (event_id, _) in enumerate(whole) if event_id is not None]
        assert len(ids) > 20
        for at in ids:
            event_id = whole[at][0]
            assert event_id is not None
            assert whole[: at + 1] + _chunks(http, path, event_id) == whole, event_id


def test_the_live_stream_and_the_jobs_stream_name_calls_alike(
    scripted: tuple[Stack, ScriptedEngine],
) -> None:
    stack, _ = scripted
    raw = client_of(stack).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,
        max_tokens=300,
        stream=True,
    )
    job_id = raw.headers["X-Job-Id"]
    live = [(None, chunk.model_dump(exclude_unset=True)) for chunk in raw.parse()]
    _, live_calls = _read(live)
    assert [c["name"] for c in live_calls] == ["get_weather", "get_time"]
    with stack.client() as http:
        _, calls = _read(_chunks(http, f"/v1/jobs/chatcmpl-{job_id}/events"))
    assert calls == live_calls
