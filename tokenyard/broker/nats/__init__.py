"""The NATS JetStream backend (nats-server >= 2.11): no Redis anywhere.

`open_backend` builds it: one connection (connection.py), the queue core (queue.py: lanes as
work-queue streams with durable pull consumers, job records in KV by compare-and-set, per-job
event subjects) and the tables in KV (tables.py, batches.py; the dashboard's series in a
stream, series.py). Every name is built in names.py; embedded.py runs a private nats-server
for `serve`, tests and benchmarks.
"""

from __future__ import annotations

import time

from tokenyard.broker import Backend
from tokenyard.broker.core import Clock, Trait
from tokenyard.config import BrokerSettings

__all__ = ["TRAITS", "open_backend"]

# fair share with each worker's own tags over every waiting job (no window), deadlines ordered
# within one claim only, and a holder fenced by the next holder's claim marker, not by the reap
# that requeued its job (README, "NATS JetStream")
TRAITS = frozenset({Trait.FAIR_SHARE, Trait.PREFIX_AFFINITY})


def open_backend(settings: BrokerSettings, clock: Clock = time.time) -> Backend:
    """The queue core and every table on the server(s) `settings.url` names
    (`nats://host:port[,host:port][?replicas=N]`, or `tls://`)."""
    # imported here, not above: `serve` and the tests start the embedded server (embedded.py)
    # without loading the client library and the whole backend
    from tokenyard.broker.nats.audit import NatsAudit
    from tokenyard.broker.nats.batches import NatsBatches
    from tokenyard.broker.nats.connection import NatsConnection
    from tokenyard.broker.nats.names import Names
    from tokenyard.broker.nats.queue import NatsQueue
    from tokenyard.broker.nats.responses import NatsResponses, NatsStoredResponses
    from tokenyard.broker.nats.series import NatsSeries
    from tokenyard.broker.nats.store import Store
    from tokenyard.broker.nats.tables import NatsDirectory, NatsQuotas, NatsRegistry

    conn = NatsConnection(settings)
    names = Names(settings.prefix)
    quotas = NatsQuotas(conn, names, clock, settings.pool_count)
    audit = NatsAudit(conn, names, settings.audit_max_len)
    registry = NatsRegistry(conn, names, clock)
    return Backend(
        settings=settings,
        queue=NatsQueue(Store(settings, conn, names, quotas, audit, registry, clock)),
        directory=NatsDirectory(conn, names, clock),
        quotas=quotas,
        audit=audit,
        responses=NatsResponses(conn, names, clock),
        registry=registry,
        batches=NatsBatches(conn, names, clock),
        stored_responses=NatsStoredResponses(conn, names, clock),
        series=NatsSeries(conn, names),
        connection=conn,
    )
