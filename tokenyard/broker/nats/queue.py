"""The NATS JetStream queue core.

Lanes are work-queue streams, one per (model, priority, size pool), bounded by `max_msgs` with
`discard: new` (the server refuses a job past the bound, atomically). Inside a lane each tenant
has a subject and a durable pull consumer, so a claim can pick tenants by fair share; jobs held
for a worker (prefix affinity) wait on that worker's subject. `AckWait` is the lease and
`+WPI` renews it. A job's record is a KV entry changed only by compare-and-set, and its events a
subject of the events stream: a holder appends with `Nats-Expected-Last-Subject-Sequence`, and a
later holder first appends a claim marker, so a zombie's late append or result is rejected
(a first holder needs none: its appends expect no events before them).

Every ending writes the job's last events (its tail and Finished: one message) before its
record, so the events are the durable side: a terminal record always has its Finished, and a
Finished whose record was not written (its writer died in between) is copied into the record
by whoever meets it (a claim, a broker-side ending, a reader past the holder's lease).
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence

from tokenyard.broker.core import (
    BrokerStats,
    CancelOutcome,
    Clock,
    EnqueueResult,
    LaneBacklog,
    Lease,
    QueueCore,
    ReapReport,
)
from tokenyard.broker.group_commit import GroupCommit
from tokenyard.broker.nats.audit import NatsAudit
from tokenyard.broker.nats.claims import Claims
from tokenyard.broker.nats.connection import NatsConnection
from tokenyard.broker.nats.endings import Endings
from tokenyard.broker.nats.enqueue import Enqueuer
from tokenyard.broker.nats.introspection import Introspection
from tokenyard.broker.nats.leases import Leases
from tokenyard.broker.nats.names import Names
from tokenyard.broker.nats.reads import Reads
from tokenyard.broker.nats.store import Store
from tokenyard.broker.nats.tables import NatsQuotas, NatsRegistry
from tokenyard.config import BrokerSettings
from tokenyard.messages import (
    DeadLetter,
    JobEvent,
    JobRecord,
    JobResult,
    JobSpec,
    TokenChunk,
)


class NatsQueue(QueueCore):
    """The queue core on NATS JetStream (nats-server >= 2.11), composed by role: the enqueue
    path (enqueue.py), claims (claims.py), holding a lease and the reap (leases.py), endings and
    cancellation (endings.py), readers (reads.py) and counts (introspection.py), each on the one
    shared state and its primitive writes (store.py)."""

    def __init__(
        self,
        settings: BrokerSettings,
        conn: NatsConnection,
        names: Names,
        quotas: NatsQuotas,
        audit_trail: NatsAudit,
        registry: NatsRegistry,
        clock: Clock = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.conn = conn
        self.names = names
        self.store = Store(
            settings, conn, names, quotas, audit_trail, registry, clock, rng or random.Random()
        )
        self.endings = Endings(self.store)
        self.producer = Enqueuer(self.store)
        self.claims = Claims(self.store, self.endings)
        self.leases = Leases(self.store, self.endings)
        self.reads = Reads(self.store, self.endings)
        self.introspection = Introspection(self.store)
        self._group = GroupCommit(
            self.producer.enqueue_many,
            max_batch=settings.enqueue_batch,
            window_s=settings.enqueue_window_s,
        )

    async def close(self) -> None:
        await self._group.close()
        await self.store.audit.flush()
        await self.claims.close()

    # -- producing --------------------------------------------------------------------------
    async def enqueue(self, spec: JobSpec) -> EnqueueResult:
        return await self._group.enqueue(spec)

    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[EnqueueResult]:
        """Per model all-or-nothing against the lane bounds: a refused job takes back the
        model's jobs this call added."""
        return await self.producer.enqueue_many(specs)

    # -- leases -----------------------------------------------------------------------------
    async def claim(
        self,
        model: str,
        consumer: str,
        slots: int,
        block_s: float = 0.0,
        pools: Sequence[int] = (0,),
        batch_room: int | None = None,
    ) -> list[Lease]:
        return await self.claims.claim(model, consumer, slots, block_s, pools, batch_room)

    async def renew(self, leases: Sequence[Lease]) -> list[bool]:
        return await self.leases.renew(leases)

    async def complete_many(
        self,
        items: Sequence[tuple[Lease, JobResult]],
        tails: Sequence[TokenChunk | None] | None = None,
    ) -> list[bool]:
        return await self.leases.complete_many(items, tails)

    async def retry(self, lease: Lease, error: str) -> bool:
        return await self.leases.retry(lease, error)

    async def dead_letter(self, lease: Lease, reason: str, error: str | None = None) -> bool:
        return await self.leases.dead_letter(lease, reason, error)

    async def release(self, leases: Sequence[Lease]) -> int:
        return await self.leases.release(leases)

    async def preempt(self, leases: Sequence[Lease]) -> list[bool]:
        return await self.leases.hand_back(leases, preempt=True)

    async def beat(self, model: str, consumer: str) -> None:
        await self.leases.beat(model, consumer)

    async def reap(self, model: str, expired: bool = True) -> ReapReport:
        return await self.leases.reap(model, expired)

    # -- events and records -----------------------------------------------------------------
    async def append_events(self, events: Sequence[tuple[Lease, JobEvent]]) -> list[bool]:
        return await self.leases.append_events(events)

    async def read_events(
        self, job_id: str, after: str = "0", block_s: float = 0.0, count: int = 1000
    ) -> list[tuple[str, JobEvent]]:
        return await self.reads.read_events(job_id, after, block_s, count)

    async def read_events_many(
        self, cursors: Mapping[str, str], block_s: float = 0.0, count: int = 1000
    ) -> list[tuple[str, str, JobEvent]]:
        return await self.reads.read_events_many(cursors, block_s, count)

    async def record(self, job_id: str) -> JobRecord | None:
        return await self.reads.record(job_id)

    async def records(self, job_ids: Sequence[str]) -> list[JobRecord | None]:
        return await self.reads.records(job_ids)

    # -- cancellation -----------------------------------------------------------------------
    async def cancel(self, job_id: str) -> CancelOutcome:
        return await self.endings.cancel(job_id)

    async def leave(self, job_id: str, followers: int = 1) -> CancelOutcome:
        return await self.endings.leave(job_id, followers)

    async def cancelled(self, model: str, job_ids: Sequence[str]) -> set[str]:
        return await self.endings.cancelled(model, job_ids)

    # -- introspection ----------------------------------------------------------------------
    async def stats(self, model: str) -> BrokerStats:
        return await self.introspection.stats(model)

    async def depth(self, model: str) -> int:
        return await self.introspection.depth(model)

    async def dead_letters(self, model: str, count: int = 100) -> list[DeadLetter]:
        return await self.introspection.dead_letters(model, count)

    async def backlog(self, model: str) -> list[LaneBacklog]:
        return await self.introspection.backlog(model)

    async def models(self) -> list[str]:
        return await self.introspection.models()
