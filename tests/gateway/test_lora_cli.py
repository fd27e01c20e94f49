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
        # the sim engine runs no adapters: refused naming the model, not run as the base
        answer = http.post(
            "/v1/completions", json={"model": "sql", "prompt": "hi", "max_tokens": 4}
        )
        assert answer.status_code == 400, answer.text
        assert "LoRA adapter" in answer.json()["error"]["message"]
    cli(stack, "lora", "rm", "sql")
    assert "sql" not in cli(stack, "lora", "list")
    result = runner.invoke(
        app, ["lora", "rm", "sql", "--broker", stack.broker_settings.url, "--prefix", stack.prefix]
    )
    assert result.exit_code != 0
