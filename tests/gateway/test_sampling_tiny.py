"""The sampling and output fields honoured end to end on the real tiny hf model, through the
official openai client: what the model's values decide (logprobs, seeded choices, structured
outputs, logit_bias, min_tokens, stop_token_ids, penalties) and echo.

These need the hf engine to implement the features (it publishes them; until it does, each
request is refused 400 naming the parameter and the engine).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.gateway.conftest import Stack, run_stack
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.engines.base import EngineTokenizer

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def tokenizer() -> EngineTokenizer:
    from tokenyard.gateway.tokenizers import load_tokenizer

    return load_tokenizer("hf", "tiny")


@pytest.fixture(scope="module")
def tiny(valkey: EmbeddedServer, tokenizer: EngineTokenizer) -> Iterator[openai.OpenAI]:
    from tokenyard.engines import make_engine

    with run_stack(
        valkey,
        model="tiny",
        tokenizer=tokenizer,
        engines=[lambda: make_engine("hf", model="tiny", max_seqs=8, max_tokens=8192)],
        worker_options={"engine": "hf"},
    ) as stack:
        # the gateway refuses what the published engine lacks: wait for it to publish
        give_up = time.monotonic() + 60
        while not stack.call(stack.gateway_broker.registry.workers("tiny")):
            assert time.monotonic() < give_up, "the worker never sent a heartbeat"
            time.sleep(0.05)
        yield _client(stack)


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def test_greedy_logprobs_put_the_chosen_token_first(tiny: openai.OpenAI) -> None:
    whole = tiny.chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0.0,
        logprobs=True,
        top_logprobs=5,
    )
    assert whole.choices[0].logprobs is not None
    content = whole.choices[0].logprobs.content or []
    assert whole.usage is not None and len(content) == whole.usage.completion_tokens
    for entry in content:
        top = entry.top_logprobs
        assert len(top) == 5 and entry.logprob <= 0.0
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert top[0].token == entry.token
        assert top[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    streamed = tiny.chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0.0,
        logprobs=True,
        top_logprobs=5,
        stream=True,
        extra_body={"cache": False},
    )
    again = [
        e.token
        for ch in streamed
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content or []
    ]
    assert again == [e.token for e in content]

    completion = tiny.completions.create(
        model="tiny", prompt="The queue holds", max_tokens=8, temperature=0.0, logprobs=3
    )
    lp = completion.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None and lp.token_logprobs is not None
    for token, value, top in zip(lp.tokens or [], lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == pytest.approx(value) and value == pytest.approx(max(top.values()))


def test_seeded_choices_repeat_and_differ(tiny: openai.OpenAI) -> None:
    ask: dict[str, Any] = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 1234,
        "n": 4,
    }
    first = tiny.chat.completions.create(**ask)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert len(set(texts)) == 4
    again = tiny.chat.completions.create(**ask, extra_body={"cache": False})
    assert [c.message.content for c in again.choices] == texts
    streamed = tiny.chat.completions.create(**ask, stream=True)
    by_index: dict[int, str] = {}
    for chunk in streamed:
        for c in chunk.choices:
            by_index[c.index] = by_index.get(c.index, "") + (c.delta.content or "")
    assert [by_index[i] for i in range(4)] == texts


class Answer(BaseModel):
    answer: Literal["yes", "no"]
    count: Literal[1, 2, 3]


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "count": {"enum": [1, 2, 3]}},
    "required": ["answer", "count"],
    "additionalProperties": False,
}


def test_json_schema_output_validates(tiny: openai.OpenAI) -> None:
    whole = tiny.chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=200,
        temperature=0.0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
        },
    )
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content or ""), SCHEMA)

    parsed = tiny.chat.completions.parse(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=200,
        temperature=0.0,
        response_format=Answer,
    )
    assert isinstance(parsed.choices[0].message.parsed, Answer)

    anything = tiny.completions.create(
        model="tiny",
        prompt="JSON:",
        max_tokens=200,
        temperature=0.0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].text), dict)


def test_responses_text_format_constrains_the_output(tiny: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}
    response = tiny.responses.create(
        model="tiny",
        input="Once upon a time",
        max_output_tokens=200,
        temperature=0.0,
        text={"format": fmt},
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    # the stored response shows the format it was asked for
    kept = tiny.responses.retrieve(response.id)
    assert kept.text is not None and kept.text.format is not None
    assert kept.text.format.model_dump(exclude_none=True, by_alias=True) == fmt
    assert kept.output_text == response.output_text

    parsed = tiny.responses.parse(
        model="tiny",
        input="Once upon a time",
        max_output_tokens=200,
        temperature=0.0,
        text_format=Answer,
    )
    assert isinstance(parsed.output_parsed, Answer)

    streamed = list(
        tiny.responses.create(
            model="tiny",
            input="Once upon a time",
            max_output_tokens=200,
            temperature=0.0,
            text={"format": fmt},
            stream=True,
        )
    )
    assert streamed[-1].type == "response.completed"
    assert streamed[-1].response.output_text == response.output_text

    anything = tiny.responses.create(
        model="tiny",
        input="JSON:",
        max_output_tokens=200,
        temperature=0.0,
        text={"format": {"type": "json_object"}},
    )
    if anything.status == "completed":
        assert isinstance(json.loads(anything.output_text), dict)
    assert tiny.responses.retrieve(anything.id).text.format.type == "json_object"  # type: ignore[union-attr]


def test_responses_text_format_that_cannot_compile_is_400(tiny: openai.OpenAI) -> None:
    bad: Any = {
        "type": "json_schema",
        "name": "bad",
        "schema": {"type": "object", "minProperties": "x"},
    }
    with pytest.raises(openai.BadRequestError) as refused:
        tiny.responses.create(model="tiny", input="hi", text={"format": bad})
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "text.format", error
    assert "minProperties" in error["message"]


def test_choice_and_regex_constrain_the_text(tiny: openai.OpenAI) -> None:
    choice = tiny.completions.create(
        model="tiny",
        prompt="Pick one:",
        max_tokens=8,
        temperature=1.0,
        seed=3,
        extra_body={"structured_outputs": {"choice": ["north", "south"]}},
    )
    assert choice.choices[0].text in ("north", "south")
    regex = tiny.chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0.0,
        extra_body={"guided_regex": "[0-9]{3}"},
    )
    assert re.fullmatch("[0-9]{3}", regex.choices[0].message.content or "")


def test_echo_prepends_the_prompt(tiny: openai.OpenAI) -> None:
    ask: dict[str, Any] = {
        "model": "tiny",
        "prompt": "The queue holds",
        "max_tokens": 6,
        "temperature": 0.0,
    }
    plain = tiny.completions.create(**ask)
    echoed = tiny.completions.create(**ask, echo=True)
    assert echoed.choices[0].text == "The queue holds" + plain.choices[0].text


def _ids(tiny: openai.OpenAI, **extra: Any) -> tuple[list[int], str | None]:
    raw = tiny.completions.create(
        model="tiny",
        prompt="The queue holds",
        max_tokens=extra.pop("max_tokens", 16),
        temperature=0.0,
        extra_body={"return_token_ids": True, "cache": False, **extra},
    )
    choice = raw.choices[0]
    return list(choice.model_extra["token_ids"]), choice.finish_reason  # type: ignore[index]


def test_logit_bias_min_tokens_and_stop_token_ids(
    tiny: openai.OpenAI, tokenizer: EngineTokenizer
) -> None:
    forced = tokenizer.encode(" time")[-1]
    ids, _ = _ids(tiny, max_tokens=4, logit_bias={str(forced): 100})
    assert ids == [forced] * 4
    eos = tokenizer.eos_token_id
    assert eos is not None
    # EOS forced: it ends at once, unless min_tokens holds it off
    ids, reason = _ids(tiny, logit_bias={str(eos): 100})
    assert reason == "stop" and len([i for i in ids if i != eos]) == 0
    ids, reason = _ids(tiny, logit_bias={str(eos): 100}, min_tokens=3)
    assert reason == "stop" and len([i for i in ids if i != eos]) == 3
    # stop at the first occurrence of a token the greedy run makes
    base, _ = _ids(tiny)
    stop = base[2]
    ids, reason = _ids(tiny, stop_token_ids=[stop])
    assert reason == "stop"
    assert [i for i in ids if i != stop] == base[: base.index(stop)]


def test_penalties_change_a_repetitive_greedy_run(tiny: openai.OpenAI) -> None:
    base, _ = _ids(tiny, max_tokens=24, ignore_eos=True)
    assert len(base) == 24
    if len(set(base)) == len(base):
        pytest.fail("the greedy run repeats no token; pick a prompt that does")
    for extra in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"repetition_penalty": 2.0},
    ):
        penalized, _ = _ids(tiny, max_tokens=24, ignore_eos=True, **extra)
        assert penalized != base, extra
