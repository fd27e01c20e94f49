"""In-process broker with the Redis broker's semantics, for the library and unit tests."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import random
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tokenyard.broker import audit
from tokenyard.broker.audit import AuditEntry
from tokenyard.broker.base import Broker
from tokenyard.broker.core import (
    BrokerStats,
    CancelOutcome,
    Clock,
    EnqueueResult,
    LaneBacklog,
    LaneStats,
    Lease,
    ReapReport,
    TenantBacklog,
)
from tokenyard.broker.ids import tag_of_job
from tokenyard.broker.outcomes import cancelled_result, dead_result, expired_result
from tokenyard.broker.policy import (
    backoff_delay,
    claim_order,
    estimated_tokens,
    fair_cost,
    hold_for,
    overdue,
    size_pool,
    staging_score,
)
from tokenyard.broker.tables import Settlement, settlement
from tokenyard.config import BrokerSettings
from tokenyard.errors import QueueFull
from tokenyard.messages import (
    DeadLetter,
    Finished,
    JobEvent,
    JobRecord,
    JobResult,
    JobSpec,
    JobStatus,
    Priority,
    TokenChunk,
    WorkerInfo,
    decode,
    decode_event,
    encode,
)
from tokenyard.tenancy import limiter
from tokenyard.tenancy.limiter import Decision, Quota, QuotaState
from tokenyard.tenancy.records import ApiKeyRecord, TenantConfig

LaneId = tuple[str, Priority, int]  # (model, priority, size pool)


@dataclass
class _Entry:
    entry_id: str
    job_id: str
    owner: str | None = None
    touched: float = 0.0


@dataclass
class _Fair:
    """A lane's fair share (as lua/lib/fair.lua): per-tenant staged jobs, start tags."""

    staged: dict[str, list[tuple[float, int, str]]] = field(default_factory=dict)  # heaps
    active: dict[str, float] = field(default_factory=dict)  # tenant -> start tag
    idle: dict[str, float] = field(default_factory=dict)  # tag of a tenant with none staged
    weight: dict[str, float] = field(default_factory=dict)
    cost: dict[str, int] = field(default_factory=dict)  # staged job -> cost
    v: float = 0.0  # virtual time: the tag of the job last moved into the lane
    seq: int = 0
    count: int = 0

    def stage(self, tenant: str, weight: float, score: float, job_id: str, cost: int) -> None:
        self.seq += 1
        heapq.heappush(self.staged.setdefault(tenant, []), (score, self.seq, job_id))
        self.weight[tenant], self.cost[job_id] = weight, cost
        self.count += 1
        if tenant not in self.active:
            self.active[tenant] = max(self.idle.get(tenant, 0.0), self.v)

    def pop(self) -> str | None:
        """The next job in fair order, or None when nothing is staged."""
        if not self.active:
            return None
        tenant = min(self.active, key=lambda t: (self.active[t], t))
        tag = self.active[tenant]
        heap = self.staged[tenant]
        _, _, job_id = heapq.heappop(heap)
        next_tag = tag + self.cost.pop(job_id, 1) / self.weight.get(tenant, 1.0)
        self.v = tag
        if heap:
            self.active[tenant] = next_tag
        else:
            del self.active[tenant], self.staged[tenant]
            self.idle[tenant] = next_tag
        self.count -= 1
        return job_id


@dataclass
class _Lane:
    entries: OrderedDict[str, _Entry] = field(default_factory=OrderedDict)  # not yet acked
    last_delivered: int = -1  # index into the id sequence, like a group's last-delivered-id
    undelivered: list[str] = field(default_factory=list)
    fair: _Fair = field(default_factory=_Fair)


@dataclass
class _Job:
    spec: bytes
    model: str
    priority: Priority
    pool: int
    status: JobStatus = JobStatus.QUEUED
    deliveries: int = 0
    enqueued_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    worker: str | None = None
    last_error: str | None = None
    cancel: bool = False
    result: bytes | None = None
    deadline: float | None = None
    expires_at: float | None = None
    followers: int = 0  # live callers of a collapsed job (see `leave`)
    prefix: str = ""  # prefix affinity: its prefix key


class MemoryStore:
    """The shared state; several MemoryBroker handles on one store act like clients of one Redis."""

    def __init__(self) -> None:
        self.lanes: dict[LaneId, _Lane] = defaultdict(_Lane)
        self.jobs: dict[str, _Job] = {}
        # (model, tenant, key) -> (job id, valid until)
        self.idempotency: dict[tuple[str, str, str], tuple[str, float]] = {}
        # (model, collapse key) -> (job id, valid until)
        self.inflight: dict[tuple[str, str], tuple[str, float]] = {}
        # prefix affinity: (model, prefix key) -> (worker that last claimed it, valid until);
        # per lane, job id -> (worker it is held for, held at), in the order held
        self.prefix_owner: dict[tuple[str, str], tuple[str, float]] = {}
        self.affinity_held: dict[LaneId, dict[str, tuple[str, float]]] = defaultdict(dict)
        # model -> digest -> (value, valid until), in insertion order; bytes held per model
        self.cache: dict[str, dict[str, tuple[bytes, float]]] = defaultdict(dict)
        self.cache_bytes: dict[str, int] = defaultdict(int)
        self.delayed: dict[str, dict[str, float]] = defaultdict(dict)
        self.cancels: dict[str, set[str]] = defaultdict(set)
        self.dead_letters: dict[str, list[DeadLetter]] = defaultdict(list)
        self.counters: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.events: dict[str, list[tuple[str, bytes]]] = defaultdict(list)
        self.models: set[str] = set()
        self.workers: dict[str, dict[str, tuple[WorkerInfo, float]]] = defaultdict(dict)
        self.tenants: dict[str, TenantConfig] = {}
        self.api_keys: dict[str, ApiKeyRecord] = {}  # by digest
        self.quota: dict[str, QuotaState] = defaultdict(QuotaState)
        # tenant -> job id -> (reserved tokens, seconds per token, reserved at, budget period)
        self.held: dict[str, dict[str, tuple[int, float, float, float | None]]] = defaultdict(dict)
        # the audit trail: (sequence, entry), oldest first, trimmed to audit_max_len
        self.audit: deque[tuple[int, AuditEntry]] = deque()
        self.audit_seq = 0
        self._last_ms = 0
        self._seq = 0
        self._waiters: list[asyncio.Future[None]] = []

    def next_id(self, now: float) -> str:
        ms = max(int(now * 1000), self._last_ms)
        self._seq = self._seq + 1 if ms == self._last_ms else 0
        self._last_ms = ms
        return f"{ms}-{self._seq}"

    def notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self, seconds: float) -> None:
        """Sleep until something changes or `seconds` pass."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(waiter, seconds)


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class MemoryBroker(Broker):
    def __init__(
        self,
        settings: BrokerSettings,
        clock: Clock = time.time,
        store: MemoryStore | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.store = store or MemoryStore()
        self._rounds: dict[str, int] = defaultdict(int)
        self._rng = rng or random.Random()

    # -- helpers ---------------------------------------------------------------------------
    def _job(self, job_id: str) -> _Job | None:
        job = self.store.jobs.get(job_id)
        if job is not None and job.expires_at is not None and job.expires_at <= self.clock():
            del self.store.jobs[job_id]
            self.store.events.pop(job_id, None)
            return None
        return job

    def _owned(self, lease: Lease) -> _Entry | None:
        entry = self.store.lanes[_lane(lease.spec)].entries.get(lease.entry_id)
        if entry is None or entry.owner != lease.consumer:
            return None
        return entry

    def _add_entry(self, lane: LaneId, job_id: str, now: float) -> None:
        entry_id = self.store.next_id(now)
        state = self.store.lanes[lane]
        state.entries[entry_id] = _Entry(entry_id, job_id)
        state.undelivered.append(entry_id)

    def _remove_entry(self, lane: LaneId, entry_id: str) -> None:
        self.store.lanes[lane].entries.pop(entry_id, None)

    def _emit(self, job_id: str, payload: bytes) -> None:
        self.store.events[job_id].append((self.store.next_id(self.clock()), payload))

    def _audit(self, entries: Sequence[AuditEntry]) -> None:
        bound = self.settings.audit_max_len
        if bound <= 0:
            return
        trail = self.store.audit
        for entry in entries:
            self.store.audit_seq += 1
            trail.append((self.store.audit_seq, entry))
        while len(trail) > bound:
            trail.popleft()

    def _finish(
        self, job: _Job, job_id: str, result: JobResult, now: float, audited: bool = True
    ) -> None:
        if audited:
            self._audit([audit.terminal(decode(job.spec, JobSpec), result, now)])
        job.status = result.status
        job.result = encode(result)
        job.finished_at = now
        job.expires_at = now + self.settings.record_ttl_s
        self._emit(job_id, encode(Finished(result=result)))
        self.store.cancels[job.model].discard(job_id)

    def _to_dead_letters(self, job: _Job, job_id: str, reason: str, error: str, now: float) -> None:
        job.last_error = error
        self._finish(job, job_id, dead_result(f"{reason}: {error}"), now)
        self.store.dead_letters[job.model].append(
            DeadLetter(
                job_id=job_id,
                model=job.model,
                priority=job.priority,
                reason=reason,
                error=error,
                deliveries=job.deliveries,
                at=now,
            )
        )

    # -- producing -------------------------------------------------------------------------
    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[EnqueueResult]:
        """All or nothing: a batch that would overflow a lane adds no job."""
        now = self.clock()
        store = self.store
        results: list[EnqueueResult] = []
        fresh: list[tuple[JobSpec, tuple[str, str, str] | None]] = []
        taken_ids: set[str] = set()
        taken_keys: dict[tuple[str, str, str], str] = {}
        taken_inflight: dict[tuple[str, str], str] = {}
        joins: dict[str, int] = defaultdict(int)
        adding: dict[LaneId, int] = defaultdict(int)
        for spec in specs:
            if not spec.created_at:
                spec.created_at = now
            spec.pool = size_pool(estimated_tokens(spec), self.settings.pool_bounds)
            idem = (spec.model, spec.tenant, spec.idempotency_key) if spec.idempotency_key else None
            existing = None
            if idem is not None:
                known = store.idempotency.get(idem)
                existing = taken_keys.get(idem) or (known[0] if known and known[1] > now else None)
            if existing is None and (spec.id in taken_ids or self._job(spec.id) is not None):
                existing = spec.id  # a resent enqueue whose first attempt did land
            inflight = (spec.model, spec.collapse_key) if spec.collapse_key else None
            if existing is None and inflight is not None:
                joined = taken_inflight.get(inflight) or self._in_flight(inflight, now)
                if joined is not None:
                    joins[joined] += 1
                    results.append(EnqueueResult(job_id=joined, created=False, collapsed=True))
                    continue
            if existing is not None:
                results.append(EnqueueResult(job_id=existing, created=False))
                continue
            results.append(EnqueueResult(job_id=spec.id, created=True))
            fresh.append((spec, idem))
            taken_ids.add(spec.id)
            if idem is not None:
                taken_keys[idem] = spec.id
            if inflight is not None:
                taken_inflight[inflight] = spec.id
            adding[_lane(spec)] += 1
        for lane, count in adding.items():
            depth = len(store.lanes[lane].entries) + store.lanes[lane].fair.count
            depth += len(store.affinity_held[lane])
            if depth + count > self.settings.max_queue_depth:
                model, priority, _ = lane
                label = f"{model}/{priority.name.lower()}"
                raise QueueFull(label, depth, self.settings.max_queue_depth)
        refill: set[LaneId] = set()
        for spec, idem in fresh:
            lane = _lane(spec)
            store.jobs[spec.id] = _Job(
                spec=encode(spec),
                model=spec.model,
                priority=spec.priority,
                pool=spec.pool,
                enqueued_at=now,
                deadline=spec.deadline,
                prefix=spec.prefix_key,
            )
            owner = self._prefix_owner(spec.model, spec.prefix_key, now)
            held = store.affinity_held[lane]
            waiting_for = sum(1 for o, _ in held.values() if o == owner)
            if owner is not None and hold_for(owner, waiting_for, self.settings.affinity_max_held):
                held[spec.id] = (owner, now)  # as enqueue.lua: held for the prefix's worker
            else:
                store.lanes[lane].fair.stage(
                    spec.tenant, spec.weight, staging_score(spec), spec.id, fair_cost(spec)
                )
                refill.add(lane)
            if idem is not None:
                store.idempotency[idem] = (spec.id, now + self.settings.idempotency_ttl_s)
            if spec.collapse_key:
                key = (spec.model, spec.collapse_key)
                store.inflight[key] = (spec.id, now + self.settings.idempotency_ttl_s)
                store.jobs[spec.id].followers = 1
            store.models.add(spec.model)
        self._audit([audit.received(spec, now) for spec, _ in fresh])
        for job_id, count in joins.items():  # counted only now: a refused batch joins nothing
            store.jobs[job_id].followers += count
        for lane in refill:
            self._refill(lane, max(1, self.settings.fair_window), now)
        store.notify()
        return results

    def _in_flight(self, key: tuple[str, str], now: float) -> str | None:
        """The queued or running job a collapse key names, if any."""
        known = self.store.inflight.get(key)
        if known is None or known[1] <= now:
            return None
        job = self._job(known[0])
        return known[0] if job is not None and not job.status.terminal else None

    def _prefix_owner(self, model: str, prefix: str, now: float) -> str | None:
        """The live worker that owns a prefix (as enqueue.lua / claim.lua), if any."""
        known = self.store.prefix_owner.get((model, prefix)) if prefix else None
        if known is None or known[1] <= now:
            return None
        return known[0] if self._alive(model, known[0], now) else None

    def _alive(self, model: str, consumer: str, now: float) -> bool:
        beat = self.store.workers[model].get(consumer)
        return beat is not None and beat[1] > now

    def _refill(self, lane: LaneId, want: int, now: float) -> int:
        """Top the lane up to `want` undelivered jobs from its tenants' staged ones."""
        state, moved = self.store.lanes[lane], 0
        while len(state.undelivered) < want:
            job_id = state.fair.pop()
            if job_id is None:
                break
            self._add_entry(lane, job_id, now)
            moved += 1
        return moved

    # -- consuming -------------------------------------------------------------------------
    async def claim(
        self,
        model: str,
        consumer: str,
        slots: int,
        block_s: float = 0.0,
        pools: Sequence[int] = (0,),
        batch_room: int | None = None,
    ) -> list[Lease]:
        if slots <= 0:
            return []
        give_up_at = time.monotonic() + block_s
        while True:
            leases = self._claim_now(model, consumer, slots, pools, batch_room)
            wait = give_up_at - time.monotonic()
            if leases or wait <= 0:
                return leases
            due = list(self.store.delayed[model].values())
            # prefix affinity: a job held for another worker may be taken once it waited
            wait_s = self.settings.affinity_wait_s
            now = self.clock()
            due += [  # one overdue already is one this claim could not take (the batch cap)
                at + wait_s
                for lane in self._lanes(model)
                for _, at in self.store.affinity_held[lane].values()
                if at + wait_s > now
            ]
            if due:
                wait = min(wait, max(0.001, min(due) - self.clock()))
            await self.store.wait(wait)

    def _claim_now(
        self, model: str, consumer: str, slots: int, pools: Sequence[int], batch_room: int | None
    ) -> list[Lease]:
        now = self.clock()
        store = self.store
        delayed = store.delayed[model]
        for job_id, due_at in sorted(delayed.items(), key=lambda kv: kv[1]):
            if due_at > now:
                break
            del delayed[job_id]
            job = self._job(job_id)
            if job is not None and not job.status.terminal:
                self._add_entry((job.model, job.priority, job.pool), job_id, now)

        priorities = list(Priority)
        order = claim_order(len(priorities), self._rounds[model], self.settings.starvation_every)
        self._rounds[model] += 1
        leases: list[Lease] = []
        ordered = [(model, priorities[i], pool) for i in order for pool in pools]
        batch_left = slots if batch_room is None else max(0, batch_room)
        for lane in ordered:
            state = store.lanes[lane]
            capped = lane[1] is Priority.BATCH  # at most batch_room jobs from it
            # prefix affinity (as claim.lua): jobs held for this worker, then overdue ones
            room = min(slots - len(leases), batch_left if capped else slots)
            for job_id in self._held_for(lane, consumer, room, now):
                entry_id = store.next_id(now)
                held_entry = state.entries[entry_id] = _Entry(entry_id, job_id)
                batch_left -= capped * self._deliver(lane, held_entry, consumer, now, leases, True)
            while True:
                asked = min(slots - len(leases), batch_left if capped else slots)
                topped_up = asked + self.settings.fair_window
                if asked <= 0 or not (state.undelivered or self._refill(lane, topped_up, now)):
                    break
                self._refill(lane, topped_up, now)
                entry = state.entries.get(state.undelivered.pop(0))
                if entry is None:
                    continue
                batch_left -= capped * self._deliver(lane, entry, consumer, now, leases, False)
        if leases:
            store.notify()  # other waiters may have lanes of their own to look at
        return leases

    def _held_for(self, lane: LaneId, consumer: str, room: int, now: float) -> list[str]:
        """Up to `room` held jobs this worker takes now (its own first), no longer held."""
        held = self.store.affinity_held[lane]
        mine = [j for j, (owner, _) in held.items() if owner == consumer]
        wait_s = self.settings.affinity_wait_s
        late = [j for j, (o, at) in held.items() if o != consumer and overdue(at, now, wait_s)]
        taken = (mine + late)[: max(0, room)]
        for job_id in taken:
            del held[job_id]
        return taken

    def _deliver(
        self,
        lane: LaneId,
        entry: _Entry,
        consumer: str,
        now: float,
        leases: list[Lease],
        affinity: bool,
    ) -> bool:
        """Lease a read entry to `consumer`, or drop it if its job ended or expired."""
        store, model = self.store, lane[0]
        job = self._job(entry.job_id)
        if job is None or job.status.terminal:
            self._remove_entry(lane, entry.entry_id)
            return False
        if job.deadline is not None and job.deadline < now:
            self._remove_entry(lane, entry.entry_id)
            self._finish(job, entry.job_id, expired_result(), now)
            self._settle_ids([entry.job_id])
            store.counters[model]["expired"] += 1
            return False
        entry.owner, entry.touched = consumer, now
        job.deliveries += 1
        job.status, job.started_at, job.worker = JobStatus.RUNNING, now, consumer
        # this worker's engine is about to cache the prefix: it owns it unless a live worker does
        owner = self._prefix_owner(model, job.prefix, now)
        if job.prefix and owner in (None, consumer):
            until = now + self.settings.affinity_ttl_s
            store.prefix_owner[(model, job.prefix)] = (consumer, until)
        spec = decode(job.spec, JobSpec)
        spec.attempt = job.deliveries - 1
        leases.append(
            Lease(
                spec=spec,
                entry_id=entry.entry_id,
                consumer=consumer,
                resumable=bool(store.events.get(entry.job_id)),
                affinity=affinity,
            )
        )
        return True

    async def renew(self, leases: Sequence[Lease]) -> list[bool]:
        now = self.clock()
        renewed = []
        for lease in leases:
            entry = self._owned(lease)
            if entry is not None:
                entry.touched = now
            renewed.append(entry is not None)
        return renewed

    def _fence(self, lease: Lease) -> _Entry | None:
        entry = self._owned(lease)
        if entry is None:
            self.store.counters[lease.spec.model]["fenced"] += 1
        return entry

    async def complete_many(
        self,
        items: Sequence[tuple[Lease, JobResult]],
        tails: Sequence[TokenChunk | None] | None = None,
    ) -> list[bool]:
        now = self.clock()
        accepted = []
        for index, (lease, result) in enumerate(items):
            if self._fence(lease) is None:
                accepted.append(False)
                continue
            job = self._job(lease.spec.id)
            if job is not None and not job.status.terminal:
                tail = tails[index] if tails is not None else None
                if tail is not None:
                    self._emit(lease.spec.id, encode(tail))
                self._finish(job, lease.spec.id, result, now)
            self._remove_entry(_lane(lease.spec), lease.entry_id)
            self.store.cancels[lease.spec.model].discard(lease.spec.id)
            accepted.append(True)
        self.store.notify()
        self._settle_specs(
            [(lease.spec, r) for (lease, r), ok in zip(items, accepted, strict=True) if ok]
        )
        return accepted

    async def _fail(self, lease: Lease, error: str, reason: str, force_dead: bool) -> int:
        if self._fence(lease) is None:
            return -1
        now = self.clock()
        self._remove_entry(_lane(lease.spec), lease.entry_id)
        job = self._job(lease.spec.id)
        if job is None:
            return 0
        if not force_dead and job.deliveries < self.settings.max_deliveries:
            job.status, job.last_error = JobStatus.QUEUED, error
            delay = backoff_delay(
                lease.spec.attempt,
                self.settings.backoff_base_s,
                self.settings.backoff_max_s,
                self._rng,
            )
            self.store.delayed[job.model][lease.spec.id] = now + delay
            self.store.notify()
            return 1
        self._to_dead_letters(job, lease.spec.id, reason, error, now)
        self.store.counters[job.model]["dead"] += 1
        self.store.notify()
        self._settle_specs([(lease.spec, None)])
        return 0

    async def retry(self, lease: Lease, error: str) -> bool:
        return await self._fail(lease, error, "failed", force_dead=False) == 1

    async def dead_letter(self, lease: Lease, reason: str, error: str | None = None) -> bool:
        return await self._fail(lease, error or reason, reason, force_dead=True) == 0

    async def release(self, leases: Sequence[Lease]) -> int:
        now = self.clock()
        released = 0
        for lease in leases:
            if self._owned(lease) is None:
                continue
            lane = _lane(lease.spec)
            self._remove_entry(lane, lease.entry_id)
            job = self._job(lease.spec.id)
            if job is not None:
                job.status = JobStatus.QUEUED
                job.deliveries -= 1
                self._add_entry(lane, lease.spec.id, now)
            released += 1
        self.store.notify()
        return released

    async def reap(self, model: str) -> ReapReport:
        now = self.clock()
        requeued: list[str] = []
        dead: list[str] = []
        for lane in self._lanes(model):
            for entry in list(self.store.lanes[lane].entries.values()):
                if entry.owner is None or now - entry.touched < self.settings.lease_s:
                    continue
                self._remove_entry(lane, entry.entry_id)
                job = self._job(entry.job_id)
                if job is None or job.status.terminal:
                    continue
                if job.deliveries >= self.settings.max_deliveries:
                    error = f"lease expired on each of {job.deliveries} deliveries"
                    self._to_dead_letters(job, entry.job_id, "lease_expired", error, now)
                    self.store.counters[model]["dead"] += 1
                    dead.append(entry.job_id)
                else:
                    job.status = JobStatus.QUEUED
                    self._add_entry(lane, entry.job_id, now)
                    requeued.append(entry.job_id)
        self.store.notify()
        self._settle_ids(dead)
        return ReapReport(requeued=requeued, dead=dead)

    # -- cancellation ----------------------------------------------------------------------
    async def cancel(self, job_id: str) -> CancelOutcome:
        tag_of_job(job_id)
        job = self._job(job_id)
        if job is None:
            return CancelOutcome.NOT_FOUND
        if job.status is JobStatus.RUNNING:
            job.cancel = True
            self.store.cancels[job.model].add(job_id)
            return CancelOutcome.SIGNALLED
        if job.status.terminal:
            return CancelOutcome.ALREADY_FINISHED
        job.cancel = True
        self.store.delayed[job.model].pop(job_id, None)
        self._finish(job, job_id, cancelled_result(), self.clock())
        self.store.notify()
        self._settle_ids([job_id])
        return CancelOutcome.CANCELLED

    async def cancelled(self, model: str, job_ids: Sequence[str]) -> set[str]:
        return set(job_ids) & self.store.cancels[model]

    async def leave(self, job_id: str, followers: int = 1) -> CancelOutcome:
        job = self._job(job_id)
        if job is not None and not job.status.terminal:
            job.followers -= max(1, followers)
            if job.followers > 0:
                return CancelOutcome.FOLLOWED
        return await self.cancel(job_id)

    # -- response cache --------------------------------------------------------------------
    async def cache_get(self, model: str, digest: str) -> bytes | None:
        found = self.store.cache[model].get(digest)
        if found is None or found[1] <= self.clock():
            return None
        return found[0]

    async def cache_put(
        self, model: str, digest: str, value: bytes, ttl_s: float, max_bytes: int
    ) -> None:
        if len(value) > max_bytes:
            return
        now = self.clock()
        entries = self.store.cache[model]
        for key in [k for k, (_, until) in entries.items() if until <= now or k == digest]:
            self.store.cache_bytes[model] -= len(entries.pop(key)[0])
        entries[digest] = (value, now + ttl_s)
        self.store.cache_bytes[model] += len(value)
        # one TTL for all, so insertion order is expiry order: the soonest to expire go first
        while self.store.cache_bytes[model] > max_bytes:
            oldest = next(iter(entries))
            self.store.cache_bytes[model] -= len(entries.pop(oldest)[0])

    # -- events and records ----------------------------------------------------------------
    async def append_events(self, events: Sequence[tuple[Lease, JobEvent]]) -> list[bool]:
        appended = []
        for lease, event in events:
            ours = self._owned(lease) is not None
            if ours:
                self._emit(lease.spec.id, encode(event))
            appended.append(ours)
        self.store.notify()
        return appended

    async def read_events(
        self, job_id: str, after: str = "0", block_s: float = 0.0, count: int = 1000
    ) -> list[tuple[str, JobEvent]]:
        give_up_at = time.monotonic() + block_s
        floor = _id_key(after or "0")
        while True:
            self._job(job_id)  # drops an expired stream
            found = [
                (eid, decode_event(payload))
                for eid, payload in self.store.events.get(job_id, [])
                if _id_key(eid) > floor
            ][:count]
            wait = give_up_at - time.monotonic()
            if found or wait <= 0:
                return found
            await self.store.wait(wait)

    async def read_events_many(
        self,
        cursors: Mapping[str, str],
        block_s: float = 0.0,
        count: int = 1000,
    ) -> list[tuple[str, str, JobEvent]]:
        give_up_at = time.monotonic() + block_s
        floors = {job_id: _id_key(after or "0") for job_id, after in cursors.items()}
        while True:
            found: list[tuple[str, str, JobEvent]] = []
            for job_id, floor in floors.items():
                self._job(job_id)  # drops an expired stream
                entries = [
                    (eid, payload)
                    for eid, payload in self.store.events.get(job_id, [])
                    if _id_key(eid) > floor
                ][:count]
                found += [(job_id, eid, decode_event(payload)) for eid, payload in entries]
            wait = give_up_at - time.monotonic()
            if found or wait <= 0:
                return found
            await self.store.wait(wait)

    async def record(self, job_id: str) -> JobRecord | None:
        job = self._job(job_id)
        if job is None:
            return None
        spec = decode(job.spec, JobSpec)
        spec.attempt = max(0, job.deliveries - 1)
        return JobRecord(
            spec=spec,
            status=job.status,
            deliveries=job.deliveries,
            enqueued_at=job.enqueued_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            worker=job.worker,
            last_error=job.last_error,
            cancel_requested=job.cancel,
            result=decode(job.result, JobResult) if job.result is not None else None,
        )

    # -- introspection ---------------------------------------------------------------------
    async def stats(self, model: str) -> BrokerStats:
        now = self.clock()
        lanes = []
        for priority in Priority:
            # a priority's size pools are reported together
            states = [self.store.lanes[lane] for lane in self._lanes(model) if lane[1] is priority]
            waiting = [s.entries[e] for s in states for e in s.undelivered if e in s.entries]
            staged = sum(s.fair.count for s in states)  # waiting for their turn (fair share)
            staged += sum(
                len(self.store.affinity_held[lane])
                for lane in self._lanes(model)
                if lane[1] is priority
            )
            in_flight = sum(1 for s in states for e in s.entries.values() if e.owner is not None)
            age = None
            if waiting:
                first = min(_id_key(entry.entry_id)[0] for entry in waiting)
                age = max(0.0, now - first / 1000)
            lanes.append(
                LaneStats(
                    model,
                    priority,
                    waiting=len(waiting) + staged,
                    in_flight=in_flight,
                    oldest_waiting_age_s=age,
                )
            )
        counters = self.store.counters[model]
        return BrokerStats(
            model=model,
            lanes=lanes,
            delayed=len(self.store.delayed[model]),
            dead_letters=len(self.store.dead_letters[model]),
            fenced_completions=counters["fenced"],
            expired=counters["expired"],
        )

    async def depth(self, model: str) -> int:
        lanes = [self.store.lanes[lane] for lane in self._lanes(model)]
        held = sum(len(self.store.affinity_held[lane]) for lane in self._lanes(model))
        return sum(len(lane.entries) + lane.fair.count for lane in lanes) + held

    async def backlog(self, model: str) -> list[LaneBacklog]:
        out = []
        for priority in Priority:
            states = [self.store.lanes[lane] for lane in self._lanes(model) if lane[1] is priority]
            queued = sum(1 for s in states for e in s.undelivered if e in s.entries)
            in_flight = sum(1 for s in states for e in s.entries.values() if e.owner is not None)
            staged: dict[str, TenantBacklog] = {}
            for s in states:
                for tenant, heap in s.fair.staged.items():
                    was = staged.get(tenant)
                    n = len(heap) + (was.staged if was else 0)
                    staged[tenant] = TenantBacklog(tenant, n, s.fair.weight.get(tenant, 1.0))
            tenants = [t for t in staged.values() if t.staged > 0]
            out.append(LaneBacklog(priority, queued, in_flight, tenants))
        return out

    def _lanes(self, model: str) -> list[LaneId]:
        return [(model, p, pool) for p in Priority for pool in range(self.settings.pool_count)]

    async def dead_letters(self, model: str, count: int = 100) -> list[DeadLetter]:
        return self.store.dead_letters[model][:count]

    async def models(self) -> list[str]:
        return sorted(self.store.models)

    async def audit_entries(
        self,
        since: float,
        tenant: str | None = None,
        model: str | None = None,
        cursor: str | None = None,
        count: int = 1000,
    ) -> tuple[str | None, list[AuditEntry]]:
        after = int(cursor) if cursor else 0
        read = [(seq, e) for seq, e in self.store.audit if seq > after][:count]
        found = [e for _, e in read if audit.matches(e, since, tenant, model)]
        return (str(read[-1][0]) if len(read) == count else None), found

    # -- quotas ----------------------------------------------------------------------------
    async def reserve(
        self, tenant: str, quota: Quota, items: Sequence[tuple[str, int]]
    ) -> list[Decision]:
        now = self.clock()
        state, held = self.store.quota[tenant], self.store.held[tenant]
        per_token = limiter.PERIOD_S / quota.tpm if quota.tpm else 0.0
        decisions = []
        for job_id, tokens in items:
            decision = limiter.admit(state, quota, tokens, now)
            if decision.admitted:
                mark = state.budget_start if quota.token_budget else None
                held[job_id] = (tokens, per_token, now, mark)
            decisions.append(decision)
        return decisions

    async def settle(self, items: Sequence[Settlement]) -> int:
        released = 0
        for item in items:
            held = self.store.held[item.tenant].pop(item.job_id, None)
            if held is not None:
                released += 1
                reserved, per_token, _, mark = held
                state = self.store.quota[item.tenant]
                limiter.settle(state, per_token, reserved, item.actual, budget_start=mark)
        return released

    async def settle_finished(self, grace_s: float = 30.0) -> int:
        now = self.clock()
        done: list[Settlement] = []
        for tenant, held in self.store.held.items():
            for job_id, (_, _, reserved_at, _) in held.items():
                job = self._job(job_id)
                if job is None:
                    if now - reserved_at > grace_s:
                        done.append(Settlement(tenant, job_id, 0))
                elif job.status.terminal:
                    result = None if job.result is None else decode(job.result, JobResult)
                    done.append(settlement(decode(job.spec, JobSpec), result))
        return await self.settle(done)

    def _settle_specs(self, specs: Sequence[tuple[JobSpec, JobResult | None]]) -> None:
        for spec, result in specs:
            if spec.quota:
                item = settlement(spec, result)
                held = self.store.held[item.tenant].pop(item.job_id, None)
                if held is not None:
                    limiter.settle(self.store.quota[item.tenant], held[1], held[0], item.actual)

    def _settle_ids(self, job_ids: Sequence[str]) -> None:
        for job_id in job_ids:
            job = self.store.jobs.get(job_id)
            if job is not None:
                result = None if job.result is None else decode(job.result, JobResult)
                self._settle_specs([(decode(job.spec, JobSpec), result)])

    # -- directory -------------------------------------------------------------------------
    async def put_tenant(self, tenant: TenantConfig) -> None:
        self.store.tenants[tenant.name] = tenant

    async def tenant(self, name: str) -> TenantConfig | None:
        return self.store.tenants.get(name)

    async def tenants(self) -> list[TenantConfig]:
        return sorted(self.store.tenants.values(), key=lambda t: t.name)

    async def put_api_key(self, record: ApiKeyRecord) -> None:
        self.store.api_keys[record.digest] = record

    async def api_key(self, digest: str) -> ApiKeyRecord | None:
        return self.store.api_keys.get(digest)

    async def api_keys(self) -> list[ApiKeyRecord]:
        return sorted(self.store.api_keys.values(), key=lambda r: (r.created_at, r.digest))

    async def has_api_keys(self) -> bool:
        return bool(self.store.api_keys)

    # -- workers ---------------------------------------------------------------------------
    async def heartbeat(self, info: WorkerInfo, ttl_s: float) -> None:
        self.store.workers[info.model][info.consumer] = (info, self.clock() + ttl_s)
        self.store.models.add(info.model)

    async def deregister(self, model: str, consumer: str) -> None:
        self.store.workers[model].pop(consumer, None)

    async def workers(self, model: str) -> list[WorkerInfo]:
        now = self.clock()
        return [info for info, until in self.store.workers[model].values() if until > now]


def _lane(spec: JobSpec) -> LaneId:
    return spec.model, spec.priority, spec.pool
