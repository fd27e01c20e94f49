"""`tokenyard config show`: the effective settings and where each came from."""

from __future__ import annotations

import json
import logging
import os
from typing import Annotated, Any

import msgspec
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tokenyard.config import (
    DEFAULT,
    OTHER_VARIABLES,
    BrokerSettings,
    WorkerSettings,
    from_env,
    setting_sources,
    setting_variables,
    unknown_variables,
)
from tokenyard.logs import LOG_NAME_ENV

config_app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
_SECRET = ("key", "password", "token_secret")


def sections() -> list[tuple[str, type[msgspec.Struct]]]:
    """Every table of the config file (`tokenyard.config.SECTIONS`) and its settings."""
    from tokenyard.fleet.autoscale import AutoscaleConfig
    from tokenyard.gateway.settings import GatewaySettings

    return [
        ("broker", BrokerSettings),
        ("worker", WorkerSettings),
        ("gateway", GatewaySettings),
        ("autoscale", AutoscaleConfig),
    ]


def warn_unknown_variables() -> None:
    """One warning line per TOKENYARD_* variable nothing reads, naming the nearest known one;
    a worker started by `serve` (which named it) says nothing: serve said it once already."""
    if os.environ.get(LOG_NAME_ENV):
        return
    known = {*setting_variables(dict(sections())), *OTHER_VARIABLES}
    log = logging.getLogger("tokenyard.config")
    for name, near in unknown_variables(os.environ, known):
        hint = f"; did you mean {near}?" if near else " (`tokenyard config show` lists them)"
        log.warning("%s is not a tokenyard setting and is ignored%s", name, hint)


def effective() -> dict[str, list[dict[str, Any]]]:
    """Per section: every setting's value and source (flag > env > file > default)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for section, kind in sections():
        settings = from_env(kind, section)  # fails fast on a bad value, naming its source
        sources = setting_sources(kind, section)
        rows = []
        for field in msgspec.structs.fields(kind):
            value = msgspec.to_builtins(getattr(settings, field.name))
            if value is not None and any(s in field.name for s in _SECRET):
                value = "***"
            source = sources[field.name][1] if field.name in sources else DEFAULT
            rows.append({"setting": field.name, "value": value, "source": source})
        out[section] = rows
    return out


@config_app.command("show")
def show(
    as_json: Annotated[bool, typer.Option("--json", help="one JSON document")] = False,
) -> None:
    """Print every setting's effective value and where it came from."""
    data = effective()
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    console = Console()
    for section, rows in data.items():
        table = Table(title=escape(f"[{section}]"))
        for column in ("setting", "value", "source"):
            table.add_column(column)
        for row in rows:
            style = "dim" if row["source"] == DEFAULT else None
            table.add_row(row["setting"], json.dumps(row["value"]), row["source"], style=style)
        console.print(table)
