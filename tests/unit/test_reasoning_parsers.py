"""The reasoning parsers (vLLM's deepseek_r1 and qwen3) on fixed texts and generated ones,
whole and streamed split anywhere, alone and with a tool-call parser after them."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenyard.gateway.tools import (
    AnswerDelta,
    CallDelta,
    ContentDelta,
    Parsed,
    ReasoningDelta,
    ReasoningStream,
    parse_whole,
    reasoning_reading,
    tool_call_stream,
)
from tokenyard.messages import ReasoningReading

CALL = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'


def _ids() -> Callable[[], str]:
    count = itertools.count()
    return lambda: f"call_{next(count)}"


def reader(parser: str, tools: bool = False, include: bool = True) -> ReasoningStream:
    calls = tool_call_stream("hermes", make_id=_ids()) if tools else None
    return ReasoningStream(parser, calls, include)


def streamed(
    parser: str, pieces: list[str], tools: bool = False, include: bool = True
) -> tuple[str | None, str | None, list[tuple[str, str]], list[AnswerDelta]]:
    """The reasoning, content and calls a stream of `pieces` gives, reassembled as a client
    reassembles `delta.reasoning`, `delta.content` and `delta.tool_calls`."""
    stream = reader(parser, tools, include)
    deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
    reasoning = [d.text for d in deltas if isinstance(d, ReasoningDelta)]
    content = [d.text for d in deltas if isinstance(d, ContentDelta)]
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if isinstance(d, CallDelta):
            if d.id is not None:
                calls[d.index] = [d.name or "", ""]
            calls[d.index][1] += d.arguments
    return (
        "".join(reasoning) if reasoning else None,
        "".join(content) or None,
        [(n, a) for n, a in calls.values()],
        deltas,
    )


# (parser, text, reasoning, content) as vLLM's parsers split them
CASES = [
    ("deepseek_r1", "<think>\nabc\n</think>\n\nThe answer.", "\nabc\n", "\n\nThe answer."),
    # DeepSeek-R1's template opens the thinking in the prompt: no <think> in the answer
    ("deepseek_r1", "abc</think>The answer.", "abc", "The answer."),
    ("deepseek_r1", "still thinking when cut", "still thinking when cut", None),
    ("deepseek_r1", "<think>abc</think>", "abc", None),
    ("deepseek_r1", "  <think>abc</think>x", "abc", "x"),
    ("deepseek_r1", "a <think> b</think>x", "a <think> b", "x"),
    ("deepseek_r1", "abc</think>x</think>y", "abc", "x</think>y"),
    ("deepseek_r1", "", "", None),
    ("qwen3", "<think>\nabc\n</think>\n\nThe answer.", "\nabc\n", "\n\nThe answer."),
    ("qwen3", "abc</think>The answer.", "abc", "The answer."),
    ("qwen3", "truncated", "truncated", None),
    # deepseek_r1 keeps a call inside the thinking as thinking; qwen3's <tool_call> ends it
    ("deepseek_r1", f"think {CALL}", f"think {CALL}", None),
    ("qwen3", f"think {CALL}", "think ", CALL),
    ("qwen3", f"a</think>b {CALL}", "a", f"b {CALL}"),
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_whole_answers_split_as_vllm_splits_them(
    parser: str, text: str, reasoning: str, content: str | None
) -> None:
    assert parse_whole(reader(parser), text) == Parsed(content, [], reasoning)


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_streams_split_anywhere_give_the_whole_answer(
    parser: str, text: str, reasoning: str, content: str | None
) -> None:
    for cut in range(len(text) + 1):
        got = streamed(parser, [text[:cut], text[cut:]])
        assert (got[0] or "", got[1]) == (reasoning, content), cut
    got = streamed(parser, list(text))  # a character at a time
    assert (got[0] or "", got[1]) == (reasoning, content)


def test_a_partial_tag_is_held_back_until_known() -> None:
    stream = reader("qwen3")
    assert stream.feed(" ") == []  # maybe the whitespace before <think>
    assert stream.feed("<thi") == []
    assert stream.feed("nk>Let me see</th") == [ReasoningDelta("Let me see")]
    assert stream.feed("ought") == [ReasoningDelta("</thought")]  # no tag after all
    assert stream.feed(" ok</think>\n\nYes") == [ReasoningDelta(" ok"), ContentDelta("\n\nYes")]
    assert stream.feed(" </think>") == [ContentDelta(" </think>")]  # content is content
    assert stream.finish() == []


def test_held_text_at_the_end_is_reasoning() -> None:
    stream = reader("deepseek_r1")
    assert stream.feed("done </thi") == [ReasoningDelta("done ")]
    assert stream.finish() == [ReasoningDelta("</thi")]


def test_calls_after_the_reasoning_are_read_by_the_tool_parser() -> None:
    text = f"<think>weather?</think>\n\nLet me look. {CALL}"
    parsed = parse_whole(reader("qwen3", tools=True), text)
    assert parsed.reasoning == "weather?"
    assert parsed.content == "\n\nLet me look."
    assert [(c.id, c.name, c.arguments) for c in parsed.calls] == [("call_0", "f", '{"a": 1}')]
    for cut in range(len(text) + 1):
        reasoning, content, calls, _ = streamed("qwen3", [text[:cut], text[cut:]], tools=True)
        assert (reasoning, content, calls) == ("weather?", "\n\nLet me look.", [("f", '{"a": 1}')])


def test_a_call_in_the_thinking_is_no_call_for_deepseek_r1() -> None:
    parsed = parse_whole(reader("deepseek_r1", tools=True), f"{CALL}</think>done")
    assert parsed == Parsed("done", [], CALL)


def test_a_broken_call_leaves_the_content_after_the_reasoning_as_text() -> None:
    text = '<think>r</think>Hi <tool_call>{"name": "f", "arguments": {"a": 1'
    parsed = parse_whole(reader("qwen3", tools=True), text)
    assert parsed == Parsed('Hi <tool_call>{"name": "f", "arguments": {"a": 1', [], "r")


def test_include_reasoning_false_drops_it() -> None:
    text = "<think>secret</think>shown"
    assert parse_whole(reader("qwen3", include=False), text) == Parsed("shown", [], None)
    reasoning, content, _, deltas = streamed("qwen3", list(text), include=False)
    assert (reasoning, content) == (None, "shown")
    assert not any(isinstance(d, ReasoningDelta) for d in deltas)


def test_the_reading_follows_the_prompt_and_the_template_variables() -> None:
    assert reasoning_reading("", "<|assistant|>\n", {}) is None
    assert reasoning_reading("qwen3", "<|assistant|>\n", {}) == ReasoningReading(parser="qwen3")
    # the template closed the thinking in the prompt (Qwen3's enable_thinking false)
    assert reasoning_reading("deepseek_r1", "<|assistant|>\n<think>\n\n</think>\n\n", {}) is None
    assert reasoning_reading("qwen3", "<|assistant|>\n", {"enable_thinking": False}) is None
    # a closed thinking earlier in the conversation is no closed prompt
    earlier = "<think>a</think>b<|end|>\n<|user|>\nmore<|end|>\n<|assistant|>\n"
    assert reasoning_reading("qwen3", earlier, {}) is not None
    assert reasoning_reading("qwen3", "x", {}, include=False) == ReasoningReading(
        parser="qwen3", include=False
    )
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_reading("granite", "x", {})


# texts made of the pieces that matter: tags (whole and cut), whitespace, calls, words
_PIECES = st.sampled_from(
    ["<think>", "</think>", "<think", "</thi", "<", "/", ">", " ", "\n", "abc", "é", CALL]
)


@settings(max_examples=300, deadline=None)
@given(
    parser=st.sampled_from(["deepseek_r1", "qwen3"]),
    tools=st.booleans(),
    pieces=st.lists(_PIECES, max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_any_split_streams_as_the_whole(
    parser: str, tools: bool, pieces: list[str], cuts: list[int]
) -> None:
    text = "".join(pieces)
    at = sorted({min(c, len(text)) for c in cuts})
    parts = [text[a:b] for a, b in zip([0, *at], [*at, len(text)], strict=True)]
    whole = parse_whole(reader(parser, tools), text)
    reasoning, content, calls, _ = streamed(parser, parts, tools)
    assert reasoning == (whole.reasoning or None)
    assert [(c.name, c.arguments) for c in whole.calls] == calls
    if not broke(parser, tools, text):  # (a stream cannot take back a call it announced)
        assert content == whole.content
    # nothing is lost: the text is its opening tag, its reasoning, the tag that ended it
    # (none for qwen3's <tool_call>) and its content
    plain = parse_whole(reader(parser), text)
    assert plain.reasoning is not None
    said = plain.content or ""
    ends = [f"{plain.reasoning}</think>{said}", f"{plain.reasoning}{said}"]
    head = next(text[: -len(end)] if end else text for end in ends if text.endswith(end))
    assert head.strip() in ("", "<think>")


def broke(parser: str, tools: bool, text: str) -> bool:
    stream = reader(parser, tools)
    stream.feed(text)
    stream.finish()
    return stream.broken


def test_template_variables_as_vllm_passes_them() -> None:
    from tokenyard.errors import InvalidRequest
    from tokenyard.gateway.protocol import ChatCompletionRequest

    def chat(**fields: object) -> ChatCompletionRequest:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
        return ChatCompletionRequest.model_validate(body)

    assert chat().template_kwargs() == {}
    assert chat(reasoning_effort="low").template_kwargs() == {
        "reasoning_effort": "low",
        "enable_thinking": True,
    }
    # the kwargs' own enable_thinking wins; the top-level effort wins over the kwargs' one
    kwargs = {"enable_thinking": True, "reasoning_effort": "high", "custom": [1]}
    assert chat(reasoning_effort="none", chat_template_kwargs=kwargs).template_kwargs() == {
        "enable_thinking": True,
        "reasoning_effort": "none",
        "custom": [1],
    }
    with pytest.raises(InvalidRequest) as refused:
        chat(chat_template_kwargs={"add_generation_prompt": False}).template_kwargs()
    assert refused.value.param == "chat_template_kwargs.add_generation_prompt"
    user_thinks = [{"role": "user", "content": "hi", "reasoning_content": "x"}]
    with pytest.raises(InvalidRequest) as refused:
        chat(messages=user_thinks).template_messages()
    assert refused.value.param == "messages.0.reasoning_content"
