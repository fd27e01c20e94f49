"""The tool-call parsers on fixed texts, whole and streamed split at every character."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable

import pytest

from tokenyard.gateway.tools import (
    CallDelta,
    ContentDelta,
    Delta,
    Parsed,
    ToolCallStream,
    ToolParserError,
    choose_parser,
    new_call_id,
    parse_whole,
    tool_call_stream,
)

WEATHER = '{"city": "Paris", "days": [1, {"unit": "°C}]"}]}'


def _ids() -> Callable[[], str]:
    count = itertools.count()
    return lambda: f"call_{next(count)}"


def whole(parser: str, text: str) -> Parsed:
    return parse_whole(tool_call_stream(parser, make_id=_ids()), text)


def calls_of(parsed: Parsed) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in parsed.calls]


def streamed(parser: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[Delta]]:
    """The content and calls a stream of `pieces` gives, reassembled as a client would."""
    stream = tool_call_stream(parser, make_id=_ids())
    deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if isinstance(d, CallDelta):
            if d.id is not None:
                assert d.index not in calls and d.arguments == "" and d.name
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
    return content, [(n, a) for n, a in calls.values()], deltas


CASES = [
    # (parser, text, content, calls)
    (
        "hermes",
        f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n'
        '</tool_call>\n<tool_call>{"arguments": {"q": "a\\"b"}, "name": "search"}</tool_call>',
        "Let me look.",
        [("get_weather", WEATHER), ("search", '{"q": "a\\"b"}')],
    ),
    (
        "hermes",
        '<tool_call>{"name": "now"}</tool_call>',
        None,
        [("now", "{}")],
    ),
    ("hermes", "Just text, <tool and all >  \n", "Just text, <tool and all >  \n", []),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
        None,
        [("a", '{"x": 1}'), ("b", "{}")],
    ),
    (
        "llama3_json",
        '  {"name": "a", "parameters": {"x": [1, 2]}}',
        None,
        [("a", '{"x": [1, 2]}')],
    ),
    ("llama3_json", 'The answer is {"name": "a"}', 'The answer is {"name": "a"}', []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
        None,
        [("a", '{"x": 1}'), ("b", "{}")],
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"x": "]"}}]',
        "Sure.",
        [("a", '{"x": "]"}')],
    ),
    # [TOOL_CALLS] is a special token that detokenizing drops
    ("mistral", '[{"name": "a", "arguments": {"x": 1}}]', None, [("a", '{"x": 1}')]),
    ("mistral", "[1, 2, 3]", "[1, 2, 3]", []),
    (
        "required",
        '[{"name": "a", "parameters": {"x": 1}},\n {"name": "a", "parameters": {"x": 2}}]',
        None,
        [("a", '{"x": 1}'), ("a", '{"x": 2}')],
    ),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_answers(
    parser: str, text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    parsed = whole(parser, text)
    assert parsed.content == content
    assert calls_of(parsed) == calls
    for call in parsed.calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streams_split_anywhere_give_the_whole_answer(
    parser: str, text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    for cut in range(len(text) + 1):
        got_content, got_calls, _ = streamed(parser, [text[:cut], text[cut:]])
        assert got_calls == calls, cut
        assert (got_content or None if calls else got_content) == content, cut
    got_content, got_calls, _ = streamed(parser, list(text))  # a character at a time
    assert got_calls == calls
    assert (got_content or None if calls else got_content) == content


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", 'Hi <tool_call>{"name": "a", "arguments": {"x": 1,}}</tool_call>'),
        ("hermes", 'Hi <tool_call>{"name": "a", "arguments": {"x": 1'),  # cut by max_tokens
        ("llama3_json", '{"name": "a", "parameters": {"x": tru}}'),
        ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name"'),
    ],
)
def test_malformed_calls_leave_the_text_as_content(parser: str, text: str) -> None:
    parsed = whole(parser, text)
    assert parsed.content == text
    assert parsed.calls == []


@pytest.mark.parametrize(
    "text",
    [
        'A <tool_call>{"name": oops}</tool_call> B',
        'A <tool_call>["not", "a call"]</tool_call> B',
        'A <tool_call>{"x": 1}</tool_call> B',
    ],
)
def test_a_block_that_is_no_call_is_content_streamed_too(text: str) -> None:
    assert whole("hermes", text) == Parsed(text, [])
    for cut in range(len(text) + 1):
        content, calls, _ = streamed("hermes", [text[:cut], text[cut:]])
        assert (content, calls) == (text, []), cut


def test_text_that_may_open_a_call_is_held_back() -> None:
    stream = tool_call_stream("hermes", make_id=_ids())
    assert stream.feed("Hello <tool") == [ContentDelta("Hello")]
    assert stream.feed("_ca") == []
    assert stream.feed('ll>{"name": "f", "argu') == [CallDelta(0, "", "call_0", "f")]
    assert stream.feed('ments": {"a": ') == [CallDelta(0, '{"a": ')]
    assert stream.feed("1}}</tool_call>") == [CallDelta(0, "1}")]
    assert stream.finish() == []
    assert not stream.broken


def test_held_text_that_opens_no_call_is_sent_at_the_end() -> None:
    stream = tool_call_stream("hermes", make_id=_ids())
    assert stream.feed("a <tool_c") == [ContentDelta("a")]
    assert stream.finish() == [ContentDelta(" <tool_c")]


def test_a_named_call_is_the_whole_answer() -> None:
    stream = tool_call_stream("", named="get_weather", make_id=_ids())
    deltas = stream.feed('{"city": ') + stream.feed('"Oslo"}') + stream.finish()
    assert deltas == [
        CallDelta(0, "", "call_0", "get_weather"),
        CallDelta(0, '{"city": '),
        CallDelta(0, '"Oslo"}'),
    ]
    parsed = parse_whole(tool_call_stream("", named="f", make_id=_ids()), '{"a": 1}')
    assert parsed.content is None and calls_of(parsed) == [("f", '{"a": 1}')]


def test_chunks_are_openai_tool_call_deltas() -> None:
    _, _, deltas = streamed("hermes", ['<tool_call>{"name": "f", "arguments": {}}</tool_call>'])
    assert [d.openai() for d in deltas if isinstance(d, CallDelta)] == [
        {
            "index": 0,
            "id": "call_0",
            "type": "function",
            "function": {"name": "f", "arguments": ""},
        },
        {"index": 0, "function": {"arguments": "{}"}},
    ]


def test_call_ids_look_like_openai_ones() -> None:
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("{% for tool in tools %}...<tool_call>\n{{ tool }}</tool_call>", "hermes"),
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
        ("{{ '[TOOL_CALLS]' + tool_calls|tojson }}", "mistral"),
    ],
)
def test_auto_reads_the_chat_template(template: str, parser: str) -> None:
    assert choose_parser("auto", template) == parser
    assert choose_parser("mistral", template) == "mistral"  # a setting wins


def test_auto_without_a_known_format_says_which_setting_to_pass() -> None:
    with pytest.raises(ToolParserError, match="--tool-call-parser"):
        choose_parser("auto", "{{ messages }}")
    with pytest.raises(ToolParserError, match="unknown tool call parser"):
        choose_parser("pythonic", "")


def test_without_parallel_calls_only_the_first_is_kept() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'
    )
    stream = tool_call_stream("hermes", make_id=_ids())
    assert isinstance(stream, ToolCallStream)
    stream.max_calls = 1
    parsed = parse_whole(stream, text)
    assert parsed.content is None and calls_of(parsed) == [("a", "{}")]
    stream = tool_call_stream("hermes", make_id=_ids())
    assert isinstance(stream, ToolCallStream)
    stream.max_calls = 1
    deltas = [d for ch in text for d in stream.feed(ch)] + stream.finish()
    assert {d.index for d in deltas if isinstance(d, CallDelta)} == {0}
    assert not any(isinstance(d, ContentDelta) for d in deltas)
    # a second call cut short does not break the first
    stream = tool_call_stream("hermes", make_id=_ids())
    assert isinstance(stream, ToolCallStream)
    stream.max_calls = 1
    assert calls_of(parse_whole(stream, text[:-20])) == [("a", "{}")]
