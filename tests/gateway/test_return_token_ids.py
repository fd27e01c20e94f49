"""`return_token_ids` (vLLM's completions extension): each choice carries its token ids."""

from __future__ import annotations

from tests.gateway.conftest import MODEL, Stack
from tests.gateway.sse import events
from tokenyard.engines.sim import SimTokenizer


def test_stream_and_whole_completion_carry_the_generated_ids(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 10, "temperature": 0.0}
    with stack.client() as c:
        whole = c.post("/v1/completions", json={**body, "return_token_ids": True}).json()
        ids = whole["choices"][0]["token_ids"]
        assert len(ids) == 10
        assert SimTokenizer().decode(ids) == whole["choices"][0]["text"]

        streamed: list[int] = []
        text = ""
        with c.stream(
            "POST", "/v1/completions", json={**body, "stream": True, "return_token_ids": True}
        ) as reply:
            assert reply.status_code == 200
            for ev in events(reply):
                if ev.data == "[DONE]":
                    break
                choice = ev.json()["choices"][0]
                streamed += choice["token_ids"]
                text += choice["text"]
        assert streamed == ids
        assert text == whole["choices"][0]["text"]

        plain = c.post("/v1/completions", json=body).json()
        assert "token_ids" not in plain["choices"][0]  # only when asked for
