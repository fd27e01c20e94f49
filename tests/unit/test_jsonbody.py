"""The pre-parse checks of a JSON body: nesting depth counted outside strings only, and UTF-8."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from tokenyard.errors import InvalidRequest
from tokenyard.gateway.jsonbody import MAX_JSON_DEPTH, check_json, json_depth


def depth_of(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    return 0


# strings full of what could pass for structure: brackets, quotes, escapes
TRICKY = ['a["{\\', "\\\\", '"]]', 'x\\\\"[', "{{{", '\\\\\\"[', "", "[]", "é[ü"]


def random_json(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 7 or roll < 0.3:
        return rng.choice([*TRICKY, 1, None, 2.5, True])
    if roll < 0.65:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {
        rng.choice(TRICKY) + str(i): random_json(rng, depth + 1) for i in range(rng.randint(0, 3))
    }


def test_depth_counts_brackets_outside_strings_only() -> None:
    rng = random.Random(28)
    for _ in range(2000):
        value = random_json(rng)
        raw = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode()
        assert json_depth(raw) == depth_of(value), raw


@pytest.mark.parametrize(
    ("raw", "depth"),
    [
        (b"", 0),
        (b"[" * 5000 + b"]" * 5000, 5000),
        (b'{"a": "[[[[", "b": [[{}]]}', 4),
        (b'["unterminated [[[', 4),  # counted past the quote: more than a parser reaches
    ],
)
def test_depth_of_hand_made_bodies(raw: bytes, depth: int) -> None:
    assert json_depth(raw) == depth


def test_check_refuses_deep_and_non_utf8_bodies() -> None:
    check_json(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH)
    check_json(json.dumps({"prompt": "[" * 1000}).encode())  # inside a string: no nesting
    check_json('{"prompt": "café"}'.encode())
    with pytest.raises(InvalidRequest) as deep:
        check_json(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1))
    assert deep.value.code == "json_too_deep"
    for raw in (b'{"p": "caf\xe9"}', b'{"p": "\xed\xa0\x80"}', b"\xff"):
        with pytest.raises(InvalidRequest) as bad:
            check_json(raw)
        assert bad.value.code == "invalid_json"
        assert "UTF-8" in bad.value.message
