"""Tool calling with the real hf engine on `tiny-tools` (the tiny Llama with a Hermes-style
chat template), over real HTTP with the official openai client.

`tool_choice` required and named constrain decoding to the tools' schemas: whatever the
random weights would write, the calls' arguments validate (these need the hf engine's
structured outputs)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from tests.gateway.conftest import Stack, run_stack
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.messages import Feature

pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow

MODEL = "tiny-tools"
# bounded schemas: a random model constrained to them still ends within max_tokens
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ALARM = {
    "type": "object",
    "properties": {"on": {"type": "boolean"}, "label": {"type": "string", "maxLength": 8}},
    "required": ["on", "label"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}},
]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}
# constrained, the random weights still choose the whitespace JSON allows between tokens (with
# xgrammar's any_whitespace, as vLLM's default): room for it, within the 2048-token context
MAX_TOKENS = 1300  # the tools prompt is ~650 tokens
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def stack(valkey: EmbeddedServer) -> Iterator[Stack]:
    from tokenyard.engines import make_engine
    from tokenyard.gateway.tokenizers import load_tokenizer

    with run_stack(
        valkey,
        model=MODEL,
        tokenizer=load_tokenizer("hf", MODEL),
        engines=[lambda: make_engine("hf", model=MODEL, max_seqs=8, max_tokens=16384)],
        worker_options={"engine": "hf"},
    ) as s:
        yield s


def client_of(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def needs_structured_outputs() -> None:
    from tokenyard.engines.hf import HFEngine

    # the tests below rest on it: an engine that stopped constraining fails them, not skips
    assert Feature.STRUCTURED_OUTPUTS in HFEngine.features


def test_history_with_calls_and_results_renders_through_the_template(stack: Stack) -> None:
    from tokenyard.gateway.tokenizers import load_tokenizer

    arguments = '{"city": "Paris", "days": 1}'
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    messages: list[Any] = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    whole = client_of(stack).chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        max_tokens=8,
        temperature=0.0,
    )
    tokenizer = load_tokenizer("hf", MODEL)
    as_template = [
        messages[0],
        messages[1],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    **call,
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}},
                }
            ],
        },
        {"role": "tool", "content": "18C", "tool_call_id": "call_1", "name": "get_weather"},
    ]
    rendered = tokenizer.apply_chat_template(as_template, tools=TOOLS)
    assert "<tools>" in rendered and "<tool_response>\n18C\n</tool_response>" in rendered
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in rendered
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(tokenizer.encode(rendered))


def test_auto_reads_hermes_from_the_template(stack: Stack) -> None:
    # the random model writes no calls: its answer is content, read by the hermes parser
    whole = client_of(stack).chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=12, temperature=0.0
    )
    plain = client_of(stack).chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=12, temperature=0.0
    )
    assert whole.choices[0].message.tool_calls is None
    assert whole.choices[0].message.content == plain.choices[0].message.content


def _validate(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_calls_validate_for_every_seed(stack: Stack) -> None:
    needs_structured_outputs()
    client = client_of(stack)

    def one(seed: int) -> list[tuple[str, str]]:
        # one call: random weights would go on adding calls to an open-ended array
        whole = client.chat.completions.create(
            model=MODEL,
            messages=ASK,  # type: ignore[arg-type]
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
        )
        assert whole.choices[0].finish_reason == "tool_calls", whole
        calls = whole.choices[0].message.tool_calls or []
        return [(c.function.name, c.function.arguments) for c in calls]  # type: ignore[union-attr]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(50)))
    for calls in answers:
        assert calls
        for name, arguments in calls:
            _validate(name, arguments)


def test_named_calls_validate_for_every_seed(stack: Stack) -> None:
    needs_structured_outputs()
    client = client_of(stack)
    choice: Any = {"type": "function", "function": {"name": "set_alarm"}}

    def one(seed: int) -> str:
        whole = client.chat.completions.create(
            model=MODEL,
            messages=ASK,  # type: ignore[arg-type]
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
        )
        calls = whole.choices[0].message.tool_calls or []
        assert [c.function.name for c in calls] == ["set_alarm"]  # type: ignore[union-attr]
        assert whole.choices[0].message.content is None
        return calls[0].function.arguments  # type: ignore[union-attr]

    with ThreadPoolExecutor(8) as pool:
        for arguments in pool.map(one, range(50)):
            _validate("set_alarm", arguments)


def test_streamed_required_calls_reassemble(stack: Stack) -> None:
    needs_structured_outputs()
    client = client_of(stack)
    for seed in range(5):
        with client.chat.completions.stream(
            model=MODEL,
            messages=ASK,  # type: ignore[arg-type]
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=MAX_TOKENS,
            seed=seed,
        ) as stream:
            final = stream.get_final_completion()
        calls = final.choices[0].message.tool_calls or []
        assert len(calls) == 1 and final.choices[0].finish_reason == "tool_calls"
        _validate(calls[0].function.name, calls[0].function.arguments)  # type: ignore[union-attr]
