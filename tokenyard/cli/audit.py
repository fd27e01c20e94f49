"""`tokenyard audit --since 1h --tenant T [--model M] > out.jsonl`: export the audit trail, from
the broker or, with `--from kafka://host:9092/topic`, from the Kafka audit log."""

from __future__ import annotations

import asyncio
import sys
from typing import Annotated

import msgspec
import typer

from tokenyard.broker import Backend
from tokenyard.broker.audit import AuditEntry, parse_since
from tokenyard.cli.options import BrokerOpt, PrefixOpt, with_broker


def audit(
    since: Annotated[
        str, typer.Option(help="unix seconds, ISO 8601 (UTC unless it says), or 90s/15m/1h/2d")
    ],
    tenant: Annotated[str | None, typer.Option(help="only this tenant's jobs")] = None,
    model: Annotated[str | None, typer.Option(help="only this model's jobs")] = None,
    source: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="replay the Kafka audit log kafka://host:9092/topic instead of the broker",
        ),
    ] = None,
    broker: BrokerOpt = None,
    prefix: PrefixOpt = None,
) -> None:
    """Write the audit trail (receipts and terminal states) as JSON lines, oldest first."""
    try:
        start = parse_since(since)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--since") from exc
    if source is None:
        with_broker(broker, prefix, lambda b: _export(b, start, tenant, model))
        return
    from tokenyard.broker.kafka import SCHEME, replay

    if not source.startswith(SCHEME):
        raise typer.BadParameter("expected kafka://host:9092/topic", param_hint="--from")
    _write(asyncio.run(replay(source, start, tenant, model)))


async def _export(broker: Backend, since: float, tenant: str | None, model: str | None) -> None:
    cursor = None
    while True:
        cursor, entries = await broker.audit.audit_entries(since, tenant, model, cursor=cursor)
        _write(entries, flush=False)
        if cursor is None:
            break
    sys.stdout.buffer.flush()


_encoder = msgspec.json.Encoder()


def _write(entries: list[AuditEntry], flush: bool = True) -> None:
    out = sys.stdout.buffer
    for entry in entries:
        out.write(_encoder.encode(entry) + b"\n")
    if flush:
        out.flush()
