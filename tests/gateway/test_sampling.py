"""The OpenAI surface for sampling and output fields, through the official openai client:
what is accepted and refused (each refusal a 400 naming its parameter), logprobs in OpenAI's
shapes (whole, streamed, cached, on the jobs API), `n` choices fanned out into jobs, echo,
structured outputs checked before a job is queued, and the Batch API carrying the same fields.

A sim engine that declares every feature (tests/gateway/featured.py, made-up logprobs) stands
behind most of it; what the model's values decide is tested on the tiny hf model
(test_sampling_tiny.py). The plain sim engine declares no feature: it refuses them by name.
"""

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

from tests.gateway.conftest import MODEL, Stack, run_stack
from tests.gateway.featured import alternatives, featured_engine, made_up_logprob
from tests.gateway.sse import events
from tests.gateway.test_disconnect import wait_status
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.engines.sim import SimTokenizer
from tokenyard.messages import JobStatus

MESSAGES = [{"role": "user", "content": "Once upon a time"}]
TOK = SimTokenizer()


@pytest.fixture(scope="module")
def featured(valkey: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    files = tmp_path_factory.mktemp("files")
    with run_stack(valkey, engines=[featured_engine()], files_dir=str(files), max_n=8) as s:
        _wait_for_worker(s)
        yield s


@pytest.fixture(scope="module")
def plain(valkey: EmbeddedServer) -> Iterator[Stack]:
    with run_stack(valkey) as s:
        _wait_for_worker(s)
        yield s


def _wait_for_worker(stack: Stack) -> None:
    # the limits rule reads the features the worker publishes
    give_up = time.monotonic() + 10
    while not stack.call(stack.gateway_broker.registry.workers(MODEL)):
        assert time.monotonic() < give_up, "the worker never sent a heartbeat"
        time.sleep(0.05)


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def _refused(call: Any, param: str) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as refused:
        call()
    assert refused.value.status_code == 400
    body = refused.value.body
    assert isinstance(body, dict) and body["param"] == param, body
    assert body["type"] == "invalid_request_error"
    return refused.value


# -- logprobs ---------------------------------------------------------------------------------
def test_chat_logprobs_whole_and_streamed(featured: Stack) -> None:
    c = _client(featured)
    whole = c.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert "".join(e.token for e in content) == choice.message.content
    for entry in content:
        token_id = TOK.encode(entry.token)[0]
        assert entry.logprob == pytest.approx(made_up_logprob(token_id))
        assert entry.bytes == list(entry.token.encode())
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [v for _, v in alternatives(token_id, 3)]
        )
        assert entry.top_logprobs[0].token == entry.token  # the chosen one is the most likely

    stream = c.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        extra_body={"cache": False},
    )
    streamed = [
        e
        for ch in stream
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content or []
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]

    # logprobs: true alone: each token's own, no alternatives
    bare = c.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0.0, logprobs=True
    )
    assert bare.choices[0].logprobs is not None
    assert [e.top_logprobs for e in bare.choices[0].logprobs.content or []] == [[], [], []]
    # not asked: null, as OpenAI
    none = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert none.choices[0].logprobs is None


def test_completion_logprobs_legacy_shape_and_offsets(featured: Stack) -> None:
    c = _client(featured)
    whole = c.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0.0, logprobs=2
    )
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    text = whole.choices[0].text
    assert "".join(lp.tokens) == text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs or [], lp.top_logprobs, strict=True):
        assert top[token] == value == max(top.values())
        assert len(top) <= 2
    streamed = list(
        c.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=8,
            temperature=0.0,
            logprobs=2,
            stream=True,
        )
    )
    tokens = [
        t
        for ch in streamed
        if ch.choices and ch.choices[0].logprobs
        for t in ch.choices[0].logprobs.tokens or []
    ]
    offsets = [
        o
        for ch in streamed
        if ch.choices and ch.choices[0].logprobs
        for o in ch.choices[0].logprobs.text_offset or []
    ]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_logprobs_bounds_and_the_engine_without_them(featured: Stack, plain: Stack) -> None:
    c = _client(featured)
    _refused(
        lambda: c.chat.completions.create(
            model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=21
        ),
        "top_logprobs",
    )
    _refused(
        lambda: c.chat.completions.create(model=MODEL, messages=MESSAGES, top_logprobs=2),
        "top_logprobs",
    )
    _refused(lambda: c.completions.create(model=MODEL, prompt="x", logprobs=21), "logprobs")
    # the plain sim engine has no logprobs: refused by name, naming the engine
    p = _client(plain)
    refused = _refused(
        lambda: p.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True),
        "logprobs",
    )
    assert "sim engine" in refused.message and refused.code == "unsupported_parameter"
    _refused(lambda: p.completions.create(model=MODEL, prompt="x", logprobs=1), "logprobs")
    # the rest it honours on its made-up distribution (the rule naming each refused feature's
    # parameter: tests/unit/test_decoding_limits.py)
    for field, value in [
        ("presence_penalty", 0.5),
        ("frequency_penalty", 0.5),
        ("repetition_penalty", 1.1),
        ("logit_bias", {"100": 5}),
        ("min_tokens", 2),
        ("stop_token_ids", [5]),
        ("response_format", {"type": "json_object"}),
    ]:
        p.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={field: value})


# -- the other sampling fields ---------------------------------------------------------------
def test_sampling_fields_are_accepted_and_carried_to_the_job(featured: Stack) -> None:
    c = _client(featured)
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=5,
        temperature=0.5,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"100": 5, "-0": -1},
        extra_body={
            "repetition_penalty": 1.2,
            "min_tokens": 2,
            "stop_token_ids": [7, 5],
            "top_k": 4,
        },
    )
    job = raw.headers["x-job-id"]
    sampling = featured.call(featured.gateway_broker.queue.record(job)).spec.sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -0.5)
    assert sampling.repetition_penalty == 1.2 and sampling.min_tokens == 2
    assert sampling.logit_bias == ((0, -1.0), (100, 5.0))
    assert sampling.stop_token_ids == (7, 5) and sampling.seed == 3 and sampling.max_tokens == 5
    assert sampling.logprobs is None and sampling.guide is None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": -100.5}}, "logit_bias"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),  # past the vocabulary
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 9}, "min_tokens"),  # above max_tokens
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop_token_ids": [100000]}, "stop_token_ids"),
        ({"n": 10000}, "n"),
        ({"n": 9}, "n"),  # the stack's max_n is 8
        ({"n": 0}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"echo": True, "logprobs": 1, "stream": True}, "logprobs"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"allowed_token_ids": [100000]}, "allowed_token_ids"),  # past the vocabulary
        ({"bad_words": [" "]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncation_side": "left"}, "truncation_side"),  # without truncate_prompt_tokens
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),  # vLLM's whole vocabulary
        ({"cache_salt": ""}, "cache_salt"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"suffix": "x"}, "suffix"),
    ],
)
def test_bad_values_are_400_naming_the_param(
    featured: Stack, extra: dict[str, Any], param: str
) -> None:
    c = _client(featured)
    _refused(
        lambda: c.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body=extra),
        param,
    )


# -- n ----------------------------------------------------------------------------------------
def test_n_choices_each_its_own_seeded_job(featured: Stack) -> None:
    c = _client(featured)
    ask = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    raw = c.chat.completions.with_raw_response.create(n=4, **ask)  # type: ignore[call-overload]
    whole = raw.parse()
    assert [ch.index for ch in whole.choices] == [0, 1, 2, 3]
    texts = [ch.message.content for ch in whole.choices]
    assert len(set(texts)) == 4  # seeds 11, 12, 13, 14
    jobs = raw.headers["x-job-id"].split(",")
    assert len(jobs) == 4
    seeds = [
        featured.call(featured.gateway_broker.queue.record(j)).spec.sampling.seed for j in jobs
    ]
    assert seeds == [11, 12, 13, 14]
    # a seeded choice is the same answer as the one-choice call with its seed
    third = c.chat.completions.create(**{**ask, "seed": 13})  # type: ignore[call-overload]
    assert third.choices[0].message.content == texts[2]
    assert whole.usage is not None and third.usage is not None
    assert whole.usage.prompt_tokens == third.usage.prompt_tokens  # counted once
    assert whole.usage.completion_tokens == 4 * 6
    again = c.chat.completions.create(n=4, **ask)  # type: ignore[call-overload]
    assert [ch.message.content for ch in again.choices] == texts

    stream = c.chat.completions.create(
        n=4, stream=True, stream_options={"include_usage": True}, **ask
    )  # type: ignore[call-overload]
    chunks = list(stream)
    by_index: dict[int, str] = {}
    finished: set[int] = set()
    for ch in chunks:
        for choice in ch.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished.add(choice.index)
    assert [by_index[i] for i in range(4)] == texts and finished == {0, 1, 2, 3}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
    assert len({ch.id for ch in chunks}) == 1

    completions = c.completions.create(
        model=MODEL, prompt="abc", max_tokens=4, n=3, best_of=3, seed=5, logprobs=1
    )
    assert [ch.index for ch in completions.choices] == [0, 1, 2]
    assert all(ch.logprobs and ch.logprobs.tokens for ch in completions.choices)


def test_a_failing_choice_fails_the_call(featured: Stack) -> None:
    c = _client(featured)
    # the sim fails a prompt carrying its marker (on every attempt): the call fails with it
    with pytest.raises(openai.InternalServerError) as failed:
        c.completions.create(model=MODEL, prompt="[[fail]]", max_tokens=4, n=3, seed=1)
    assert failed.value.code == "job_dead"
    with pytest.raises(openai.APIError) as streamed:
        list(
            c.completions.create(
                model=MODEL, prompt="[[fail]]", max_tokens=4, n=3, seed=1, stream=True
            )
        )
    assert "every attempt" in streamed.value.message


def test_n_refused_where_one_job_answers(featured: Stack) -> None:
    with httpx.Client(base_url=featured.url) as http:
        r = http.post("/v1/jobs", json={"model": MODEL, "prompt": "x", "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


# -- echo -------------------------------------------------------------------------------------
def test_echo_puts_the_prompt_before_the_output(featured: Stack) -> None:
    c = _client(featured)
    plain = c.completions.create(model=MODEL, prompt="Echo me", max_tokens=4, temperature=0.0)
    echoed = c.completions.create(
        model=MODEL, prompt="Echo me", max_tokens=4, temperature=0.0, echo=True
    )
    assert echoed.choices[0].text == "Echo me" + plain.choices[0].text
    streamed = c.completions.create(
        model=MODEL, prompt="Echo me", max_tokens=4, temperature=0.0, echo=True, stream=True
    )
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == echoed.choices[0].text
    ids = c.completions.create(
        model=MODEL, prompt=TOK.encode("Echo me"), max_tokens=4, temperature=0.0, echo=True
    )
    assert ids.choices[0].text == echoed.choices[0].text


# -- structured outputs -----------------------------------------------------------------------
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_object"}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": SCHEMA},
            }
        },
        {"response_format": {"type": "text"}},
        {"structured_outputs": {"json": SCHEMA}},
        {"structured_outputs": {"regex": "[0-9]{3}"}},
        {"structured_outputs": {"choice": ["yes", "no"]}},
        {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
        {"guided_json": json.dumps(SCHEMA)},
        {"guided_regex": "a+"},
        {"guided_choice": ["x"]},
        {"guided_grammar": 'root ::= "a"'},
    ],
)
def test_structured_outputs_accepted(featured: Stack, extra: dict[str, Any]) -> None:
    c = _client(featured)
    raw = c.completions.with_raw_response.create(
        model=MODEL, prompt="x", max_tokens=2, extra_body=extra
    )
    record = featured.call(featured.gateway_broker.queue.record(raw.headers["x-job-id"]))
    guide = record.spec.sampling.guide
    assert (guide is None) == (extra == {"response_format": {"type": "text"}})


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"type": "frob"}},
                }
            },
            "response_format",
            "frob",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "p",
                        "schema": {"properties": {"a": {"$ref": "#/nowhere"}}},
                    },
                }
            },
            "response_format",
            "nowhere",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema.name",
            "name",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
        ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex", "parenthesis"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar", "x"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
        ({"guided_json": "{not json"}, "guided_json", "JSON"),
        (
            {"structured_outputs": {"regex": "a", "json": SCHEMA}},
            "structured_outputs.regex",
            "one",
        ),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "Only one",
        ),
        (
            {"structured_outputs": {"whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
            "not supported",
        ),
    ],
)
def test_bad_structured_outputs_are_400_before_a_job(
    featured: Stack, extra: dict[str, Any], param: str, says: str
) -> None:
    c = _client(featured)
    before = len(featured.job_ids())
    refused = _refused(
        lambda: c.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=extra
        ),
        param,
    )
    assert says in refused.message
    assert len(featured.job_ids()) == before


# -- the cache, the jobs API, batches ---------------------------------------------------------
def test_requests_differing_in_a_new_field_never_share_an_answer(featured: Stack) -> None:
    c = _client(featured)
    base = {"model": MODEL, "prompt": "cache me", "max_tokens": 4, "temperature": 0.0}
    first = c.completions.with_raw_response.create(**base)  # type: ignore[call-overload]
    assert first.headers["x-cache"] in ("miss", "collapsed")
    assert c.completions.with_raw_response.create(**base).headers["x-cache"] == "hit"  # type: ignore[call-overload]
    for extra in [
        {"logprobs": 1},
        {"logprobs": 2},
        {"presence_penalty": 0.1},
        {"logit_bias": {"100": 1}},
        {"min_tokens": 1},
        {"stop_token_ids": [9]},
        {"response_format": {"type": "json_object"}},
        {"min_p": 0.1},
        {"allowed_token_ids": [100, 101]},
        {"bad_words": ["q"]},
        {"skip_special_tokens": False},
        {"include_stop_str_in_output": True},
        {"cache_salt": "salt"},
        {"prompt_logprobs": 1},
    ]:
        raw = c.completions.with_raw_response.create(**base, extra_body=extra)  # type: ignore[call-overload]
        assert raw.headers["x-cache"] == "miss", extra
        if "logprobs" in extra:
            lp = raw.parse().choices[0].logprobs
            assert lp is not None and max(map(len, lp.top_logprobs or [])) <= extra["logprobs"]
    # a cached answer with logprobs renders them as the fresh one did
    fresh = c.completions.create(**base, logprobs=2)  # type: ignore[call-overload]
    cached = c.completions.with_raw_response.create(**base, logprobs=2)  # type: ignore[call-overload]
    assert cached.headers["x-cache"] == "hit"
    assert cached.parse().choices[0].logprobs == fresh.choices[0].logprobs


def test_jobs_api_token_events_carry_logprobs_and_resume_with_them(featured: Stack) -> None:
    body = {"model": MODEL, "prompt": "jobs", "max_tokens": 5, "temperature": 0.0, "logprobs": 2}
    with httpx.Client(base_url=featured.url, timeout=30) as http:
        job = http.post("/v1/jobs", json=body).json()["id"]
        with http.stream("GET", f"/v1/jobs/{job}/events") as r:
            seen = list(events(r))
        tokens = [e for e in seen if e.event == "tokens"]
        entries = [x for e in tokens for x in e.json()["logprobs"]]
        assert len(entries) == 5
        assert all(x["top_logprobs"][0]["token"] == x["token"] for x in entries)
        # resume after the first event: the rest, logprobs included
        after = tokens[0].id
        with http.stream("GET", f"/v1/jobs/{job}/events", headers={"Last-Event-ID": after}) as r:
            rest = [e for e in events(r) if e.event == "tokens"]
        assert [x for e in rest for x in e.json()["logprobs"]] == [
            x for e in tokens[1:] for x in e.json()["logprobs"]
        ]
        # the OpenAI view of the same job renders them in the completions shape
        with http.stream("GET", f"/v1/jobs/cmpl-{job}/events") as r:
            chunks = [e.json() for e in events(r) if e.data != "[DONE]"]
        names = [
            t
            for ch in chunks
            if ch["choices"] and ch["choices"][0]["logprobs"]
            for t in ch["choices"][0]["logprobs"]["tokens"]
        ]
        assert names == [x["token"] for x in entries]


def test_a_resumed_completion_stream_keeps_its_text_offsets(featured: Stack) -> None:
    body = {"model": MODEL, "prompt": "jobs", "max_tokens": 6, "temperature": 0.0, "logprobs": 1}
    with httpx.Client(base_url=featured.url, timeout=30) as http:
        path = f"/v1/jobs/cmpl-{http.post('/v1/jobs', json=body).json()['id']}/events"

        def read(after: str = "0") -> list[tuple[str | None, Any]]:
            with http.stream("GET", path, headers={"Last-Event-ID": after}) as r:
                return [(e.id, e.json()) for e in events(r) if e.data != "[DONE]"]

        whole = read()
        offsets = [
            o
            for _, ch in whole
            if ch["choices"] and ch["choices"][0]["logprobs"]
            for o in ch["choices"][0]["logprobs"]["text_offset"]
        ]
        assert len(offsets) == 6 and offsets == sorted(offsets) and offsets[0] == 0
        # resumed after any event: the offsets go on from where the text stood, not from 0
        for at, (event_id, _) in enumerate(whole):
            if event_id is not None:
                assert whole[: at + 1] + read(event_id) == whole, event_id


def test_batch_lines_carry_the_new_fields(featured: Stack) -> None:
    c = _client(featured)
    rows = [
        {
            "custom_id": "lp",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": MESSAGES,
                "max_tokens": 3,
                "temperature": 0.0,
                "logprobs": True,
                "top_logprobs": 2,
            },
        },
        {
            "custom_id": "rf",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": MESSAGES,
                "max_tokens": 3,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": SCHEMA},
                },
            },
        },
    ]
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    up = c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = c.batches.create(
        input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    give_up = time.monotonic() + 60
    while (batch := c.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < give_up
        time.sleep(0.1)
    assert batch.status == "completed" and batch.output_file_id is not None, batch
    lines = {
        x["custom_id"]: x["response"]["body"]
        for x in map(json.loads, c.files.content(batch.output_file_id).text.splitlines())
    }
    content = lines["lp"]["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(e["top_logprobs"]) == 2 for e in content)
    job = featured.call(featured.gateway_broker.queue.record(lines["rf"]["id"][len("chatcmpl-") :]))
    assert job.spec.sampling.guide is not None and job.spec.sampling.guide.json is not None

    # a line asking for two choices, or with a malformed constraint, fails the batch up front
    bad = [
        {**rows[0], "body": {**rows[0]["body"], "n": 2}},
        {
            **rows[1],
            "custom_id": "x",
            "body": {**rows[1]["body"], "response_format": {"type": "yaml"}},
        },
    ]
    data = b"".join(json.dumps(r).encode() + b"\n" for r in bad)
    up = c.files.create(file=("bad.jsonl", io.BytesIO(data)), purpose="batch")
    batch = c.batches.create(
        input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    give_up = time.monotonic() + 30
    while (batch := c.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < give_up
        time.sleep(0.1)
    assert batch.status == "failed" and batch.errors is not None
    assert [(e.line, e.param) for e in batch.errors.data] == [
        (1, "n"),
        (2, "response_format.type"),
    ]


def test_the_document_describes_the_new_fields(featured: Stack, tmp_path: Path) -> None:
    with httpx.Client(base_url=featured.url) as http:
        doc = http.get("/openapi.json").json()
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    completion = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    for name in (
        "logprobs",
        "top_logprobs",
        "n",
        "presence_penalty",
        "logit_bias",
        "response_format",
        "structured_outputs",
        "min_tokens",
        "stop_token_ids",
    ):
        assert name in chat and "enum" not in chat[name], name
    assert "echo" in completion and "best_of" in completion


# -- the client leaving -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def slow(valkey: EmbeddedServer) -> Iterator[Stack]:
    # 20 tokens/s: a 200-token choice would run 10 s
    with run_stack(valkey, engines=[featured_engine(step_s=0.05)]) as s:
        _wait_for_worker(s)
        yield s


def test_leaving_a_streamed_call_cancels_every_choice(slow: Stack) -> None:
    body = {
        "model": MODEL,
        "prompt": "stream me",
        "max_tokens": 200,
        "n": 3,
        "seed": 1,
        "stream": True,
    }
    with slow.client() as http, http.stream("POST", "/v1/completions", json=body) as response:
        jobs = response.headers["x-job-id"].split(",")
        assert len(jobs) == 3
        for ev in events(response):
            assert ev.id is None  # several jobs' events: no one id resumes the stream
            break
    for job in jobs:
        wait_status(slow, job, JobStatus.CANCELLED, timeout=5.0)


def test_leaving_a_whole_call_cancels_every_choice(slow: Stack) -> None:
    body = {"model": MODEL, "prompt": "wait for me", "max_tokens": 200, "n": 2, "seed": 9}
    before = set(slow.job_ids())
    with slow.client(timeout=0.6) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body)
    jobs = set(slow.job_ids()) - before
    assert len(jobs) == 2
    for job in jobs:
        wait_status(slow, job, JobStatus.CANCELLED, timeout=5.0)
