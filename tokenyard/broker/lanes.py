"""A queue core made of lanes over a job table.

The lanes carry jobs to workers (enqueue, claim, renew, the fenced event appends and endings,
release, reap, depths); the table keeps what each job is (`core.JobTable`). `Front` is what
every queue core composed of parts hands through (group commit for single enqueues, a claim
to the lanes' own, the table's reads and the lanes' counts); `LanesOnTable` adds what every
lanes implementation over a job table shares: the liveness beat and retry and dead letter as
one failure path. Redis Streams lanes and RabbitMQ lanes are each one of these over the Valkey
table (`redis/table.py`); the NATS queue (nats/queue.py) is a `Front` over its own parts.
"""

from __future__ import annotations

import random
from abc import abstractmethod
from collections import defaultdict
from collections.abc import Mapping, Sequence

from tokenyard.broker import machine
from tokenyard.broker.core import (
    BrokerStats,
    CancelOutcome,
    Clock,
    EnqueueResult,
    JobTable,
    LaneBacklog,
    LaneCounts,
    LaneWaiting,
    Lease,
    QueueCore,
    TableReads,
)
from tokenyard.broker.group_commit import GroupCommit
from tokenyard.broker.policy import claim_order
from tokenyard.config import BrokerSettings
from tokenyard.messages import DeadLetter, JobEvent, JobRecord, JobSpec, Priority


class Front(QueueCore):
    """A queue core composed of parts: single enqueues go through group commit to
    `enqueue_many`, a claim of at least one slot to the subclass's `_claim`, counts to
    `counts`, and a job's record, events, cancellation, dead letters and the models to
    `table`."""

    table: TableReads
    counts: LaneCounts

    def __init__(self, settings: BrokerSettings, clock: Clock) -> None:
        self.settings = settings
        self.clock = clock
        self._group = GroupCommit(
            self.enqueue_many,
            max_batch=settings.enqueue_batch,
            window_s=settings.enqueue_window_s,
        )

    async def enqueue(self, spec: JobSpec) -> EnqueueResult:
        """One job; concurrent callers of this broker share script calls (group commit)."""
        return await self._group.enqueue(spec)

    async def close(self) -> None:
        """Send the enqueues the group commit still holds; the connections stay open."""
        await self._group.close()

    # -- the lanes' counts ------------------------------------------------------------------
    async def stats(self, model: str) -> BrokerStats:
        return await self.counts.stats(model)

    async def waiting(self, model: str, above: Priority, pools: Sequence[int]) -> list[LaneWaiting]:
        return await self.counts.waiting(model, above, pools)

    async def depth(self, model: str) -> int:
        return await self.counts.depth(model)

    async def backlog(self, model: str) -> list[LaneBacklog]:
        return await self.counts.backlog(model)

    # -- the table's -----------------------------------------------------------------------
    async def record(self, job_id: str) -> JobRecord | None:
        return await self.table.record(job_id)

    async def records(self, job_ids: Sequence[str]) -> list[JobRecord | None]:
        return await self.table.records(job_ids)

    async def read_events(
        self, job_id: str, after: str = "0", block_s: float = 0.0, count: int = 1000
    ) -> list[tuple[str, JobEvent]]:
        return await self.table.read_events(job_id, after, block_s, count)

    async def read_events_many(
        self, cursors: Mapping[str, str], block_s: float = 0.0, count: int = 1000
    ) -> list[tuple[str, str, JobEvent]]:
        return await self.table.read_events_many(cursors, block_s, count)

    async def cancel(self, job_id: str) -> CancelOutcome:
        return await self.table.cancel(job_id)

    async def leave(self, job_id: str, followers: int = 1) -> CancelOutcome:
        return await self.table.leave(job_id, followers)

    async def cancelled(self, model: str, job_ids: Sequence[str]) -> set[str]:
        return await self.table.cancelled(model, job_ids)

    async def dead_letters(self, model: str, count: int = 100) -> list[DeadLetter]:
        return await self.table.dead_letters(model, count)

    async def models(self) -> list[str]:
        return await self.table.models()


class LanesOnTable(Front):
    """A queue core whose lanes are the subclass's (their counts in `counts`) and whose jobs
    are `table`'s."""

    table: JobTable

    def __init__(self, table: JobTable, rng: random.Random | None = None) -> None:
        super().__init__(table.settings, table.clock)
        self.table = table
        self._rng = rng or random.Random()  # retry backoff's jitter
        # what the job machine's decisions (machine.fail, machine.lapse) depend on
        self.rules = machine.Rules.of(self.settings)
        self._rounds: dict[str, int] = defaultdict(int)  # per model: claims so far (claim_order)

    def _next_order(self, model: str, priorities: int) -> list[int]:
        """The order this claim of `model` looks at its priorities in (`policy.claim_order`:
        strict priority, and every `starvation_every`-th claim the lower ones first)."""
        order = claim_order(priorities, self._rounds[model], self.settings.starvation_every)
        self._rounds[model] += 1
        return order

    async def beat(self, model: str, consumer: str) -> None:
        await self.table.beat(model, consumer)

    # -- a failed job ----------------------------------------------------------------------
    @abstractmethod
    async def _fail(self, lease: Lease, error: str, reason: str, force_dead: bool) -> int:
        """A job its holder gives up on: retried after backoff unless `force_dead` or out of
        deliveries. 1 retrying, 0 dead-lettered, 2 ended cancelled (a client asked while it
        ran), anything else fenced (the lease was lost)."""

    async def retry(self, lease: Lease, error: str) -> bool:
        return await self._fail(lease, error, "failed", force_dead=False) == 1

    async def dead_letter(self, lease: Lease, reason: str, error: str | None = None) -> bool:
        return await self._fail(lease, error or reason, reason, force_dead=True) == 0
