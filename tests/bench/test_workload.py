"""Prompt and output length distributions, prompt files, and request bodies."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from tokenyard.bench.client import (
    Endpoint,
    RequestOptions,
    SSEDecoder,
    build_body,
    chunk_finish_reason,
    chunk_text,
    error_message,
)
from tokenyard.bench.workload import (
    WORDS,
    LengthDist,
    PromptItem,
    RequestSpec,
    Workload,
    load_prompts,
    parse_prompt_line,
)


def test_length_parse() -> None:
    assert LengthDist.parse("128") == LengthDist(128, 128)
    assert LengthDist.parse(" 64:256 ") == LengthDist(64, 256)
    assert LengthDist.parse("5:5").describe() == "5"
    assert LengthDist.parse("1:9").describe() == "uniform[1,9]"
    for bad in ("", "abc", "0", "10:5", "-3", "1:2:3"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_uniform_length_covers_its_inclusive_range() -> None:
    dist, rng = LengthDist(3, 7), random.Random(0)
    draws = [dist.sample(rng) for _ in range(2000)]
    assert set(draws) == {3, 4, 5, 6, 7}
    assert sum(draws) / len(draws) == pytest.approx(5.0, abs=0.1)


def test_fixed_length_consumes_no_randomness() -> None:
    rng = random.Random(1)
    before = rng.getstate()
    assert LengthDist(9, 9).sample(rng) == 9
    assert rng.getstate() == before


def _take(workload: Workload, seed: int | str, n: int = 20) -> list[RequestSpec]:
    return list(itertools.islice(workload.requests(seed), n))


def test_synthetic_workload_is_seeded_and_sized() -> None:
    workload = Workload(prompt_len=LengthDist(10, 30), output_len=LengthDist(4, 8))
    specs = _take(workload, seed=3)
    assert specs == _take(workload, seed=3)
    assert specs != _take(workload, seed=4)
    assert [s.index for s in specs] == list(range(20))
    for spec in specs:
        words = spec.prompt.split()
        assert 10 <= len(words) <= 30 and spec.prompt_words == len(words)
        assert set(words) <= set(WORDS)
        assert 4 <= spec.max_tokens <= 8
        assert spec.chat_messages() == [{"role": "user", "content": spec.prompt}]
    assert len({s.prompt for s in specs}) == len(specs)


def test_cache_bust_tags_every_prompt() -> None:
    workload = Workload(LengthDist(5, 5), LengthDist(2, 2), cache_bust="run7")
    specs = _take(workload, seed=0, n=3)
    assert [s.prompt.split()[0] for s in specs] == ["[run7-0]", "[run7-1]", "[run7-2]"]


def test_prompt_lines() -> None:
    assert parse_prompt_line('"hello"') == PromptItem(prompt="hello")
    assert parse_prompt_line('{"prompt": "hi", "max_tokens": 7}') == PromptItem("hi", None, 7)
    item = parse_prompt_line('{"messages": [{"role": "user", "content": "q"}], "output_len": 3}')
    assert item.messages == ({"role": "user", "content": "q"},) and item.max_tokens == 3
    assert item.text() == "q"
    for bad in ("3", '{"prompt": 1}', '{"messages": []}', '{"prompt": "x", "max_tokens": 0}'):
        with pytest.raises(ValueError):
            parse_prompt_line(bad)


def test_prompt_file(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [
        json.dumps("plain prompt"),
        "",
        json.dumps({"prompt": "with its own length", "max_tokens": 3}),
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "chat prompt"},
                ]
            }
        ),
    ]
    path.write_text("\n".join(lines) + "\n")
    items = load_prompts(path)
    assert len(items) == 3
    workload = Workload(LengthDist(1, 1), LengthDist(50, 50), prompts=items, cache_bust="t")
    specs = _take(workload, seed=1, n=200)
    assert {s.prompt.split("] ", 1)[1] for s in specs} == {
        "plain prompt",
        "with its own length",
        "be brief\nchat prompt",
    }
    for spec in specs:
        assert spec.max_tokens == (3 if "own length" in spec.prompt else 50)
        if spec.messages is not None:
            # the tag goes on the last user turn; the system turn is kept as it was
            assert spec.chat_messages()[0] == {"role": "system", "content": "be brief"}
            assert spec.chat_messages()[1]["content"].endswith("chat prompt")
    assert workload.describe() == {"output_len": "50", "prompts_from_file": 3, "cache_bust": True}

    bad = tmp_path / "bad.jsonl"
    bad.write_text('"ok"\n{"nope": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_prompts(bad)


def test_request_bodies() -> None:
    spec = RequestSpec(0, "a b c", None, 16, 3)
    plain = build_body(spec, RequestOptions(Endpoint.completions, "m"))
    assert plain == {
        "model": "m",
        "max_tokens": 16,
        "stream": True,
        "prompt": "a b c",
        "stream_options": {"include_usage": True},
    }
    chat = build_body(
        spec,
        RequestOptions(
            Endpoint.chat,
            "m",
            include_usage=False,
            ignore_eos=True,
            min_tokens=True,
            temperature=0.0,
            extra_body={"top_k": 1},
        ),
    )
    assert chat == {
        "model": "m",
        "max_tokens": 16,
        "stream": True,
        "messages": [{"role": "user", "content": "a b c"}],
        "temperature": 0.0,
        "ignore_eos": True,
        "min_tokens": 16,
        "top_k": 1,
    }
    assert Endpoint.chat.path == "chat/completions" and Endpoint.completions.path == "completions"
    # several models (adapters of one base): round-robin by the request's index
    mixed = RequestOptions(Endpoint.completions, "m", models=("a", "b", "c"))
    names = [build_body(RequestSpec(i, "x", None, 1, 1), mixed)["model"] for i in range(5)]
    assert names == ["a", "b", "c", "a", "b"]


def test_sse_decoder() -> None:
    decoder = SSEDecoder()
    lines = [
        ": keep-alive",
        "",
        "id: 1",
        'data: {"a":',
        "data: 1}",
        "",
        "event: x",
        "data:[DONE]",
        "",
    ]
    assert [d for d in map(decoder.feed, lines) if d is not None] == ['{"a":\n1}', "[DONE]"]
    decoder.feed("data: tail")
    assert decoder.flush() == "tail" and decoder.flush() is None


def test_chunk_fields() -> None:
    assert chunk_text({"choices": [{"text": "ab"}]}) == "ab"
    assert chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ""
    assert chunk_text({"choices": [{"delta": {"reasoning_content": "hm"}}]}) == "hm"
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""
    assert chunk_finish_reason({"choices": [{"text": "", "finish_reason": "length"}]}) == "length"
    assert chunk_finish_reason({"choices": [{"text": "x", "finish_reason": None}]}) is None
    assert error_message(b'{"error": {"message": "slow down"}}') == "slow down"
    assert error_message("plain text") == "plain text"


async def test_sse_lines_split_only_at_cr_and_lf() -> None:
    """U+2028 inside a JSON string is text, not a line break (httpx's aiter_lines splits it)."""
    from collections.abc import AsyncIterator

    import httpx

    from tokenyard.bench.client import sse_lines

    body = 'data: {"text": "a\u2028b\u0085c"}\r\n\r\ndata: [DONE]\n\n'.encode()
    pieces = [body[:9], body[9:23], body[23:24], body[24:]]  # split inside the CRLF too

    async def stream() -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece

    response = httpx.Response(200, content=stream())
    lines = [line async for line in sse_lines(response)]
    assert lines == ['data: {"text": "a\u2028b\u0085c"}', "", "data: [DONE]", ""]
