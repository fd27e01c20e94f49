"""The bench client's event counts: events with text, and events carrying token ids."""

from __future__ import annotations

import json

from tokenyard.bench.client import RequestResult, _ChunkReader


def test_token_events_count_every_step_also_one_without_text() -> None:
    result = RequestResult(index=0, send_s=0.0)
    reader = _ChunkReader(result, None, lambda: 1.0)
    for choice in (
        {"text": "", "token_ids": [5]},  # a token ending inside a character: no text yet
        {"text": "ab", "token_ids": [6]},
        {"text": "c"},  # a server that sends no ids
    ):
        assert not reader.event(json.dumps({"choices": [choice]}))
    assert reader.event("[DONE]")
    reader.close()
    assert result.token_events == 2 and len(result.chunk_times) == 2 and result.ok
