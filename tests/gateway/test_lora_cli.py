"""`tokenyard lora` over a real Valkey, seen by a running gateway; an adapter's job on an
engine that runs none is refused by name, never run on the base."""

from __future__ import annotations

import httpx
from typer.testing import CliRunner

from tests.gateway.conftest import MODEL, Stack
from tokenyard.cli import app

runner = CliRunner()


def cli(stack: Stack, *args: str) -> str:
    result = runner.invoke(
        app, [*args, "--broker", stack.broker_settings.url, "--prefix", stack.prefix]
    )
    assert result.exit_code == 0, result.output
    return result.output


def test_cli_adds_lists_and_removes_adapters(stack: Stack) -> None:
    cli(stack, "lora", "add", "sql", "/loras/sql", "--model", MODEL)
    assert "sql" in cli(stack, "lora", "list") and "/loras/sql" in cli(stack, "lora", "list")
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
        assert cards["sql"]["parent"] == MODEL and cards["sql"]["root"] == "/loras/sql"
        # the sim engine runs no adapters: refused at admission naming the model (a stream
        # too, before it starts), not queued and never run as the base
        for stream in (False, True):
            answer = http.post(
                "/v1/completions",
                json={"model": "sql", "prompt": "hi", "max_tokens": 4, "stream": stream},
            )
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert "'sql' is a LoRA adapter" in error["message"]
            assert (error["param"], error["code"]) == ("model", "unsupported_parameter")
        # an adapter tokenizes as its base; it scores nothing (400, not an unknown model)
        tokens = http.post("/tokenize", json={"model": "sql", "prompt": "hi"})
        base = http.post("/tokenize", json={"model": MODEL, "prompt": "hi"})
        assert tokens.status_code == 200 and tokens.json()["tokens"] == base.json()["tokens"]
        score = http.post("/v1/score", json={"model": "sql", "text_1": "a", "text_2": "b"})
        assert score.status_code == 400 and "LoRA adapter" in score.json()["error"]["message"]
    cli(stack, "lora", "rm", "sql")
    assert "sql" not in cli(stack, "lora", "list")
    result = runner.invoke(
        app, ["lora", "rm", "sql", "--broker", stack.broker_settings.url, "--prefix", stack.prefix]
    )
    assert result.exit_code != 0
