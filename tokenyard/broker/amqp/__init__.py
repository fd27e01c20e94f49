"""RabbitMQ lanes with the tables on Redis/Valkey beside them (as Celery pairs a broker with a
result backend): `--broker amqp://user:pass@host:5672/vhost --tables redis://host:6379/0`.

`open_backend` builds it: the lanes (lanes.py: quorum queues a worker consumes, delay queues
for retries, a dead-letter queue per model) over one AMQP connection (connection.py), every queue
named in names.py; prefix affinity by a held queue per worker (affinity.py); records, leases,
events and every table on the Redis connection: the queue core (queue.py) composes the Valkey
job table (redis/table.py) and changes it by the scripts in lua/ (declared in scripts.py,
called by ledger.py); the other tables are the Redis backend's.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from tokenyard.broker import REDIS_SCHEMES, Backend
from tokenyard.broker.amqp import scripts
from tokenyard.broker.amqp.connection import AmqpConnection
from tokenyard.broker.amqp.names import Names
from tokenyard.broker.amqp.queue import AmqpQueue
from tokenyard.broker.core import Clock, Trait
from tokenyard.broker.redis import backend_on
from tokenyard.broker.redis.connection import RedisConnection
from tokenyard.broker.redis.keys import Keys
from tokenyard.config import BrokerSettings
from tokenyard.errors import FatalError

__all__ = ["TRAITS", "open_backend"]

# the lanes are FIFO quorum queues RabbitMQ pushes from: no fair share (README, "RabbitMQ
# lanes"); a prefixed job waits for its prefix's owner in that worker's held queue (affinity.py)
TRAITS = frozenset({Trait.PUSHED, Trait.REAP_FENCES, Trait.PREFIX_AFFINITY})

NO_TABLES = (
    "RabbitMQ lanes keep their tables (records, events, keys, quotas) on Redis/Valkey: give "
    "--tables redis://host:6379/0 or set TOKENYARD_BROKER_TABLES_URL"
)


class _Connections:
    """The backend's two connections, answering as one."""

    def __init__(self, amqp: AmqpConnection, redis: RedisConnection) -> None:
        self.amqp = amqp
        self.redis = redis

    async def ping(self) -> bool:
        lanes, tables = await asyncio.gather(self.amqp.ping(), self.redis.ping())
        return lanes and tables

    async def close(self) -> None:
        await self.amqp.close()
        await self.redis.close()


def open_backend(settings: BrokerSettings, clock: Clock = time.time) -> Backend:
    """Lanes on the RabbitMQ server `settings.url` names, tables on `settings.tables_url`."""
    if not settings.tables_url:
        raise FatalError(NO_TABLES)
    if not settings.tables_url.startswith(REDIS_SCHEMES):
        schemes = ", ".join(REDIS_SCHEMES)
        raise FatalError(f"tables URL {settings.tables_url!r}: expected one of {schemes}")
    conn = RedisConnection(
        msgspec.structs.replace(settings, url=settings.tables_url), extra_scripts=scripts.SCRIPTS
    )
    amqp = AmqpConnection(settings.url, heartbeat_s=settings.lease_s / 2)
    return backend_on(
        settings,
        conn,
        Keys(settings.prefix),
        lambda table: AmqpQueue(table, amqp, Names(settings.prefix)),
        clock,
        connection=_Connections(amqp, conn),
    )
