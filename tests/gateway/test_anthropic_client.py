"""The official anthropic package (sync, streaming, errors) against a real gateway: Anthropic's
Messages API over the same chat jobs as the OpenAI routes."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from tests.gateway.conftest import MODEL, Stack, run_stack
from tests.gateway.test_tools import SCRIPT, ScriptedEngine
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.fleet.launch import wait_ready
from tokenyard.gateway.auth import KeyRing, Tenant
from tokenyard.messages import Feature

HI = [{"role": "user", "content": "hi"}]
# this client sends no sampling fields of its own any more (newer models take none); the API
# still defines them, and tokenyard's sim model is deterministic only when greedy
GREEDY = {"temperature": 0.0}


@contextlib.contextmanager
def client(stack: Stack, api_key: str = "unused") -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=stack.url, api_key=api_key, max_retries=0) as c:
        yield c


@pytest.fixture
def c(stack: Stack) -> Iterator[anthropic.Anthropic]:
    with client(stack) as c:
        yield c


TOOLS: list[Any] = [
    {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
    {"name": "get_time", "input_schema": {"type": "object"}},
]


def _error(response: httpx.Response, status: int, type_: str) -> str:
    """The message of an error in Anthropic's shape."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == type_, body
    message: str = body["error"]["message"]
    assert message and "Traceback" not in message
    return message


def test_message_sync_and_stream_agree(c: anthropic.Anthropic) -> None:
    system = "be brief"
    whole = c.messages.create(
        model=MODEL,
        max_tokens=10,
        messages=HI,
        system=system,
        extra_body=GREEDY,  # type: ignore[arg-type]
    )
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == MODEL
    assert len(whole.content) == 1 and whole.content[0].type == "text"
    text = whole.content[0].text
    assert len(text) == 10  # the sim tokenizer is byte-level
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    # the prompt is the sim tokenizer's chat template: <role>content\n ... <assistant>
    prompt = "<system>be brief\n<user>hi\n<assistant>"
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (len(prompt), 10)

    # the same request again would be a cache hit: this one runs a job, streamed live
    live = {**GREEDY, "cache": False}
    with c.messages.stream(
        model=MODEL,
        max_tokens=10,
        messages=HI,  # type: ignore[arg-type]
        system=[{"type": "text", "text": system}],
        extra_body=live,
    ) as stream:
        assert "x-cache" not in stream.response.headers
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text
    assert final.content[0].type == "text" and final.content[0].text == text
    assert final.stop_reason == "max_tokens" and final.stop_sequence is None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (len(prompt), 10)
    assert final.id.startswith("msg_")


def test_a_cached_message_answers_as_its_run_did(c: anthropic.Anthropic) -> None:
    once: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 6,
        "messages": [{"role": "user", "content": "cache me"}],
        "extra_body": GREEDY,
    }
    first = c.messages.with_raw_response.create(**once)
    again = c.messages.with_raw_response.create(**once)
    assert (first.headers["x-cache"], again.headers["x-cache"]) == ("miss", "hit")
    run, hit = first.parse(), again.parse()
    assert hit.id != run.id  # no job stands behind a hit: its id is new
    assert hit.model_dump(exclude={"id"}) == run.model_dump(exclude={"id"})
    with c.messages.stream(**once) as stream:
        assert stream.response.headers["x-cache"] == "hit"
        assert "".join(stream.text_stream) == run.content[0].text  # type: ignore[union-attr]
        final = stream.get_final_message()
    assert final.model_dump(exclude={"id"}) == run.model_dump(exclude={"id"})


def test_the_stream_events_come_in_anthropics_order(stack: Stack) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": HI, "stream": True, "temperature": 0.0}
    with stack.client() as http, http.stream("POST", "/v1/messages", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events: list[tuple[str, dict[str, Any]]] = []
    for block in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        events.append((lines["event"], data))
    kinds = [kind for kind, _ in events]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert events[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert all(e["delta"]["type"] == "text_delta" for k, e in events if k == "content_block_delta")
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 4


def test_stop_sequences(c: anthropic.Anthropic) -> None:
    full = c.messages.create(model=MODEL, max_tokens=12, messages=HI, extra_body=GREEDY)  # type: ignore[arg-type]
    text = full.content[0].text  # type: ignore[union-attr]
    stop = text[4:6]
    cut = text[: text.index(stop)]
    stopped = c.messages.create(
        model=MODEL,
        max_tokens=12,
        messages=HI,  # type: ignore[arg-type]
        extra_body=GREEDY,
        stop_sequences=["never-generated", stop],
    )
    assert stopped.content[0].text == cut  # type: ignore[union-attr]
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    with c.messages.stream(
        model=MODEL,
        max_tokens=12,
        messages=HI,  # type: ignore[arg-type]
        extra_body={**GREEDY, "cache": False},  # live, not the hit of the one above
        stop_sequences=["never-generated", stop],
    ) as stream:
        assert "".join(stream.text_stream) == cut
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    # a stop sequence that never comes: the length ends it
    long = c.messages.create(
        model=MODEL,
        max_tokens=12,
        messages=HI,
        extra_body=GREEDY,
        stop_sequences=["\x00"],  # type: ignore[arg-type]
    )
    assert long.stop_reason == "max_tokens" and long.stop_sequence is None


def test_tokenyards_fields_and_anthropics_hints_are_taken(c: anthropic.Anthropic) -> None:
    message = c.messages.create(
        model=MODEL,
        max_tokens=2,
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
            }
        ],
        metadata={"user_id": "u-1"},
        extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"},
        extra_body={"priority": "low", "cache": False, "cache_control": {"type": "ephemeral"}},
    )
    assert message.usage.output_tokens == 2


def test_a_multi_turn_history_renders(c: anthropic.Anthropic) -> None:
    history = [
        {"role": "user", "content": [{"type": "text", "text": "one"}]},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
    ]
    message = c.messages.create(model=MODEL, max_tokens=3, messages=history)  # type: ignore[arg-type]
    prompt = "<user>one\n<assistant>two\n<user>three\n<assistant>"
    assert message.usage.input_tokens == len(prompt)


def test_a_tool_history_renders_as_the_chat_api_renders_it(c: anthropic.Anthropic) -> None:
    history: list[Any] = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "P"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "sunny"}],
                },
                {"type": "text", "text": "and tomorrow?"},
            ],
        },
    ]
    message = c.messages.create(
        model=MODEL, max_tokens=3, messages=history, tools=TOOLS, tool_choice={"type": "none"}
    )
    assert message.stop_reason == "max_tokens"
    # the same conversation through the OpenAI chat API: the same prompt
    call = {"name": "get_weather", "arguments": '{"city": "P"}'}
    chat = {
        "model": MODEL,
        "max_tokens": 3,
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [{"id": "toolu_1", "type": "function", "function": call}],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
            {"role": "user", "content": "and tomorrow?"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "parameters": t["input_schema"],
                    **({"description": t["description"]} if "description" in t else {}),
                },
            }
            for t in TOOLS
        ],
        "tool_choice": "none",
    }
    with httpx.Client(base_url=str(c.base_url)) as http:
        openai = http.post("/v1/chat/completions", json=chat)
    assert openai.status_code == 200, openai.text
    assert message.usage.input_tokens == openai.json()["usage"]["prompt_tokens"]
    assert message.usage.input_tokens > len("weather in Paris?Let me look.sunnyand tomorrow?")


@pytest.fixture
def scripted(valkey: EmbeddedServer) -> Iterator[anthropic.Anthropic]:
    """A sim engine that writes Hermes tool calls (tests/gateway/test_tools.py's script)."""
    engine = ScriptedEngine(SCRIPT)
    with (
        run_stack(valkey, engines=[lambda: engine], cache=False, collapse=False) as stack,
        client(stack) as c,
    ):
        yield c


def test_tool_calls_are_tool_use_blocks_whole_and_streamed(scripted: anthropic.Anthropic) -> None:
    ask: Any = [{"role": "user", "content": "Weather in Paris and the time?"}]
    whole = scripted.messages.create(model=MODEL, max_tokens=300, messages=ask, tools=TOOLS)
    assert whole.stop_reason == "tool_use" and whole.stop_sequence is None
    kinds = [b.type for b in whole.content]
    assert kinds == ["text", "tool_use", "tool_use"]
    text, weather, time = whole.content
    assert text.type == "text" and text.text == "Let me look."
    assert weather.type == "tool_use" and time.type == "tool_use"
    assert (weather.name, weather.input) == ("get_weather", {"city": "Paris", "days": 2})
    assert (time.name, time.input) == ("get_time", {})
    assert weather.id != time.id

    with scripted.messages.stream(model=MODEL, max_tokens=300, messages=ask, tools=TOOLS) as stream:
        kinds_seen = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds_seen  # the client's own event for each input_json_delta
    assert final.stop_reason == "tool_use"

    def without_ids(message: anthropic.types.Message) -> list[dict[str, Any]]:
        return [{**b.model_dump(exclude_none=True), "id": None} for b in message.content]

    assert without_ids(final) == without_ids(whole)

    # a tool result answers the call: the next turn goes on from it
    follow: Any = [
        *ask,
        {"role": "assistant", "content": whole.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": weather.id, "content": "sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": time.id,
                    "content": "noon",
                    "is_error": False,
                },
            ],
        },
    ]
    again = scripted.messages.create(model=MODEL, max_tokens=300, messages=follow, tools=TOOLS)
    assert again.stop_reason == "tool_use"


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"model": MODEL, "messages": HI}, "max_tokens"),
        (
            {"model": MODEL, "max_tokens": 4, "messages": HI, "frequency_penalty": 1},
            "frequency_penalty",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "AA==",
                                },
                            },
                        ],
                    }
                ],
            },
            "messages.0.content.1",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": HI,
                "thinking": {"type": "adaptive"},
            },
            "thinking.type",
        ),
        (
            {"model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
            "role",
        ),
        ({"model": MODEL, "max_tokens": 4, "messages": HI, "temperature": 1.5}, "temperature"),
        (
            {"model": MODEL, "max_tokens": 4, "messages": HI, "tool_choice": {"type": "any"}},
            "tool_choice",
        ),
        # refusals of the chat request it runs as, named as the client wrote them
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}
                        ],
                    }
                ],
            },
            "messages.0.content.0.tool_use_id",
        ),
        (
            {"model": MODEL, "max_tokens": 4, "messages": HI, "tools": [TOOLS[1], TOOLS[1]]},
            "tools.1.name",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": HI,
                "tools": [{"name": "f", "input_schema": {"type": "string"}}],
            },
            "tools.0.input_schema",
        ),
        # tokenyard's own fields, checked as on the other APIs
        ({"model": MODEL, "max_tokens": 4, "messages": HI, "priority": "high"}, "priority"),
        ({"model": MODEL, "max_tokens": 4, "messages": HI, "deadline": 1.0}, "deadline"),
        (
            {"model": MODEL, "max_tokens": 4, "messages": HI, "stop_sequences": [""]},
            "stop_sequences",
        ),
        ({"model": MODEL, "max_tokens": 100_000, "messages": HI}, "max_tokens"),
    ],
)
def test_bad_input_is_anthropics_400(
    stack: Stack, c: anthropic.Anthropic, body: dict[str, Any], named: str
) -> None:
    with stack.client() as http:
        message = _error(http.post("/v1/messages", json=body), 400, "invalid_request_error")
    assert named in message
    with pytest.raises(anthropic.BadRequestError) as caught:
        # the raw post: this client's create() checks its own arguments before sending
        c.post("/v1/messages", body=body, cast_to=anthropic.types.Message)
    assert caught.value.status_code == 400 and named in caught.value.message


def test_unknown_model_and_path_are_anthropics_404(stack: Stack, c: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        c.messages.create(model="no-such-model", max_tokens=4, messages=HI)  # type: ignore[arg-type]
    assert caught.value.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": "The model 'no-such-model' does not exist",
        },
    }
    with stack.client() as http:
        _error(http.post("/v1/messages/batches/x", json={}), 404, "not_found_error")
        _error(http.get("/v1/messages"), 405, "invalid_request_error")
        # the other APIs keep OpenAI's shape
        assert set(http.post("/v1/chat/completions", json={}).json()) == {"error"}


def test_a_prompt_past_the_context_is_400(c: anthropic.Anthropic) -> None:
    long = [{"role": "user", "content": "x" * 5000}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        c.messages.create(model=MODEL, max_tokens=4, messages=long)  # type: ignore[arg-type]
    assert "maximum context length" in caught.value.message


def test_keys_by_x_api_key_or_bearer_and_anthropics_401(valkey: EmbeddedServer) -> None:
    keys = KeyRing({"sk-anthropic": Tenant("acme")})
    with (
        run_stack(valkey, keyring=keys) as stack,
        client(stack, "sk-anthropic") as keyed,
        client(stack, "sk-wrong") as wrong,
        anthropic.Anthropic(base_url=stack.url, auth_token="sk-anthropic", max_retries=0) as bearer,
    ):
        ok = keyed.messages.create(model=MODEL, max_tokens=2, messages=HI)  # type: ignore[arg-type]
        assert ok.usage.output_tokens == 2
        again = bearer.messages.create(model=MODEL, max_tokens=2, messages=HI)  # type: ignore[arg-type]
        assert again.usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError) as caught:
            wrong.messages.create(model=MODEL, max_tokens=2, messages=HI)  # type: ignore[arg-type]
        assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        with stack.client() as http:
            _error(http.post("/v1/messages", json={}), 401, "authentication_error")
            headers = {"x-api-key": "sk-anthropic", "anthropic-version": "2023-06-01"}
            big = b"{" + b" " * (2 << 20) + b"}"
            _error(
                http.post("/v1/messages", content=big, headers=headers), 413, "request_too_large"
            )


@pytest.mark.slow
def test_the_tiny_model_answers_messages(valkey: EmbeddedServer) -> None:
    pytest.importorskip("transformers")
    from tokenyard.engines import make_engine
    from tokenyard.gateway.tokenizers import load_tokenizer

    tokenizer = load_tokenizer("hf", "tiny")
    with (
        run_stack(
            valkey,
            model="tiny",
            tokenizer=tokenizer,
            engines=[lambda: make_engine("hf", model="tiny", max_seqs=4, max_tokens=4096)],
            worker_options={"engine": "hf"},
        ) as stack,
        client(stack) as c,
    ):
        turn = [{"role": "user", "content": "Once upon a time"}]
        whole = c.messages.create(model="tiny", max_tokens=12, messages=turn, extra_body=GREEDY)  # type: ignore[arg-type]
        assert whole.content[0].type == "text"
        text = whole.content[0].text
        assert whole.stop_reason in ("max_tokens", "end_turn")
        assert whole.usage.input_tokens == len(
            tokenizer.encode(tokenizer.apply_chat_template(turn))
        )
        assert 1 <= whole.usage.output_tokens <= 12
        live = {**GREEDY, "cache": False}
        with c.messages.stream(model="tiny", max_tokens=12, messages=turn, extra_body=live) as s:  # type: ignore[arg-type]
            assert "".join(s.text_stream) == text
            final = s.get_final_message()
        assert final.content[0].text == text and final.stop_reason == whole.stop_reason  # type: ignore[union-attr]
        assert final.usage == whole.usage

        # a stop sequence from the text: a real tokenizer's tokens span it
        stop = text.strip()[1:3]
        assert stop, text
        stopped = c.messages.create(
            model="tiny",
            max_tokens=12,
            messages=turn,
            extra_body=GREEDY,
            stop_sequences=[stop],  # type: ignore[arg-type]
        )
        assert stopped.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]
        assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop


@pytest.mark.slow
def test_tiny_tools_any_and_named_give_tool_use_blocks_that_validate(
    valkey: EmbeddedServer,
) -> None:
    """tool_choice any and tool constrain decoding: whatever the random weights would write,
    the tool_use blocks' inputs validate (needs the hf engine's structured outputs)."""
    pytest.importorskip("transformers")
    jsonschema = pytest.importorskip("jsonschema")
    from tokenyard.engines import make_engine
    from tokenyard.engines.hf import HFEngine
    from tokenyard.gateway.tokenizers import load_tokenizer

    assert Feature.STRUCTURED_OUTPUTS in HFEngine.features  # what tool_choice any rests on
    # bounded schemas: a random model constrained to them still ends within max_tokens
    weather = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    alarm = {
        "type": "object",
        "properties": {"on": {"type": "boolean"}, "label": {"type": "string", "maxLength": 8}},
        "required": ["on", "label"],
        "additionalProperties": False,
    }
    schemas = {"get_weather": weather, "set_alarm": alarm}
    tools: Any = [{"name": n, "input_schema": s} for n, s in schemas.items()]
    ask: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    model = "tiny-tools"
    with (
        run_stack(
            valkey,
            model=model,
            tokenizer=load_tokenizer("hf", model),
            engines=[lambda: make_engine("hf", model=model, max_seqs=8, max_tokens=8192)],
            worker_options={"engine": "hf"},
        ) as stack,
        client(stack) as c,
    ):
        # its worker's published features (structured outputs) decide admission
        wait_ready(stack.url + "/readyz", timeout_s=60, interval_s=0.05)
        # one call each: a random model asked for any number writes arrays past max_tokens
        one: Any = {"type": "any", "disable_parallel_tool_use": True}
        for choice in [one] * 8 + [{"type": "tool", "name": "set_alarm"}] * 4:
            message = c.messages.create(
                model=model,
                max_tokens=200,
                messages=ask,
                tools=tools,
                tool_choice=choice,  # type: ignore[arg-type]
                extra_body={"temperature": 1.0},
            )
            assert message.stop_reason == "tool_use", message
            uses = [b for b in message.content if b.type == "tool_use"]
            assert len(uses) == 1, message
            for use in uses:
                assert use.type == "tool_use"
                if choice["type"] == "tool":
                    assert use.name == "set_alarm"
                jsonschema.validate(use.input, schemas[use.name])
        with c.messages.stream(
            model=model,
            max_tokens=200,
            messages=ask,
            tools=tools,
            tool_choice=one,
        ) as stream:
            final = stream.get_final_message()
        assert final.stop_reason == "tool_use"
        for use in final.content:
            if use.type == "tool_use":
                jsonschema.validate(use.input, schemas[use.name])
