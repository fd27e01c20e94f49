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

from collections.abc import Sequence

from tokenyard.broker.core import Claim, EnqueueResult, Lease, Preempted, ReapReport
from tokenyard.broker.lanes import Front
from tokenyard.broker.nats.claims import Claims
from tokenyard.broker.nats.endings import Endings
from tokenyard.broker.nats.enqueue import Enqueuer
from tokenyard.broker.nats.introspection import Introspection
from tokenyard.broker.nats.leases import Leases
from tokenyard.broker.nats.reads import Reads
from tokenyard.broker.nats.store import Store
from tokenyard.messages import JobEvent, JobResult, JobSpec, TokenChunk


class NatsTable(Reads, Endings, Introspection):
    """What the NATS queue core hands through as it is (`core.TableReads`) and its lanes'
    counts: readers (reads.py), cancellation (endings.py), counts, dead letters and models
    (introspection.py), on the one store. It is the endings every other part ends jobs
    through."""

    def __init__(self, store: Store) -> None:
        super().__init__(store, self)


class NatsQueue(Front):
    """The queue core on NATS JetStream (nats-server >= 2.11), composed by role: the enqueue
    path (enqueue.py), claims (claims.py), holding a lease and the reap (leases.py), endings and
    cancellation (endings.py), readers (reads.py) and counts (introspection.py), each on the one
    shared state and its primitive writes (store.py)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store.settings, store.clock)
        self.conn = store.conn
        self.names = store.names
        self.store = store
        self.table = self.counts = self.endings = NatsTable(self.store)
        self.producer = Enqueuer(self.store)
        self.claims = Claims(self.store, self.endings)
        self.leases = Leases(self.store, self.endings)

    async def close(self) -> None:
        await super().close()
        await self.store.woken()
        await self.store.audit.flush()
        await self.claims.close()

    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[EnqueueResult]:
        return await self.producer.enqueue_many(specs)

    async def _claim(self, ask: Claim) -> list[Lease]:
        return await self.claims.claim(ask)

    # -- the lease holder's (leases.py) ------------------------------------------------------
    async def renew(self, leases: Sequence[Lease]) -> list[bool]:
        return await self.leases.renew(leases)

    async def append_events(self, events: Sequence[tuple[Lease, JobEvent]]) -> list[bool]:
        return await self.leases.append_events(events)

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

    async def preempt(self, leases: Sequence[Lease]) -> list[Preempted]:
        return await self.leases.hand_back(leases, preempt=True)

    async def beat(self, model: str, consumer: str) -> None:
        await self.leases.beat(model, consumer)

    async def reap(self, model: str, expired: bool = True) -> ReapReport:
        return await self.leases.reap(model, expired)
