"""The queue core: what every backend holds with delivery semantics, split by role.

Enqueue (idempotent, bounded, collapse-join), claim (priorities, anti-starvation, fair share,
pools, affinity), leases, fenced terminal writes, per-job events, records, cancellation and
depth. Each caller types against the role it uses; `QueueCore` is all of them, as a backend
implements it (tests/integration/test_broker_conformance.py holds every backend to it).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol

import msgspec

from tokenyard.config import BrokerSettings
from tokenyard.errors import QueueFull
from tokenyard.messages import (
    DeadLetter,
    JobEvent,
    JobRecord,
    JobResult,
    JobSpec,
    Priority,
    TokenChunk,
)

Clock = Callable[[], float]


class Trait(enum.StrEnum):
    """A guarantee that holds on some backends only, in its full form (README, "Choosing a
    broker"); a backend without it holds the weaker form named there. Each backend package
    declares its set (`TRAITS`); `tokenyard.broker.traits_of(url)` reads it without
    connecting, and tests select on it, never on a backend's name."""

    # tenants in a lane are served by start-time fair queueing (else FIFO, quotas aside)
    FAIR_SHARE = "fair_share"
    # ...with one fair-share state per lane in the server, and a window of `fair_window` staged
    # jobs queued in the lane (else each worker keeps its own tags, over every waiting job)
    FAIR_WINDOW = "fair_window"
    # earliest deadline first over all of a tenant's waiting jobs (else over one claim's)
    DEADLINE_ORDER = "deadline_order"
    # a prefixed job waits a moment for the worker that ran its prefix (else any worker)
    PREFIX_AFFINITY = "prefix_affinity"
    # the server pushes ready jobs to a worker's blocking claim (prefetch = its free slots):
    # priority holds among what was pushed, and what was pushed to one worker waits for it
    PUSHED = "pushed"
    # a reap that takes a job back fences its holder at once: whatever that holder still
    # sends under the lease is refused (else only the next holder's claim fences it, and an
    # ending the holder gets in first stands: the job still ends once, every token once)
    REAP_FENCES = "reap_fences"


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
    # times it was preempted before this delivery (by any worker): one at the bound is not
    # tried, so a worker that never preempted it does not take it out only to be refused
    preemptions: int = 0

    @property
    def model(self) -> str:
        return self.spec.model

    @property
    def priority(self) -> Priority:
        return self.spec.priority


class ReapReport(msgspec.Struct, frozen=True):
    requeued: list[str]
    dead: list[str]


class Preempted(enum.IntEnum):
    """What `Leases.preempt` did with one job. Falsy only when its holder keeps the job (so
    `bool` of it is the old answer: whether the holder must let the job go)."""

    KEPT = 0  # refused (preempted `max_preemptions` times) or the lease was lost
    PREEMPTED = 1  # back in its lane, counted in its record and audited
    CANCELLED = 2  # its client asked to cancel meanwhile: it ended cancelled, no preemption


def preempted_of(code: int) -> Preempted:
    """A hand-back script's code (release.lua, requeue.lua: 1 released, 2 cancelled, 3
    preempted too often, 0 no longer ours) as what the preemption did."""
    if code == 1:
        return Preempted.PREEMPTED
    return Preempted.CANCELLED if code == 2 else Preempted.KEPT


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


class LaneWaiting(msgspec.Struct, frozen=True):
    """What waits in one priority's lanes, of the size pools a caller asked about."""

    priority: Priority
    waiting: int
    oldest_waiting_age_s: float | None

    @staticmethod
    def by_priority(rows: Iterable[tuple[Priority, int, float | None]]) -> list[LaneWaiting]:
        """Per-lane (priority, waiting, oldest age) rows summed per priority, highest first;
        a priority with nothing waiting left out."""
        waiting: dict[Priority, int] = {}
        ages: dict[Priority, float] = {}
        for priority, n, age in rows:
            if n <= 0:
                continue
            waiting[priority] = waiting.get(priority, 0) + n
            if age is not None:
                ages[priority] = max(age, ages.get(priority, age))
        return [LaneWaiting(p, waiting[p], ages.get(p)) for p in sorted(waiting)]


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


def admitted(results: list[EnqueueResult | None], full: QueueFull | None) -> list[EnqueueResult]:
    """An enqueue's results (one per job) or, where a model's lane refused its jobs (`full`;
    their results None), that refusal raised with the results that stand (`QueueCore`)."""
    if full is not None:
        full.admitted = results
        raise full
    return [r for r in results if r is not None]


class Producer(Protocol):
    """Puts jobs on their lanes (the gateway)."""

    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[EnqueueResult]:
        """Add jobs to their lanes, each model's jobs all or none (see `QueueCore`): raises
        QueueFull if a lane is at its bound, its `admitted` saying what stands."""
        ...

    async def enqueue(self, spec: JobSpec) -> EnqueueResult:
        return (await self.enqueue_many([spec]))[0]


class Claim(NamedTuple):
    """What a claim asks for (`Leases.claim`), at least one slot."""

    model: str
    consumer: str
    slots: int
    block_s: float
    pools: Sequence[int]
    batch_room: int | None


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
        if slots <= 0:
            return []
        return await self._claim(Claim(model, consumer, slots, block_s, pools, batch_room))

    async def _claim(self, ask: Claim) -> list[Lease]:
        """The lanes' claim (`claim`'s arguments, at least one slot)."""
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

    async def preempt(self, leases: Sequence[Lease]) -> list[Preempted]:
        """Hand running jobs back for higher-priority work (machine.preempt): a release that
        is counted in each job's record and audited; their streamed tokens stay, so the next
        holder resumes after them. KEPT where the lease was lost or the job was preempted
        `max_preemptions` times already (then its holder runs it to its end); CANCELLED where
        its client asked to cancel meanwhile (it ended so, neither counted nor audited)."""
        ...

    async def beat(self, model: str, consumer: str) -> None:
        """This worker lives for `liveness_s` more: until then no reap takes its jobs over
        unless their leases expire. Only a worker that beat can be found dead this way."""
        ...

    async def reap(self, model: str, expired: bool = True) -> ReapReport:
        """Requeue the jobs of workers whose liveness lapsed (then forget those workers) and,
        with `expired`, the jobs whose lease expired; dead-letter those past the delivery
        limit. A requeued job resumes from its streamed tokens."""
        ...


class EventReads(Protocol):
    """Per-job event streams as the gateway follows them.

    Contract: once a job is terminal, reading its events ends with a `Finished` event carrying
    its result.
    """

    async def read_events(
        self, job_id: str, after: str = "0", block_s: float = 0.0, count: int = 1000
    ) -> list[tuple[str, JobEvent]]:
        """Events with id greater than `after`; waits up to `block_s` when there are none."""
        found = await self.read_events_many({job_id: after}, block_s, count)
        return [(eid, event) for _, eid, event in found]

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


class Events(EventReads, Protocol):
    """Per-job event streams: the worker appends (fenced by its lease), the gateway follows."""

    async def append_events(self, events: Sequence[tuple[Lease, JobEvent]]) -> list[bool]:
        """Append events in one round trip, fenced: False where the lease was lost."""
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


class LaneCounts(Protocol):
    """What waits and runs in a model's lanes."""

    async def stats(self, model: str) -> BrokerStats: ...

    async def waiting(self, model: str, above: Priority, pools: Sequence[int]) -> list[LaneWaiting]:
        """What waits in the lanes that outrank `above`, of size pools `pools`. Only those
        lanes are read: the preemption look-out asks every few milliseconds while its worker
        is full, and may take nothing from a pool it does not serve."""
        ...

    async def depth(self, model: str) -> int:
        """Jobs of a model waiting or in flight, over all lanes; one round trip, for polling."""
        ...

    async def backlog(self, model: str) -> list[LaneBacklog]:
        """Each priority's waiting work by tenant, highest priority first (two round trips)."""
        ...


class Stats(LaneCounts, Protocol):
    """Depths, ages and counters, for `tokenyard status` and /metrics."""

    async def dead_letters(self, model: str, count: int = 100) -> list[DeadLetter]: ...

    async def models(self) -> list[str]: ...


class TableReads(Records, EventReads, Cancellation, Protocol):
    """What a queue core hands through to its job table as it is: a job's record, its events
    as readers follow them, cancellation, dead letters and the models seen."""

    async def dead_letters(self, model: str, count: int = 100) -> list[DeadLetter]: ...

    async def models(self) -> list[str]: ...


class JobTable(TableReads, Protocol):
    """What lanes leave to a job table: its reads (`TableReads`), workers' liveness, and the
    settlement of a job that ended (its quota, its audit entry). Lanes keep the rest: enqueue,
    claim, leases, the fenced appends and endings (which change the table under the lanes' own
    fences), reaps (which read the liveness), depths."""

    settings: BrokerSettings
    clock: Clock

    async def beat(self, model: str, consumer: str) -> None:
        """As `Leases.beat`: the worker lives for `liveness_s` more."""
        ...

    async def settle(
        self, ended: Sequence[tuple[JobSpec, JobResult | None]], audited: bool = True
    ) -> None:
        """Settle the quotas of jobs that just ended and, unless their ending wrote it
        already (`audited=False`), audit their ends."""
        ...


class QueueCore(Producer, Leases, Events, Records, Cancellation, Stats, Protocol):
    """Every queue role at once, and the settings the backend runs under.

    A batch of jobs (`enqueue_many`) is admitted model by model, each model's jobs all or
    none: when a lane of one model is at its bound, none of that model's jobs is added and
    every other model's jobs are (as if each model's had come in a call of its own, as group
    commit sends them: a full lane refuses exactly the jobs bound for it). The call then
    raises that lane's QueueFull, whose `admitted` holds the batch's results where they stand
    and None for the refused jobs, so a caller retries those alone.
    """

    settings: BrokerSettings
    clock: Clock

    async def close(self) -> None:
        """Send what it holds back (e.g. group commit's waiting enqueues); the backend's
        connections stay open for the tables."""
        ...
