"""`tokenyard audit --since 1h --tenant T [--model M] > out.jsonl`: export the audit trail."""

from __future__ import annotations

import sys
from typing import Annotated

import msgspec
import typer

from tokenyard.broker import Backend
from tokenyard.broker.audit import parse_since
from tokenyard.cli.options import BrokerOpt, PrefixOpt, with_broker


def audit(
    since: Annotated[
        str, typer.Option(help="unix seconds, ISO 8601 (UTC unless it says), or 90s/15m/1h/2d")
    ],
    tenant: Annotated[str | None, typer.Option(help="only this tenant's jobs")] = None,
    model: Annotated[str | None, typer.Option(help="only this model's jobs")] = None,
    broker: BrokerOpt = None,
    prefix: PrefixOpt = None,
) -> None:
    """Write the audit trail (receipts and terminal states) as JSON lines, oldest first."""
    try:
        start = parse_since(since)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--since") from exc
    with_broker(broker, prefix, lambda b: _export(b, start, tenant, model))


async def _export(broker: Backend, since: float, tenant: str | None, model: str | None) -> None:
    encoder = msgspec.json.Encoder()
    out = sys.stdout.buffer
    cursor = None
    while True:
        cursor, entries = await broker.audit.audit_entries(since, tenant, model, cursor=cursor)
        for entry in entries:
            out.write(encoder.encode(entry) + b"\n")
        if cursor is None:
            break
    out.flush()
