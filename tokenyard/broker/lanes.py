"""A queue core made of lanes over a job table.

The lanes carry jobs to workers (enqueue, claim, renew, the fenced event appends and endings,
release, reap, depths); the table keeps what each job is (`core.JobTable`). `LanesOnTable`
is the part of a queue core that is the table's, handed through, and what every lanes
implementation shares besides: group commit for single enqueues, and retry and dead letter as
one failure path. Redis Streams lanes and RabbitMQ lanes are each one of these over the Valkey
table (`redis/table.py`).
"""

from __future__ import annotations

import random
from abc import abstractmethod
from collections import defaultdict
from collections.abc import Mapping, Sequence

from tokenyard.broker.core import CancelOutcome, EnqueueResult, JobTable, Lease, QueueCore
from tokenyard.broker.group_commit import GroupCommit
from tokenyard.messages import DeadLetter, JobEvent, JobRecord, JobSpec


class LanesOnTable(QueueCore):
    """A queue core whose lanes are the subclass's and whose jobs are `table`'s."""

    table: JobTable

    def __init__(self, table: JobTable, rng: random.Random | None = None) -> None:
        self.table = table
        self.settings = table.settings
        self.clock = table.clock
        self._rng = rng or random.Random()  # retry backoff's jitter
        self._rounds: dict[str, int] = defaultdict(int)  # per model: claims so far (claim_order)
        self._group = GroupCommit(
            self.enqueue_many,
            max_batch=self.settings.enqueue_batch,
            window_s=self.settings.enqueue_window_s,
        )

    async def enqueue(self, spec: JobSpec) -> EnqueueResult:
        """One job; concurrent callers of this broker share script calls (group commit)."""
        return await self._group.enqueue(spec)

    async def close(self) -> None:
        """Send the enqueues the group commit still holds; the connections stay open."""
        await self._group.close()

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

    async def beat(self, model: str, consumer: str) -> None:
        await self.table.beat(model, consumer)

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
