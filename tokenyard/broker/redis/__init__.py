"""The Redis Streams backend (Redis >= 6.2, Valkey >= 7.2, Redis Cluster).

`open_backend` builds it: one connection layer (connection.py), the queue core over it (the
lanes, queue.py, over the job table, table.py) and the other tables (tables.py, batches.py,
series.py). Beside them: the Lua scripts (lua/, declared in scripts.py), key names (keys.py),
the hot path's channel, and an embedded Valkey (and cluster) for `serve`, tests and benchmarks.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tokenyard.broker import Backend, Connection
from tokenyard.broker.core import Clock, QueueCore, Trait
from tokenyard.broker.redis.batches import RedisBatches
from tokenyard.broker.redis.connection import RedisConnection
from tokenyard.broker.redis.keys import Keys
from tokenyard.broker.redis.queue import RedisQueue
from tokenyard.broker.redis.series import RedisSeries
from tokenyard.broker.redis.table import ValkeyJobTable
from tokenyard.broker.redis.tables import (
    RedisAudit,
    RedisDirectory,
    RedisQuotas,
    RedisRegistry,
    RedisResponses,
    RedisStoredResponses,
)
from tokenyard.config import BrokerSettings

__all__ = [
    "TRAITS",
    "RedisConnection",
    "RedisQueue",
    "backend_on",
    "connection_of",
    "open_backend",
]

# every guarantee in its full form: one fair-share state per lane in the server (lua/lib/fair.lua)
TRAITS = frozenset(
    {
        Trait.FAIR_SHARE,
        Trait.FAIR_WINDOW,
        Trait.DEADLINE_ORDER,
        Trait.PREFIX_AFFINITY,
        Trait.REAP_FENCES,
    }
)


def open_backend(settings: BrokerSettings, clock: Clock = time.time) -> Backend:
    """The queue core and every table on the server `settings.url` names (`redis://`,
    `rediss://`, `unix://`, or `redis+cluster://` any node)."""
    conn = RedisConnection(settings)
    keys = Keys(settings.prefix)
    return backend_on(
        settings,
        conn,
        keys,
        RedisQueue,
        clock,
    )


def backend_on(
    settings: BrokerSettings,
    conn: RedisConnection,
    keys: Keys,
    queue_of: Callable[[ValkeyJobTable], QueueCore],
    clock: Clock,
    connection: Connection | None = None,
) -> Backend:
    """Every table on `conn`, and the queue core `queue_of` builds over the job table (this
    backend's lanes, or RabbitMQ's); `connection` answers for the whole backend."""
    quotas = RedisQuotas(conn, keys, clock)
    audit = RedisAudit(conn, keys, settings.audit_max_len)
    return Backend(
        settings=settings,
        queue=queue_of(ValkeyJobTable(settings, conn, keys, quotas, audit, clock)),
        directory=RedisDirectory(conn, keys),
        quotas=quotas,
        audit=audit,
        responses=RedisResponses(conn, keys, clock),
        registry=RedisRegistry(conn, keys, clock),
        batches=RedisBatches(conn, keys, clock),
        stored_responses=RedisStoredResponses(conn, keys),
        series=RedisSeries(conn, keys),
        connection=connection or conn,
    )


def connection_of(backend: Backend) -> RedisConnection:
    """The Redis connection under `backend`, for the tests and benchmarks that read keys."""
    if not isinstance(backend.connection, RedisConnection):
        raise TypeError(f"not a Redis backend: {backend.settings.url}")
    return backend.connection
