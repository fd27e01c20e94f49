"""vLLM's extra request fields sent as the official openai client sends them (`extra_body`),
over real HTTP: honoured on the real tiny hf model (real forward passes) as `vllm serve`
honours them, or refused 400 naming the field and why; batched completions; the sim engine's
share (add_special_tokens, an untrusted chat template)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import openai
import pytest

from tests.engines.test_engine_vllm_fields import banning_words, occurs
from tests.gateway.conftest import MODEL, Stack, run_stack
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.engines.badwords import bad_words_token_ids
from tokenyard.engines.base import EngineTokenizer
from tokenyard.engines.hf_tokenizer import HFTokenizer

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

PROMPT = "Once upon a time there was"
MESSAGES = [{"role": "user", "content": "Once upon a time"}]
TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer() -> EngineTokenizer:
    from tokenyard.gateway.tokenizers import load_tokenizer

    return load_tokenizer("hf", "tiny")


def _wait_for_worker(stack: Stack, model: str) -> None:
    give_up = time.monotonic() + 60
    while not stack.call(stack.gateway_broker.registry.workers(model)):
        assert time.monotonic() < give_up, "the worker never sent a heartbeat"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def tiny(valkey: EmbeddedServer, tokenizer: EngineTokenizer) -> Iterator[openai.OpenAI]:
    from tokenyard.engines import make_engine

    with run_stack(
        valkey,
        model="tiny",
        tokenizer=tokenizer,
        engines=[lambda: make_engine("hf", model="tiny", max_seqs=8, max_tokens=8192)],
        worker_options={"engine": "hf"},
        trust_request_chat_template=True,
    ) as stack:
        _wait_for_worker(stack, "tiny")
        yield openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def sim_stack(valkey: EmbeddedServer) -> Iterator[Stack]:
    with run_stack(valkey) as stack:
        _wait_for_worker(stack, MODEL)
        yield stack


@pytest.fixture(scope="module")
def sim(sim_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=sim_stack.url + "/v1", api_key="unused", max_retries=0)


def _complete(client: openai.OpenAI, **extra: Any) -> Any:
    ask: dict[str, Any] = {
        "model": "tiny",
        "prompt": extra.pop("prompt", PROMPT),
        "max_tokens": extra.pop("max_tokens", 12),
        "temperature": extra.pop("temperature", 0.0),
    }
    return client.completions.create(
        **ask, extra_body={"return_token_ids": True, "cache": False, **extra}
    )


def _ids(choice: Any) -> list[int]:
    return list(choice.model_extra["token_ids"])


def _refused(call: Any, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as refused:
        call()
    body = refused.value.body
    assert isinstance(body, dict) and body["param"] == param, body
    assert body["type"] == "invalid_request_error"
    return str(body["message"])


def test_a_vllm_request_set_runs_unchanged(tiny: openai.OpenAI) -> None:
    """Every sampling field vLLM takes through extra_body at once, completions and chat."""
    extra = {
        "top_k": -1,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "min_tokens": 2,
        "stop_token_ids": [7],
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "truncate_prompt_tokens": 64,
        "allowed_token_ids": None,
        "bad_words": ["zebra"],
        "add_special_tokens": True,
        "return_tokens_as_token_ids": True,
        "cache_salt": "a-salt-of-43-characters-base64-encoded-0000",
        "priority": 0,
        "prompt_logprobs": None,
        "use_beam_search": False,
        "length_penalty": 1.0,
    }
    out = tiny.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, seed=3, logprobs=2, extra_body=extra
    )
    assert out.choices[0].text and out.usage is not None
    assert out.choices[0].logprobs is not None
    chat = tiny.chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=8,
        seed=3,
        extra_body={**extra, "add_special_tokens": False, "add_generation_prompt": True},
    )
    assert chat.choices[0].message.content


def test_allowed_token_ids_hold_every_token(tiny: openai.OpenAI) -> None:
    plain = _ids(_complete(tiny).choices[0])
    allowed = sorted({*plain[1:], 100, 200, 300} - {plain[0]})
    got = _ids(_complete(tiny, allowed_token_ids=allowed).choices[0])
    assert got and set(got) <= set(allowed)


def test_bad_words_keep_their_tokens_out(tiny: openai.OpenAI, tokenizer: EngineTokenizer) -> None:
    plain = _complete(tiny, max_tokens=16).choices[0]
    assert isinstance(tokenizer, HFTokenizer)
    words = banning_words(_ids(plain), tokenizer)
    assert words, plain.text
    out = _ids(_complete(tiny, max_tokens=16, bad_words=words).choices[0])
    assert out != _ids(plain)
    encode = partial(tokenizer.encode, add_special_tokens=False)
    assert not any(occurs(ids, out) for ids in bad_words_token_ids(words, encode))


def test_min_p_and_top_k_off_sample_as_vllm(tiny: openai.OpenAI) -> None:
    seeded = {"temperature": 1.8, "seed": 5, "max_tokens": 16}
    off = _ids(_complete(tiny, **seeded, top_k=-1).choices[0])
    assert off == _ids(_complete(tiny, **seeded, top_k=0).choices[0])
    assert off == _ids(_complete(tiny, **seeded).choices[0])
    assert _ids(_complete(tiny, **seeded, min_p=0.9).choices[0]) != off


def test_truncate_prompt_tokens_keeps_the_prompts_end(
    tiny: openai.OpenAI, tokenizer: EngineTokenizer
) -> None:
    ids = tokenizer.encode(PROMPT)
    assert len(ids) > 3
    cut = _complete(tiny, truncate_prompt_tokens=3)
    assert cut.usage is not None and cut.usage.prompt_tokens == 3
    same = _complete(tiny, prompt=ids[-3:])
    assert _ids(cut.choices[0]) == _ids(same.choices[0])
    right = _complete(tiny, truncate_prompt_tokens=3, truncation_side="right")
    assert _ids(right.choices[0]) == _ids(_complete(tiny, prompt=ids[:3]).choices[0])
    whole = _complete(tiny, truncate_prompt_tokens=-1)
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)
    _refused(lambda: _complete(tiny, truncate_prompt_tokens=0), "truncate_prompt_tokens")


def test_special_tokens_and_stop_strings_in_the_text(
    tiny: openai.OpenAI, tokenizer: EngineTokenizer
) -> None:
    user = tokenizer.encode("<|user|>")[-1]
    forced = {"logit_bias": {str(user): 100}, "ignore_eos": True, "max_tokens": 3}
    assert _complete(tiny, **forced).choices[0].text == ""
    shown = _complete(tiny, **forced, skip_special_tokens=False)
    assert shown.choices[0].text == "<|user|>" * 3
    bare = _complete(tiny, **forced, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert bare.choices[0].text == "<|user|>" * 3  # its decoder puts no spaces: the same
    text = _complete(tiny, max_tokens=16).choices[0].text
    stop = text.strip().split()[0][:3]
    cut = _complete(tiny, max_tokens=16, stop=[stop]).choices[0].text
    kept = _complete(tiny, max_tokens=16, stop=[stop], include_stop_str_in_output=True)
    assert kept.choices[0].text == cut + stop
    assert kept.choices[0].finish_reason == "stop"


def test_logprobs_name_tokens_by_id_when_asked(tiny: openai.OpenAI) -> None:
    out = _complete(tiny, logprobs=2, return_tokens_as_token_ids=True)
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in _ids(choice)]
    chat = tiny.chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    for entry in chat.choices[0].logprobs.content:
        assert entry.token.startswith("token_id:")
        assert all(t.token.startswith("token_id:") for t in entry.top_logprobs)


def test_chat_template_switches(tiny: openai.OpenAI, tokenizer: EngineTokenizer) -> None:
    def prompt_tokens(**extra: Any) -> int:
        chat = tiny.chat.completions.create(
            model="tiny",
            messages=extra.pop("messages", MESSAGES),
            max_tokens=2,
            temperature=0.0,
            extra_body={"cache": False, **extra},
        )
        assert chat.usage is not None
        return chat.usage.prompt_tokens

    def rendered(**kw: Any) -> int:
        return len(tokenizer.encode(tokenizer.apply_chat_template(kw.pop("messages"), **kw)))

    assert prompt_tokens() == rendered(messages=MESSAGES)
    assert prompt_tokens(add_generation_prompt=False) == rendered(
        messages=MESSAGES, add_generation_prompt=False
    )
    opened = [*MESSAGES, {"role": "assistant", "content": "there was a"}]
    assert prompt_tokens(
        messages=opened, add_generation_prompt=False, continue_final_message=True
    ) == rendered(messages=opened, add_generation_prompt=False, continue_final_message=True)
    _refused(lambda: prompt_tokens(continue_final_message=True), "continue_final_message")
    # a request's own template: the same answer as that text sent to /v1/completions
    own = tiny.chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0.0,
        extra_body={"chat_template": TEMPLATE, "cache": False},
    )
    as_text = _complete(tiny, prompt="[Once upon a time]", max_tokens=8)
    assert own.choices[0].message.content == as_text.choices[0].text
    _refused(
        lambda: tiny.chat.completions.create(
            model="tiny",
            messages=MESSAGES,  # type: ignore[arg-type]
            extra_body={"chat_template": "{% for %}"},
        ),
        "chat_template",
    )


def test_batched_prompts_are_choices_prompt_major(tiny: openai.OpenAI) -> None:
    prompts = [PROMPT, "The queue holds", "0 1 2"]
    batched = _complete(tiny, prompt=prompts, n=2, seed=9, temperature=1.0, max_tokens=6)
    assert [c.index for c in batched.choices] == list(range(6))
    usage = 0
    for i, prompt in enumerate(prompts):
        alone = _complete(tiny, prompt=prompt, n=2, seed=9, temperature=1.0, max_tokens=6)
        assert [_ids(c) for c in alone.choices] == [_ids(c) for c in batched.choices[2 * i :][:2]]
        assert alone.usage is not None
        usage += alone.usage.prompt_tokens
    assert batched.usage is not None and batched.usage.prompt_tokens == usage
    # streamed: each choice's chunks under its own index, the same text
    texts: dict[int, str] = {}
    stream = tiny.completions.create(
        model="tiny",
        prompt=prompts,
        max_tokens=6,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    last_usage = None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        last_usage = chunk.usage or last_usage
    whole = _complete(tiny, prompt=prompts, max_tokens=6)
    assert texts == {c.index: c.text for c in whole.choices}
    assert last_usage is not None and whole.usage is not None
    assert last_usage.prompt_tokens == whole.usage.prompt_tokens
    # token-id prompts batch too; echo shows each choice its own prompt
    ids = [[5, 6, 7], [8, 9]]
    echoed = _complete(tiny, prompt=ids, echo=True, max_tokens=2)
    assert len(echoed.choices) == 2
    for choice, alone in zip(echoed.choices, ids, strict=True):
        assert choice.text == _complete(tiny, prompt=alone, echo=True, max_tokens=2).choices[0].text


def test_prompt_logprobs_as_vllm_shows_them(
    tiny: openai.OpenAI, tokenizer: EngineTokenizer
) -> None:
    ids = tokenizer.encode(PROMPT)
    out = _complete(tiny, prompt_logprobs=2, max_tokens=2)
    shown = out.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(shown) == len(ids) and shown[0] is None
    for token, position in zip(ids[1:], shown[1:], strict=True):
        assert str(token) in position
        assert sorted(p["rank"] for p in position.values() if p["rank"] <= 2) == [1, 2]
        for p in position.values():
            assert p["logprob"] <= 0 and isinstance(p["decoded_token"], str)
        best = max(position.values(), key=lambda p: p["logprob"])
        assert best["rank"] == 1
    chat = tiny.chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    assert chat.usage is not None
    whole = chat.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(whole) == chat.usage.prompt_tokens and whole[0] is None
    assert all(len(p) == 1 for p in whole[1:])  # only the prompt's own token
    _refused(
        lambda: tiny.completions.create(
            model="tiny", prompt=PROMPT, stream=True, extra_body={"prompt_logprobs": 1}
        ),
        "prompt_logprobs",
    )


def test_echo_with_logprobs_shows_the_prompts_first(
    tiny: openai.OpenAI, tokenizer: EngineTokenizer
) -> None:
    ids = tokenizer.encode(PROMPT)
    plain = _complete(tiny, logprobs=2, max_tokens=4).choices[0]
    echoed = _complete(tiny, logprobs=2, max_tokens=4, echo=True).choices[0]
    assert echoed.text == PROMPT + plain.text
    lp, gen = echoed.logprobs, plain.logprobs
    assert lp is not None and gen is not None and lp.tokens is not None
    assert lp.tokens == [tokenizer.token_text(t) for t in ids] + (gen.tokens or [])
    assert lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[len(ids) :] == gen.token_logprobs
    # the prompt's part: each token among its position's alternatives, the first without
    n = len(ids)
    for token, logprob, top in zip(
        lp.tokens[1:n], lp.token_logprobs[1:n], lp.top_logprobs[1:n], strict=True
    ):
        assert top is not None and top[token] == logprob
    offsets = lp.text_offset or []
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert echoed.model_extra["prompt_logprobs"][0] is None  # type: ignore[index]


def test_cache_salt_keeps_cached_answers_apart(tiny: openai.OpenAI) -> None:
    def cache_header(salt: str | None) -> str:
        extra = {} if salt is None else {"cache_salt": salt}
        raw = tiny.completions.with_raw_response.create(
            model="tiny", prompt="salted prompt", max_tokens=4, temperature=0.0, extra_body=extra
        )
        return raw.headers["x-cache"]

    assert cache_header("one") in ("miss", "collapsed")
    assert cache_header("one") == "hit"
    assert cache_header("two") in ("miss", "collapsed")
    assert cache_header(None) in ("miss", "collapsed")


def test_priority_as_vllm_takes_it(tiny: openai.OpenAI) -> None:
    for priority in (0, 7):
        assert _complete(tiny, priority=priority, max_tokens=2).choices
    # below 0 asks for the high lane: without tiers, refused rather than run at normal
    _refused(lambda: _complete(tiny, priority=-1), "priority")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_beam_search", True),
        ("length_penalty", 0.5),
        ("request_id", "abc"),
        ("repetition_detection", {"max_pattern_size": 4}),
        ("kv_transfer_params", {"x": 1}),
    ],
)
def test_fields_not_served_are_refused_by_name_with_why(
    tiny: openai.OpenAI, field: str, value: Any
) -> None:
    message = _refused(lambda: _complete(tiny, **{field: value}), field)
    assert "(" in message and "not supported" in message, message


def test_the_sim_adds_special_tokens_when_asked(sim: openai.OpenAI) -> None:
    def tokens(**extra: Any) -> int:
        out = sim.completions.create(model=MODEL, prompt="abc", max_tokens=1, extra_body=extra)
        assert out.usage is not None
        return out.usage.prompt_tokens

    assert tokens() == tokens(add_special_tokens=False) == 3
    assert tokens(add_special_tokens=True) == 4  # its BOS


def test_a_requests_chat_template_needs_the_servers_trust(sim: openai.OpenAI) -> None:
    message = _refused(
        lambda: sim.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            extra_body={"chat_template": TEMPLATE},
        ),
        "chat_template",
    )
    assert "TRUST_REQUEST_CHAT_TEMPLATE" in message


def test_a_job_read_later_takes_one_prompt(sim_stack: Stack) -> None:
    with sim_stack.client() as http:
        several = http.post("/v1/jobs", json={"model": MODEL, "prompt": ["a", "b"]})
        assert several.status_code == 400
        assert several.json()["error"]["param"] == "prompt"
        one = http.post("/v1/jobs", json={"model": MODEL, "prompt": ["a"], "priority": 3})
        assert one.status_code == 202, one.text
        assert one.json()["priority"] == "low"  # vLLM's integer above 0
