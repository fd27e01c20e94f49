"""The official openai package (sync, async, streaming) against a real gateway."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.conftest import MODEL, Stack


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def test_completion_sync_and_stream_agree(stack: Stack) -> None:
    c = client(stack)
    whole = c.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.0
    )
    assert whole.id.startswith("cmpl-")
    assert whole.object == "text_completion"
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert len(choice.text) == 12  # the sim tokenizer is byte-level
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (16, 12)
    assert whole.usage.total_tokens == 28

    chunks = list(
        c.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=12,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == choice.text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert len({ch.id for ch in chunks}) == 1


def test_chat_sync_stream_and_stop(stack: Stack) -> None:
    c = client(stack)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    whole = c.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0.0,
        seed=7,
    )
    assert whole.object == "chat.completion"
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content and len(message.content) == 10
    # the prompt is the sim tokenizer's chat template: <role>content\n ... <assistant>
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len("<system>be brief\n<user>hi\n<assistant>")

    stream = c.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0.0,
        seed=7,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == "length"

    stop_at = message.content[3:5]
    stopped = c.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0.0,
        seed=7,
        stop=[stop_at],
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == message.content.split(stop_at)[0]


async def test_async_client_concurrent_calls(stack: Stack) -> None:
    import asyncio

    c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    prompts = [f"prompt number {i}" for i in range(8)]
    results = await asyncio.gather(
        *(
            c.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0.0)
            for p in prompts
        )
    )
    assert all(r.choices[0].finish_reason == "length" for r in results)
    assert len({r.id for r in results}) == 8
    stream = await c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5, stream=True
    )
    text = "".join([ch.choices[0].delta.content or "" async for ch in stream])
    assert len(text) == 5
    await c.close()


def test_models_and_errors_map_to_openai_exceptions(stack: Stack) -> None:
    c = client(stack)
    assert [m.id for m in c.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError) as missing:
        c.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        c.completions.create(model=MODEL, prompt="x" * 5000, max_tokens=1)
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as unsupported:
        c.completions.create(model=MODEL, prompt="x", max_tokens=1, logprobs=1)
    assert unsupported.value.code == "unsupported_parameter"  # the sim engine has no logprobs
