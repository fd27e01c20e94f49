"""Batch input validation and the batch object, without a server."""

from __future__ import annotations

import json
from typing import Any

from tokenyard.gateway.batches.files import DirFileStore, new_file_id
from tokenyard.gateway.batches.types import batch_body
from tokenyard.gateway.batches.validate import parse_lines
from tokenyard.messages import BatchRecord, BatchStatus

CHAT = "/v1/chat/completions"


def _line(i: int, **over: Any) -> bytes:
    row: dict[str, Any] = {
        "custom_id": f"r{i}",
        "method": "POST",
        "url": CHAT,
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }
    row.update(over)
    return json.dumps(row).encode()


def test_valid_lines_and_blank_lines() -> None:
    data = b"\n".join([_line(0), b"", _line(1), b"  "])
    lines, errors = parse_lines(data, CHAT, 10)
    assert errors == []
    assert [line.custom_id for line in lines] == ["r0", "r1"]
    assert lines[0].kind == "chat"


def test_each_bad_line_is_reported_with_its_number() -> None:
    data = b"\n".join(
        [
            _line(0, method="GET"),
            _line(1, body=[1]),
            _line(2, body={"model": "m", "messages": [], "stream": True}),
            _line(3, body={"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}),
            b"[1, 2]",
        ]
    )
    _, errors = parse_lines(data, CHAT, 10)
    assert [(e.line, e.code) for e in errors][:2] == [(1, "invalid_method"), (2, "invalid_body")]
    assert [e.line for e in errors] == [1, 2, 3, 4, 5]
    assert errors[4].code == "invalid_json_line"


def test_limits_and_empty_file() -> None:
    _, errors = parse_lines(b"\n".join(_line(i) for i in range(4)), CHAT, 3)
    assert [(e.line, e.code) for e in errors] == [(4, "too_many_requests")]
    _, errors = parse_lines(b"\n\n", CHAT, 3)
    assert [e.code for e in errors] == ["empty_file"]


def test_batch_object_shows_a_pending_cancel() -> None:
    rec = BatchRecord(
        id="batch_x", tenant="t", endpoint=CHAT, input_file_id="f", created_at=1, expires_at=2,
        status=BatchStatus.IN_PROGRESS, total=5,
    )  # fmt: skip
    body = batch_body(rec, 2, 1, cancel_requested=True)
    assert body["status"] == "cancelling"
    assert body["request_counts"] == {"total": 5, "completed": 2, "failed": 1}
    rec.status = BatchStatus.COMPLETED
    assert batch_body(rec, 5, 0, cancel_requested=True)["status"] == "completed"


def test_dir_file_store(tmp_path: Any) -> None:
    store = DirFileStore(tmp_path)
    a = store.put("acme", "batch", "a.jsonl", b"one")
    store.put("globex", "batch", "b.jsonl", b"two")
    assert store.content(a.id) == b"one"
    assert [f.id for f in store.list("acme")] == [a.id]
    fixed = new_file_id("batch_1:output")
    assert fixed == new_file_id("batch_1:output")
    store.put("acme", "batch_output", "o.jsonl", b"v1", fixed)
    store.put("acme", "batch_output", "o.jsonl", b"v2", fixed)  # rewritten, not duplicated
    assert store.content(fixed) == b"v2" and len(store.list("acme")) == 2
    assert store.get("../../etc/passwd") is None
    assert store.delete(a.id) and store.get(a.id) is None and not store.delete(a.id)


def test_a_line_nested_too_deep_or_not_utf8_is_a_line_error() -> None:
    deep = b'{"custom_id": "d", "body": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    data = b"\n".join([_line(0), deep, _line(2).replace(b'"hi"', b'"caf\xe9"'), _line(3)])
    lines, errors = parse_lines(data, CHAT, 10)
    assert [line.custom_id for line in lines] == ["r0", "r3"]
    assert [(e.line, e.code) for e in errors] == [(2, "json_too_deep"), (3, "invalid_json")]


def test_a_completions_line_with_several_prompts_is_a_line_error() -> None:
    url = "/v1/completions"
    several = _line(0, url=url, body={"model": "m", "prompt": ["a", "b"]})
    one = _line(1, url=url, body={"model": "m", "prompt": ["a"], "min_p": 0.1})
    lines, errors = parse_lines(b"\n".join([several, one]), url, 10)
    assert [(e.line, e.param) for e in errors] == [(1, "prompt")]
    assert [line.custom_id for line in lines] == ["r1"]
