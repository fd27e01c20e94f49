"""The broker's interface, split by role: each caller types against the Protocol it uses.

`Broker` is all roles at once; RedisBroker and MemoryBroker implement it, and every
implementation passes tests/integration/test_broker_conformance.py.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import msgspec

from tokenyard.broker.audit import AuditEntry
from tokenyard.config import BrokerSettings
from tokenyard.messages import (
    DeadLetter,
    JobEvent,
    JobRecord,
    JobResult,
    JobSpec,
    JobStatus,
    Priority,
    TokenChunk,
    WorkerInfo,
)
from tokenyard.tenancy.limiter import Decision, Quota
from tokenyard.tenancy.records import ApiKeyRecord, TenantConfig

Clock = Callable[[], float]


class EnqueueResult(msgspec.Struct, frozen=True):
    job_id: str
    created: bool  # False when the idempotency key named an existing job
    collapsed: bool = False  # joined an identical job in flight (its collapse key's)


class Lease(msgspec.Struct, frozen=True):
    """A claimed job: valid while the broker still lists `entry_id` as owned by `consumer`.

    Its lane is the job's (model, priority), both read from `spec`.
    """

    spec: JobSpec
    entry_id: str
    consumer: str
    resumable: bool = False  # an earlier delivery already streamed events for this job
    # taken as affinity work: its entry lives in the lane's affinity stream, not the lane
    affinity: bool = False

    @property
    def model(self) -> str:
        return self.spec.model

    @property
    def priority(self) -> Priority:
        return self.spec.priority


class ReapReport(msgspec.Struct, frozen=True):
    requeued: list[str]
    dead: list[str]


class CancelOutcome(enum.StrEnum):
    CANCELLED = "cancelled"  # it was waiting; it is now terminal
    SIGNALLED = "signalled"  # it is running; its worker aborts it at the next step
    ALREADY_FINISHED = "already_finished"
    NOT_FOUND = "not_found"
    FOLLOWED = "followed"  # a follower left; others still follow it, so it runs on


class LaneStats(msgspec.Struct, frozen=True):
    model: str
    priority: Priority
    waiting: int  # enqueued, not yet delivered
    in_flight: int  # delivered, not yet completed
    oldest_waiting_age_s: float | None


class BrokerStats(msgspec.Struct, frozen=True):
    model: str
    lanes: list[LaneStats]  # highest priority first
    delayed: int  # waiting out a retry backoff
    dead_letters: int
    fenced_completions: int  # late completions rejected because the lease was lost
    expired: int


class TenantBacklog(msgspec.Struct, frozen=True):
    """One tenant's jobs staged in a lane (waiting for their fair-share turn), and its weight."""

    tenant: str
    staged: int
    weight: float


class LaneBacklog(msgspec.Struct, frozen=True):
    """A priority's lanes (size pools together) as admission estimates a new job's wait."""

    priority: Priority
    queued: int  # in the lane streams, not yet delivered (the fair-share window, retries)
    in_flight: int  # delivered, not yet completed
    tenants: list[TenantBacklog]  # staged jobs by tenant; the ones with none are left out


class Producer(Protocol):
    """Puts jobs on their lanes (the gateway)."""

    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[EnqueueResult]:
        """Add jobs to their lanes; raises QueueFull if a lane is at its bound (nothing added)."""
        ...

    async def enqueue(self, spec: JobSpec) -> EnqueueResult:
        return (await self.enqueue_many([spec]))[0]


class Leases(Protocol):
    """Takes jobs and settles them, fenced by the lease (the worker)."""

    async def claim(
        self,
        model: str,
        consumer: str,
        slots: int,
        block_s: float = 0.0,
        pools: Sequence[int] = (0,),
        batch_room: int | None = None,
    ) -> list[Lease]:
        """Take up to `slots` jobs, higher priority first, each priority's size `pools` in the
        order given, at most `batch_room` of them from the batch lane (None: no cap); wait up
        to `block_s` if none."""
        ...

    async def renew(self, leases: Sequence[Lease]) -> list[bool]:
        """Extend leases still ours; False marks one that was lost (stop working on it)."""
        ...

    async def complete_many(
        self,
        items: Sequence[tuple[Lease, JobResult]],
        tails: Sequence[TokenChunk | None] | None = None,
    ) -> list[bool]:
        """Write terminal results, fenced by the lease; False means rejected (lease lost).

        `tails[i]`, when given, is job i's last chunk of tokens, appended just before its end.
        """
        ...

    async def complete(
        self, lease: Lease, result: JobResult, tail: TokenChunk | None = None
    ) -> bool:
        return (await self.complete_many([(lease, result)], [tail]))[0]

    async def retry(self, lease: Lease, error: str) -> bool:
        """Schedule another delivery after backoff; False if it went to the dead-letter stream."""
        ...

    async def dead_letter(self, lease: Lease, reason: str, error: str | None = None) -> bool:
        """Give up on a job now; False if the lease was already lost."""
        ...

    async def release(self, leases: Sequence[Lease]) -> int:
        """Hand jobs back for immediate redelivery (drain); returns how many were still ours."""
        ...

    async def reap(self, model: str) -> ReapReport:
        """Requeue jobs whose lease expired; dead-letter those past the delivery limit."""
        ...


class Events(Protocol):
    """Per-job event streams: the worker appends, the gateway follows.

    Contract: once a job is terminal, reading its events ends with a `Finished` event carrying
    its result.
    """

    async def append_events(self, events: Sequence[tuple[Lease, JobEvent]]) -> list[bool]:
        """Append events in one round trip, fenced: False where the lease was lost."""
        ...

    async def read_events(
        self, job_id: str, after: str = "0", block_s: float = 0.0, count: int = 1000
    ) -> list[tuple[str, JobEvent]]:
        """Events with id greater than `after`; waits up to `block_s` when there are none."""
        ...

    async def read_events_many(
        self,
        cursors: Mapping[str, str],
        block_s: float = 0.0,
        count: int = 1000,
    ) -> list[tuple[str, str, JobEvent]]:
        """(job_id, event_id, event) after each job's cursor, in one read over every stream;
        waits up to `block_s` when none has any. All jobs must share a model (one hash slot).
        """
        ...


class Records(Protocol):
    """What the broker knows about one job."""

    async def record(self, job_id: str) -> JobRecord | None: ...

    async def records(self, job_ids: Sequence[str]) -> list[JobRecord | None]:
        """Several jobs' records (of any models) in one round trip; None where unknown."""
        return [await self.record(j) for j in job_ids]


class Cancellation(Protocol):
    """Clients ask to cancel; workers learn which of their running jobs to abort."""

    async def cancel(self, job_id: str) -> CancelOutcome: ...

    async def cancelled(self, model: str, job_ids: Sequence[str]) -> set[str]:
        """Which of these running jobs a client asked to cancel."""
        ...

    async def leave(self, job_id: str, followers: int = 1) -> CancelOutcome:
        """Live callers stop following; the job is cancelled once no follower is left (a job
        that never collapsed has one follower, its creator)."""
        ...


class ResponseStore(Protocol):
    """The response cache's shared tier: encoded results by digest, per model."""

    async def cache_get(self, model: str, digest: str) -> bytes | None: ...

    async def cache_put(
        self, model: str, digest: str, value: bytes, ttl_s: float, max_bytes: int
    ) -> None:
        """Store with a TTL; the model's entries stay under `max_bytes` (the soonest to expire
        are evicted first)."""
        ...


class WorkerRegistry(Protocol):
    """Live workers, by heartbeat."""

    async def heartbeat(self, info: WorkerInfo, ttl_s: float) -> None:
        """Register or refresh a worker; it counts as live for `ttl_s` seconds."""
        ...

    async def deregister(self, model: str, consumer: str) -> None: ...

    async def workers(self, model: str) -> list[WorkerInfo]:
        """Workers of a model whose heartbeat has not lapsed."""
        ...


class Stats(Protocol):
    """Depths, ages and counters, for `tokenyard status` and /metrics."""

    async def stats(self, model: str) -> BrokerStats: ...

    async def depth(self, model: str) -> int:
        """Jobs of a model waiting or in flight, over all lanes; one round trip, for polling."""
        ...

    async def dead_letters(self, model: str, count: int = 100) -> list[DeadLetter]: ...

    async def backlog(self, model: str) -> list[LaneBacklog]:
        """Each priority's waiting work by tenant, highest priority first (two round trips)."""
        ...

    async def models(self) -> list[str]: ...


class Directory(Protocol):
    """Tenants and API keys (by digest), shared by every gateway; written by `tokenyard keys`
    and `tokenyard tenants`."""

    async def put_tenant(self, tenant: TenantConfig) -> None: ...

    async def tenant(self, name: str) -> TenantConfig | None: ...

    async def tenants(self) -> list[TenantConfig]: ...

    async def put_api_key(self, record: ApiKeyRecord) -> None:
        """Store (or replace, e.g. to revoke) the record of the key with `record.digest`."""
        ...

    async def api_key(self, digest: str) -> ApiKeyRecord | None: ...

    async def api_keys(self) -> list[ApiKeyRecord]: ...

    async def has_api_keys(self) -> bool:
        """Whether any key was ever stored (revoked ones count): then every call needs a key."""
        ...


class Settlement(msgspec.Struct, frozen=True):
    """A job of `tenant` reached a terminal state having used `actual` tokens (0: refunded)."""

    tenant: str
    job_id: str
    actual: int = 0


def settlement(spec: JobSpec, result: JobResult | None) -> Settlement:
    """What a terminal job's quota reservation settles to: its real tokens when it succeeded;
    a failed, cancelled, expired or dead job is refunded."""
    actual = 0
    if result is not None and result.status is JobStatus.SUCCEEDED:
        prompt = result.prompt_tokens or len(spec.prompt_token_ids or ())
        actual = prompt + result.completion_tokens
    return Settlement(spec.tenant, spec.id, actual)


class Quotas(Protocol):
    """Per-tenant quotas, exact across gateways: reserved at admission, settled once per job
    at its terminal state (complete, dead, cancel settle themselves; `settle_finished` catches
    the rest: expired at claim, a crash between a terminal write and its settle)."""

    async def reserve(
        self, tenant: str, quota: Quota, items: Sequence[tuple[str, int]]
    ) -> list[Decision]:
        """Decide each (job id, tokens) in order, atomically; admitted ones are held."""
        ...

    async def settle(self, items: Sequence[Settlement]) -> int:
        """Release held reservations; idempotent per job. Returns how many were released."""
        ...

    async def settle_finished(self, grace_s: float = 30.0) -> int:
        """Settle held jobs that are terminal, or have no record `grace_s` after reserving
        (their enqueue never landed). Returns how many were released."""
        ...


class Audit(Protocol):
    """The audit trail (tokenyard/broker/audit.py): every job's receipt and terminal state, bounded
    by `BrokerSettings.audit_max_len`; written by enqueue and the terminal paths themselves."""

    async def audit_entries(
        self,
        since: float,
        tenant: str | None = None,
        model: str | None = None,
        cursor: str | None = None,
        count: int = 1000,
    ) -> tuple[str | None, list[AuditEntry]]:
        """Entries written at or after `since` (unix s) matching the filters, oldest first,
        from at most `count` read past `cursor`; the next cursor, None at the end."""
        ...


class Broker(
    Producer,
    Leases,
    Events,
    Records,
    Cancellation,
    ResponseStore,
    WorkerRegistry,
    Stats,
    Directory,
    Quotas,
    Audit,
    Protocol,
):
    """Every role at once, plus the settings it runs under and its connection's lifetime."""

    settings: BrokerSettings
    clock: Clock

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        """Release connections."""
        return None
