"""What the commands that talk to the broker share: its two options and a connection per run."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

import typer

from tokenyard.broker import Backend, check_url, connect
from tokenyard.config import BrokerSettings, from_env

BrokerOpt = Annotated[
    str | None,
    typer.Option(
        "--broker",
        help="redis://host:port/db, nats://host:port or amqp://user:pass@host:port/vhost; "
        "default: TOKENYARD_BROKER_URL",
    ),
]
TablesOpt = Annotated[
    str | None,
    typer.Option(
        "--tables",
        help="with amqp:// lanes: the Redis/Valkey URL of their tables (records, events, keys, "
        "quotas); default: TOKENYARD_BROKER_TABLES_URL",
    ),
]
PrefixOpt = Annotated[str | None, typer.Option(help="name prefix, to share one Redis or NATS")]
AuditKafkaOpt = Annotated[
    str | None,
    typer.Option(
        "--audit-kafka",
        help="also send the audit trail to kafka://host:9092/topic; default: "
        "TOKENYARD_BROKER_AUDIT_KAFKA",
    ),
]
_T = TypeVar("_T")


def broker_settings(
    broker: str | None,
    prefix: str | None,
    lease_s: float | None = None,
    required: bool = True,
    tables: str | None = None,
    audit_kafka: str | None = None,
) -> BrokerSettings:
    """The flags, then TOKENYARD_BROKER_*, then the config file, then the defaults; a command
    that needs a broker refuses at once when none is named (before it loads a model), and
    a Kafka audit log URL that is not one."""
    settings = from_env(
        BrokerSettings,
        "broker",
        url=broker,
        prefix=prefix,
        lease_s=lease_s,
        tables_url=tables,
        audit_kafka=audit_kafka,
    )
    if required:
        check_url(settings.url)
    if settings.audit_kafka:
        from tokenyard.broker.kafka import KafkaTarget

        KafkaTarget.parse(settings.audit_kafka)
    return settings


def with_broker(
    broker: str | None, prefix: str | None, job: Callable[[Backend], Awaitable[_T]]
) -> _T:
    """Run `job` on the broker the options name, connected for it and closed afterwards."""
    settings = broker_settings(broker, prefix)

    async def run() -> _T:
        active = connect(settings)
        try:
            return await job(active)
        finally:
            await active.close()

    return asyncio.run(run())
