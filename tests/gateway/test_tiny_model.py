"""The openai client against the gateway serving the real tiny Llama on CPU."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.conftest import run_stack
from tokenyard.broker.redis.embedded import EmbeddedServer

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def test_tiny_model_chat_and_completion(valkey: EmbeddedServer) -> None:
    from tokenyard.engines import make_engine
    from tokenyard.gateway.tokenizers import load_tokenizer

    tokenizer = load_tokenizer("hf", "tiny")
    with run_stack(
        valkey,
        model="tiny",
        tokenizer=tokenizer,
        engines=[lambda: make_engine("hf", model="tiny", max_seqs=4, max_tokens=4096)],
        worker_options={"engine": "hf"},
    ) as stack:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Once upon a time"}]
        whole = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=12,
            temperature=0.0,  # type: ignore[arg-type]
        )
        text = whole.choices[0].message.content
        assert whole.usage is not None and 1 <= whole.usage.completion_tokens <= 12
        rendered = tokenizer.apply_chat_template(messages)
        assert whole.usage.prompt_tokens == len(tokenizer.encode(rendered))

        stream = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=12,
            temperature=0.0,  # type: ignore[arg-type]
            stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text

        # a response is the same chat job: same prompt, same greedy text, streamed or not
        response = client.responses.create(
            model="tiny",
            input=messages,
            max_output_tokens=12,
            temperature=0.0,  # type: ignore[arg-type]
        )
        assert response.output_text == text
        assert response.usage is not None
        assert response.usage.input_tokens == whole.usage.prompt_tokens
        events = client.responses.create(
            model="tiny",
            input="Once upon a time",
            max_output_tokens=12,
            temperature=0.0,
            stream=True,
        )
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert "".join(deltas) == text

        completion = client.completions.create(
            model="tiny", prompt="The queue holds", max_tokens=8, temperature=0.0
        )
        assert completion.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.BadRequestError) as too_long:
            client.completions.create(model="tiny", prompt="the " * 3000, max_tokens=8)
        assert too_long.value.code == "context_length_exceeded"
