"""Structured outputs at the gateway: each way a request names a constraint becomes one Guide,
two are refused, and xgrammar's verdict (bounded in time) is the client's 400."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import Any

import anyio
import pytest

from tokenyard.errors import InvalidRequest
from tokenyard.gateway import structured
from tokenyard.gateway.errors import ApiError
from tokenyard.gateway.protocol import ChatCompletionRequest, CompletionRequest
from tokenyard.messages import Guide

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CANONICAL = json.dumps(SCHEMA, separators=(",", ":"))


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    )


@pytest.mark.parametrize(
    ("fields", "guide", "param"),
    [
        ({"response_format": {"type": "json_object"}}, Guide(json_object=True), "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": SCHEMA},
                }
            },
            Guide(json=CANONICAL),
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
            Guide(json='{"type":"object"}'),
            "response_format",
        ),
        (
            {"structured_outputs": {"json": SCHEMA}},
            Guide(json=CANONICAL),
            "structured_outputs.json",
        ),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA)}},
            Guide(json=CANONICAL),
            "structured_outputs.json",
        ),
        ({"structured_outputs": {"regex": "a+"}}, Guide(regex="a+"), "structured_outputs.regex"),
        (
            {"structured_outputs": {"choice": ["a", "b"], "json_object": False}},
            Guide(choice=("a", "b")),
            "structured_outputs.choice",
        ),
        (
            {"structured_outputs": {"json_object": True, "whitespace_pattern": None}},
            Guide(json_object=True),
            "structured_outputs.json_object",
        ),
        ({"guided_json": SCHEMA}, Guide(json=CANONICAL), "guided_json"),
        ({"guided_regex": "[0-9]+"}, Guide(regex="[0-9]+"), "guided_regex"),
        ({"guided_choice": ["x"]}, Guide(choice=("x",)), "guided_choice"),
        ({"guided_grammar": 'root ::= "a"'}, Guide(grammar='root ::= "a"'), "guided_grammar"),
    ],
)
def test_each_spelling_is_one_guide(fields: dict[str, Any], guide: Guide, param: str) -> None:
    assert structured.guide_of(_chat(**fields)) == (guide, param)
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})
    assert structured.guide_of(completion) == (guide, param)


def test_no_constraint() -> None:
    assert structured.guide_of(_chat()) is None
    assert structured.guide_of(_chat(response_format={"type": "text"})) is None
    assert structured.guide_of(_chat(structured_outputs={})) is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
        ({"response_format": {}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
            "response_format.json_schema.name",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": "{}"},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "strict": 1}}},
            "response_format.json_schema.strict",
        ),
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        ({"structured_outputs": {"json": 0}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": "{"}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice"),
        ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object"),
        ({"structured_outputs": {"backend": "outlines"}}, "structured_outputs.backend"),
        ({"structured_outputs": {"other": 0}}, "structured_outputs.other"),
        ({"guided_choice": []}, "guided_choice"),
    ],
)
def test_malformed_or_several_are_400(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        structured.guide_of(_chat(**fields))
    assert refused.value.param == param


@pytest.mark.parametrize(
    ("guide", "says"),
    [
        (Guide(json='{"type":"frob"}'), 'Unsupported type "frob"'),
        (Guide(regex="(?=a)b"), "Lookahead"),
        (Guide(grammar="root ::= x"), 'Rule "x" is not defined'),
    ],
)
def test_what_xgrammar_cannot_convert_is_400(guide: Guide, says: str) -> None:
    pytest.importorskip("xgrammar")
    with pytest.raises(InvalidRequest) as refused:
        anyio.run(structured.check, guide, "response_format")
    assert refused.value.param == "response_format"
    assert says in refused.value.message and ".cc:" not in refused.value.message


def test_what_converts_passes() -> None:
    for guide in (
        Guide(json=CANONICAL),
        Guide(json_object=True),
        Guide(regex="[0-9]{3}"),
        Guide(choice=("a",)),
        Guide(grammar='root ::= "a" | "b"'),
    ):
        anyio.run(structured.check, guide, "response_format")


def test_a_slow_conversion_is_refused_in_bounded_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Guide] = []

    def slow(guide: Guide) -> None:
        calls.append(guide)
        time.sleep(2)

    monkeypatch.setattr(structured, "CHECK_TIMEOUT_S", 0.2)
    monkeypatch.setattr(structured, "_problem", slow)
    monkeypatch.setattr(structured, "_verdicts", OrderedDict())
    monkeypatch.setattr(structured, "_timeouts", {})
    for _ in range(2):  # the second time, the remembered timeout: no thread
        started = time.monotonic()
        with pytest.raises(InvalidRequest) as refused:
            anyio.run(structured.check, Guide(regex="a"), "structured_outputs.regex")
        assert time.monotonic() - started < 1.5
        assert refused.value.param == "structured_outputs.regex"
        assert "within" in refused.value.message
    assert calls == [Guide(regex="a")]


def test_the_schema_openai_parse_sends_compiles() -> None:
    # client.chat.completions.parse(response_format=Model) sends this strict schema
    from typing import Literal

    from openai.lib._pydantic import to_strict_json_schema
    from pydantic import BaseModel

    class Answer(BaseModel):
        answer: Literal["yes", "no"]
        count: int
        tags: list[str]

    body = _chat(
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "Answer",
                "schema": to_strict_json_schema(Answer),
                "strict": True,
            },
        }
    )
    found = structured.guide_of(body)
    assert found is not None
    anyio.run(structured.check, *found)


def test_a_timeout_is_remembered_for_a_while_only_and_running_checks_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    calls: list[Guide] = []

    def stuck(guide: Guide) -> None:
        calls.append(guide)
        release.wait(10)

    monkeypatch.setattr(structured, "CHECK_TIMEOUT_S", 0.1)
    monkeypatch.setattr(structured, "TIMEOUT_KEPT_S", 0.0)  # not kept: tried again next time
    monkeypatch.setattr(structured, "_problem", stuck)
    monkeypatch.setattr(structured, "_verdicts", OrderedDict())
    monkeypatch.setattr(structured, "_timeouts", {})
    monkeypatch.setattr(structured, "_RUNNING", threading.BoundedSemaphore(2))
    try:
        for i in range(2):  # two abandoned conversions hold both places
            with pytest.raises(InvalidRequest):
                anyio.run(structured.check, Guide(regex=f"a{i}"), "response_format")
        # no place within the bound: 503 to retry, not another thread
        with pytest.raises(ApiError) as busy:
            anyio.run(structured.check, Guide(regex="b"), "response_format")
        assert busy.value.status == 503
        assert len(calls) == 2
    finally:
        release.set()
    time.sleep(0.2)  # the abandoned threads end and give their places back
    release.clear()
    try:
        with pytest.raises(InvalidRequest):  # tried again (its timeout was not kept): no 503
            anyio.run(structured.check, Guide(regex="a0"), "response_format")
    finally:
        release.set()
    assert calls.count(Guide(regex="a0")) == 2
