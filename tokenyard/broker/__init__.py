"""Brokers: a queue core (lanes, leases, fenced results, per-job events) and tables beside it.

`connect(settings)` opens the backend named by `settings.url` and returns a `Backend`: its
queue core and each table as the role a caller types against. The roles are declared in
core.py and tables.py; each backend lives in a package of its own (redis/, nats/, amqp/).
With `settings.audit_kafka`, its audit trail is mirrored to Kafka (kafka.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tokenyard.broker.audit import Mirrored
from tokenyard.broker.core import Clock, QueueCore, Trait
from tokenyard.broker.ids import is_job_id, new_job_id
from tokenyard.broker.tables import (
    Audit,
    BatchStore,
    Directory,
    Quotas,
    ResponseStore,
    Series,
    StoredResponses,
    WorkerRegistry,
)
from tokenyard.config import BrokerSettings
from tokenyard.errors import BrokerUnavailable, FatalError

if TYPE_CHECKING:
    from tokenyard.broker.kafka import KafkaAuditLog

__all__ = [
    "Backend",
    "check_url",
    "connect",
    "is_job_id",
    "new_job_id",
    "redacted",
    "traits_of",
    "wait_until_ready",
]


class Connection(Protocol):
    """What a backend's connections answer to as a whole."""

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...


@dataclass(frozen=True, eq=False)
class Backend:
    """One broker: its queue core and the tables beside it, over one set of connections."""

    settings: BrokerSettings
    queue: QueueCore
    directory: Directory
    quotas: Quotas
    audit: Audit
    responses: ResponseStore
    registry: WorkerRegistry
    batches: BatchStore
    stored_responses: StoredResponses
    series: Series  # the dashboard's recorded points
    connection: Connection
    # the Kafka audit log the audit trail is mirrored to (settings.audit_kafka); None: off
    audit_log: KafkaAuditLog | None = None

    @property
    def traits(self) -> frozenset[Trait]:
        """What this backend guarantees in full beyond the queue core (core.Trait)."""
        return traits_of(self.settings.url)

    async def ping(self) -> bool:
        return await self.connection.ping()

    async def close(self) -> None:
        """Send what the queue and the audit log still hold back, then release every
        connection."""
        await self.queue.close()
        if self.audit_log is not None:
            if isinstance(self.audit, Mirrored):
                await self.audit.flush_mirror()
            await self.audit_log.close()
        await self.connection.close()


# the URLs the Redis backend takes; redis+cluster:// names any node of a Redis Cluster
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://")
# the URLs the NATS JetStream backend takes (nats/connection.py parses them)
NATS_SCHEMES = ("nats://", "tls://")
# RabbitMQ lanes (amqp/), with the tables on a Redis URL beside them (`tables_url`)
AMQP_SCHEMES = ("amqp://", "amqps://")
SCHEMES = REDIS_SCHEMES + NATS_SCHEMES + AMQP_SCHEMES
NO_BROKER = (
    "no broker: give --broker URL or set TOKENYARD_BROKER_URL (e.g. redis://localhost:6379/0 "
    "or nats://localhost:4222), or run `tokenyard serve` in this directory first"
)


def check_url(url: str) -> None:
    """Refuse, in one line, a URL no backend takes (empty: none was given)."""
    if not url:
        raise FatalError(NO_BROKER)
    if not url.startswith(SCHEMES):
        schemes = ", ".join(SCHEMES)
        raise FatalError(f"broker URL {url!r}: expected one of {schemes}")


def redacted(url: str) -> str:
    """A broker URL fit to print: its password replaced."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}"


def traits_of(url: str) -> frozenset[Trait]:
    """The traits (core.Trait) the backend `url` names declares, without connecting: each
    backend package's `TRAITS`."""
    check_url(url)
    if url.startswith(AMQP_SCHEMES):
        from tokenyard.broker.amqp import TRAITS as amqp_traits

        return amqp_traits
    if url.startswith(NATS_SCHEMES):
        from tokenyard.broker.nats import TRAITS as nats_traits

        return nats_traits
    from tokenyard.broker.redis import TRAITS as redis_traits

    return redis_traits


def connect(settings: BrokerSettings, clock: Clock = time.time) -> Backend:
    """Open the backend named by `settings.url`: redis:// / rediss:// / unix://,
    redis+cluster://host:port (any node of a Redis Cluster), nats:// / tls:// (NATS
    JetStream), or amqp:// / amqps:// (RabbitMQ lanes, tables at `settings.tables_url`).
    `clock` stands in for time.time (tests inject one)."""
    check_url(settings.url)
    if settings.url.startswith(AMQP_SCHEMES):
        from tokenyard.broker.amqp import open_backend as open_amqp

        backend = open_amqp(settings, clock)
    elif settings.url.startswith(NATS_SCHEMES):
        from tokenyard.broker.nats import open_backend as open_nats

        backend = open_nats(settings, clock)
    else:
        from tokenyard.broker.redis import open_backend as open_redis

        backend = open_redis(settings, clock)
    if settings.audit_kafka:
        from tokenyard.broker.kafka import attach

        backend = attach(backend)
    return backend


async def wait_until_ready(backend: Backend, timeout_s: float = 10.0) -> None:
    """Poll until the server answers, for processes started alongside it."""
    give_up = time.monotonic() + timeout_s
    while not await backend.ping():
        if time.monotonic() > give_up:
            raise BrokerUnavailable(f"no answer from {backend.settings.url}")
        await asyncio.sleep(0.05)
