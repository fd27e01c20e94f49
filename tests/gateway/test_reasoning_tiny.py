"""Reasoning with the real hf engine on `tiny-reasoning` (the tiny Llama with <think> tokens
and a Qwen3-style template), over real HTTP with the official openai client and a gateway
started with the qwen3 reasoning parser.

Random weights write no think tags of their own: a regex guide (vLLM's `guided_regex`, the hf
engine's structured outputs) makes the model write `<think>…</think>…`, and the split of that
text is what is checked: sync, streamed, and the jobs API's event stream resumed anywhere."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.gateway.conftest import Stack, run_stack
from tests.gateway.sse import events
from tokenyard.broker.redis.embedded import EmbeddedServer

pytest.importorskip("transformers")
pytest.importorskip("xgrammar")
pytestmark = pytest.mark.slow

MODEL = "tiny-reasoning"
ASK: list[Any] = [{"role": "user", "content": "Is it sunny?"}]
THINKS = r"<think>[a-z]{3,12}</think>[a-z ]{3,12}"
GUIDED = {"guided_regex": THINKS, "cache": False}
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


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
        reasoning_parser="qwen3",
    ) as s:
        yield s


def client_of(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def raw_text(stack: Stack, body: dict[str, Any]) -> str:
    """The model's text for `body` as the jobs API's record keeps it, unsplit."""
    with stack.client() as http:
        job = http.post("/v1/jobs", json=body).json()["id"]
        for _ in range(600):
            record = http.get(f"/v1/jobs/{job}").json()
            if record["status"] == "succeeded":
                text: str = record["result"]["text"]
                return text
            assert record["status"] in ("queued", "running"), record
            time.sleep(0.05)
    raise AssertionError("the job did not end")


def test_sync_and_streamed_answers_split_the_thinking_off(stack: Stack) -> None:
    client = client_of(stack)
    whole = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=40, temperature=0.0, extra_body=GUIDED
    )
    message = whole.choices[0].message
    reasoning = getattr(message, "reasoning", None)
    assert reasoning is not None and re.fullmatch("[a-z]{3,12}", reasoning), message
    assert getattr(message, "reasoning_content", None) == reasoning  # the earlier name too
    assert message.content is not None and re.fullmatch("[a-z ]{3,12}", message.content)
    # the split is of the model's own text: the jobs API keeps it whole
    body = {"model": MODEL, "messages": ASK, "max_tokens": 40, "temperature": 0.0, **GUIDED}
    assert raw_text(stack, body) == f"<think>{reasoning}</think>{message.content}"

    streamed_reasoning, streamed_content = [], []
    with client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=40, temperature=0.0, stream=True, extra_body=GUIDED
    ) as stream:
        for chunk in stream:
            for choice in chunk.choices:
                streamed_reasoning.append(getattr(choice.delta, "reasoning", None) or "")
                streamed_content.append(choice.delta.content or "")
    assert "".join(streamed_reasoning) == reasoning
    assert "".join(streamed_content) == message.content
    # no delta carries a tag, nor a piece of one
    assert not any("<" in piece or ">" in piece for piece in streamed_reasoning)


def test_include_reasoning_false_and_thinking_off(stack: Stack) -> None:
    client = client_of(stack)
    hidden = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=40,
        temperature=0.0,
        extra_body={**GUIDED, "include_reasoning": False},
    )
    assert getattr(hidden.choices[0].message, "reasoning", None) is None
    assert re.fullmatch("[a-z ]{3,12}", hidden.choices[0].message.content or "")
    # enable_thinking false: the template closes the thinking in the prompt, so the answer
    # is all content, tags and all
    off = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=40,
        temperature=0.0,
        extra_body={**GUIDED, "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert getattr(off.choices[0].message, "reasoning", None) is None
    assert re.fullmatch(THINKS, off.choices[0].message.content or "")


def test_reasoning_effort_and_template_kwargs_reach_the_template(stack: Stack) -> None:
    from tokenyard.gateway.tokenizers import load_tokenizer

    tokenizer = load_tokenizer("hf", MODEL)
    client = client_of(stack)
    for effort in ("low", "high"):
        answer = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=2, reasoning_effort=effort, temperature=0.0
        )
        rendered = tokenizer.apply_chat_template(
            ASK, variables={"reasoning_effort": effort, "enable_thinking": True}
        )
        assert f"Reasoning: {effort}" in rendered
        assert answer.usage is not None
        assert answer.usage.prompt_tokens == len(tokenizer.encode(rendered))
    closed = tokenizer.apply_chat_template(ASK, variables={"enable_thinking": False})
    none = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=2, reasoning_effort="none", temperature=0.0
    )
    assert closed.endswith("<think>\n\n</think>\n\n")
    assert none.usage is not None
    # effort none turns the thinking off, and shows itself
    assert none.usage.prompt_tokens == len(
        tokenizer.encode(
            tokenizer.apply_chat_template(
                ASK, variables={"enable_thinking": False, "reasoning_effort": "none"}
            )
        )
    )
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=2,
            extra_body={"chat_template_kwargs": {"tokenize": True}},
        )
    assert refused.value.body["param"] == "chat_template_kwargs.tokenize"  # type: ignore[index]


def test_a_call_after_the_thinking_is_a_tool_call(stack: Stack) -> None:
    client = client_of(stack)
    literal = re.escape(f"<think>look it up</think>{CALL}").replace("\\ ", " ")
    forced = {"guided_regex": literal, "cache": False}
    whole = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=300, extra_body=forced
    )
    choice = whole.choices[0]
    assert getattr(choice.message, "reasoning", None) == "look it up"
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in calls] == [  # type: ignore[union-attr]
        ("get_weather", '{"city": "Paris"}')
    ]
    # the reasoning comes back in the next turn's history, as the template shows it
    follow = client.chat.completions.create(
        model=MODEL,
        messages=[
            *ASK,
            choice.message.model_dump(exclude_none=True),  # type: ignore[list-item]
            {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"},
        ],
        tools=[WEATHER],
        max_tokens=2,
    )
    from tokenyard.gateway.tokenizers import load_tokenizer

    tokenizer = load_tokenizer("hf", MODEL)
    call = {"id": calls[0].id, "type": "function"}
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "look it up",
            "tool_calls": [
                {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": calls[0].id, "name": "get_weather"},
    ]
    rendered = tokenizer.apply_chat_template(history, tools=[WEATHER])
    assert "<think>\nlook it up\n</think>" in rendered
    assert follow.usage is not None
    assert follow.usage.prompt_tokens == len(tokenizer.encode(rendered))


def test_the_jobs_event_stream_resumes_anywhere_with_the_same_split(stack: Stack) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 40, "temperature": 0.0, **GUIDED}
    with stack.client() as http:
        job = http.post("/v1/jobs", json=body).json()["id"]
        url = f"/v1/jobs/chatcmpl-{job}/events"
        with http.stream("GET", url) as response:
            full = list(events(response))
        ids = [e.id for e in full if e.id is not None]
        assert len(ids) > 3  # an event per token
        whole = split(full)
        assert whole[0] and whole[1], whole
        for at, event_id in enumerate(ids):
            head = full[: next(i for i, e in enumerate(full) if e.id == event_id) + 1]
            with http.stream("GET", url, headers={"Last-Event-ID": event_id}) as response:
                rest = list(events(response))
            assert split([*head, *rest]) == whole, at


def split(frames: list[Any]) -> tuple[str, str]:
    """The reasoning and content a client reassembles from chat chunks."""
    reasoning, content = [], []
    for frame in frames:
        if frame.data == "[DONE]":
            continue
        for choice in frame.json()["choices"]:
            delta = choice["delta"]
            reasoning.append(delta.get("reasoning") or "")
            content.append(delta.get("content") or "")
    return "".join(reasoning), "".join(content)
