"""Every `--help` names every command and engine, and the same way everywhere."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from tokenyard.cli import app
from tokenyard.config import SECTIONS
from tokenyard.engines import ENGINE_NAMES


def help_text(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"TERMINAL_WIDTH": "100"})
    assert result.exit_code == 0, result.output
    return re.sub(r"[\s│╭╮╰╯─]+", " ", result.output)  # the panels' frames and wrapping gone


def test_the_root_help_names_every_command_and_the_config_files_tables() -> None:
    import typer.main

    commands = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    assert len(commands) >= 15
    text = help_text()
    first = text.split(" Options ")[0]
    for name in commands:
        assert re.search(rf"[ `|]{re.escape(name)}[ `|]", first), (name, first)
    assert " ".join(f"[{section}]" for section in SECTIONS) + " tables" in text


def test_every_command_with_an_engine_names_them_alike() -> None:
    choices = " | ".join(ENGINE_NAMES)
    for command in ("serve", "worker", "gateway"):
        text = help_text(command)
        assert f"auto (vllm where installed and it supports the model, else hf) | {choices}" in (
            text
        ), command
