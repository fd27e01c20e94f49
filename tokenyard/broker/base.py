"""The Broker interface: durable lanes, leases, fenced completion, retries, events and records."""

from __future__ import annotations

import abc
import enum
import time
from collections.abc import Callable, Mapping, Sequence

import msgspec

from tokenyard.config import BrokerSettings
from tokenyard.messages import (
    DeadLetter,
    JobEvent,
    JobRecord,
    JobResult,
    JobSpec,
    TokenChunk,
    WorkerInfo,
)

Clock = Callable[[], float]


class EnqueueResult(msgspec.Struct, frozen=True):
    job_id: str
    created: bool  # False when the idempotency key named an existing job


class Lease(msgspec.Struct, frozen=True):
    """A claimed job: valid while the broker still lists `entry_id` as owned by `consumer`."""

    spec: JobSpec
    lane: str
    entry_id: str
    consumer: str
    resumable: bool = False  # an earlier delivery already streamed events for this job


class ReapReport(msgspec.Struct, frozen=True):
    requeued: list[str]
    dead: list[str]


class CancelOutcome(enum.StrEnum):
    CANCELLED = "cancelled"  # it was waiting; it is now terminal
    SIGNALLED = "signalled"  # it is running; its worker aborts it at the next step
    ALREADY_FINISHED = "already_finished"
    NOT_FOUND = "not_found"


class LaneStats(msgspec.Struct, frozen=True):
    lane: str
    waiting: int  # enqueued, not yet delivered
    in_flight: int  # delivered, not yet completed
    oldest_waiting_age_s: float | None


class BrokerStats(msgspec.Struct, frozen=True):
    model: str
    lanes: list[LaneStats]
    delayed: int  # waiting out a retry backoff
    dead_letters: int
    fenced_completions: int  # late completions rejected because the lease was lost
    expired: int


class Broker(abc.ABC):
    """Every implementation passes tests/integration/test_broker_conformance.py."""

    def __init__(self, settings: BrokerSettings, clock: Clock = time.time) -> None:
        self.settings = settings
        self.clock = clock

    # -- producing -------------------------------------------------------------------------
    @abc.abstractmethod
    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[EnqueueResult]:
        """Add jobs to their lanes; raises QueueFull if a lane is at its bound (nothing added)."""

    async def enqueue(self, spec: JobSpec) -> EnqueueResult:
        return (await self.enqueue_many([spec]))[0]

    # -- consuming -------------------------------------------------------------------------
    @abc.abstractmethod
    async def claim(
        self, model: str, consumer: str, slots: int, block_s: float = 0.0
    ) -> list[Lease]:
        """Take up to `slots` jobs, higher priority first; wait up to `block_s` if none."""

    @abc.abstractmethod
    async def renew(self, leases: Sequence[Lease]) -> list[bool]:
        """Extend leases still ours; False marks one that was lost (stop working on it)."""

    @abc.abstractmethod
    async def complete_many(
        self,
        items: Sequence[tuple[Lease, JobResult]],
        tails: Sequence[TokenChunk | None] | None = None,
    ) -> list[bool]:
        """Write terminal results, fenced by the lease; False means rejected (lease lost).

        `tails[i]`, when given, is job i's last chunk of tokens, appended just before its end.
        """

    async def complete(
        self, lease: Lease, result: JobResult, tail: TokenChunk | None = None
    ) -> bool:
        return (await self.complete_many([(lease, result)], [tail]))[0]

    @abc.abstractmethod
    async def retry(self, lease: Lease, error: str) -> bool:
        """Schedule another delivery after backoff; False if it went to the dead-letter stream."""

    @abc.abstractmethod
    async def dead_letter(self, lease: Lease, reason: str, error: str | None = None) -> bool:
        """Give up on a job now; False if the lease was already lost."""

    @abc.abstractmethod
    async def release(self, leases: Sequence[Lease]) -> int:
        """Hand jobs back for immediate redelivery (drain); returns how many were still ours."""

    @abc.abstractmethod
    async def reap(self, model: str) -> ReapReport:
        """Requeue jobs whose lease expired; dead-letter those past the delivery limit."""

    # -- cancellation ----------------------------------------------------------------------
    @abc.abstractmethod
    async def cancel(self, job_id: str) -> CancelOutcome: ...

    @abc.abstractmethod
    async def cancelled(self, model: str, job_ids: Sequence[str]) -> set[str]:
        """Which of these running jobs a client asked to cancel."""

    # -- events and records ----------------------------------------------------------------
    @abc.abstractmethod
    async def append_events(self, events: Sequence[tuple[Lease, JobEvent]]) -> list[bool]:
        """Append events in one round trip, fenced: False where the lease was lost."""

    @abc.abstractmethod
    async def read_events(
        self, job_id: str, after: str = "0", block_s: float = 0.0, count: int = 1000
    ) -> list[tuple[str, JobEvent]]:
        """Events with id greater than `after`; waits up to `block_s` when there are none."""

    @abc.abstractmethod
    async def read_events_many(
        self,
        cursors: Mapping[str, str],
        block_s: float = 0.0,
        count: int = 1000,
    ) -> list[tuple[str, str, JobEvent]]:
        """(job_id, event_id, event) after each job's cursor, in one read over every stream;
        waits up to `block_s` when none has any. All jobs must share a model (one hash slot).
        """

    @abc.abstractmethod
    async def record(self, job_id: str) -> JobRecord | None: ...

    # -- introspection ---------------------------------------------------------------------
    @abc.abstractmethod
    async def stats(self, model: str) -> BrokerStats: ...

    @abc.abstractmethod
    async def dead_letters(self, model: str, count: int = 100) -> list[DeadLetter]: ...

    @abc.abstractmethod
    async def models(self) -> list[str]: ...

    # -- workers ---------------------------------------------------------------------------
    @abc.abstractmethod
    async def heartbeat(self, info: WorkerInfo, ttl_s: float) -> None:
        """Register or refresh a worker; it counts as live for `ttl_s` seconds."""

    @abc.abstractmethod
    async def deregister(self, model: str, consumer: str) -> None: ...

    @abc.abstractmethod
    async def workers(self, model: str) -> list[WorkerInfo]:
        """Workers of a model whose heartbeat has not lapsed."""

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
