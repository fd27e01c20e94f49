"""`tokenyard audit --since 1h --tenant T [--model M] > out.jsonl`: export the audit trail."""

from __future__ import annotations

import asyncio
import sys
from typing import Annotated

import msgspec
import typer

from tokenyard.broker import connect
from tokenyard.broker.audit import parse_since
from tokenyard.config import BrokerSettings, from_env


def audit(
    since: Annotated[
        str, typer.Option(help="unix seconds, ISO 8601 (UTC unless it says), or 90s/15m/1h/2d")
    ],
    tenant: Annotated[str | None, typer.Option(help="only this tenant's jobs")] = None,
    model: Annotated[str | None, typer.Option(help="only this model's jobs")] = None,
    broker: Annotated[
        str | None, typer.Option(help="redis://host:port/db; default: TOKENYARD_BROKER_URL")
    ] = None,
    prefix: Annotated[str | None, typer.Option(help="key prefix, to share one Redis")] = None,
) -> None:
    """Write the audit trail (receipts and terminal states) as JSON lines, oldest first."""
    try:
        start = parse_since(since)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--since") from exc
    settings = from_env(BrokerSettings, "broker", url=broker, prefix=prefix)
    asyncio.run(_export(settings, start, tenant, model))


async def _export(
    settings: BrokerSettings, since: float, tenant: str | None, model: str | None
) -> None:
    encoder = msgspec.json.Encoder()
    out = sys.stdout.buffer
    active = connect(settings)
    try:
        cursor = None
        while True:
            cursor, entries = await active.audit.audit_entries(since, tenant, model, cursor=cursor)
            for entry in entries:
                out.write(encoder.encode(entry) + b"\n")
            if cursor is None:
                break
        out.flush()
    finally:
        await active.close()
