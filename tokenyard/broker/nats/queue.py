"""The NATS JetStream queue core.

Lanes are work-queue streams, one per (model, priority, size pool), bounded by `max_msgs` with
`discard: new` (the server refuses a job past the bound, atomically). Inside a lane each tenant
has a subject and a durable pull consumer, so a claim can pick tenants by fair share; jobs held
for a worker (prefix affinity) wait on that worker's subject. `AckWait` is the lease and
`+WPI` renews it. A job's record is a KV entry changed only by compare-and-set, and its events a
subject of the events stream: a holder appends with `Nats-Expected-Last-Subject-Sequence`, and a
new holder first appends a claim marker, so a zombie's late append or result is rejected.

Every ending writes the job's last events (its tail and Finished: one message) before its
record, so the events are the durable side: a terminal record always has its Finished, and a
Finished whose record was not written (its writer died in between) is copied into the record
by whoever meets it (a claim, a broker-side ending, a reader past the holder's lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import (
    ConsumerConfig,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue

from tokenyard.broker import audit, machine
from tokenyard.broker.core import (
    BrokerStats,
    CancelOutcome,
    Clock,
    EnqueueResult,
    LaneBacklog,
    LaneStats,
    Lease,
    QueueCore,
    ReapReport,
    TenantBacklog,
)
from tokenyard.broker.group_commit import GroupCommit
from tokenyard.broker.machine import Bury, Count, Refused, Step
from tokenyard.broker.nats.audit import NatsAudit
from tokenyard.broker.nats.connection import NatsConnection, kv_change, kv_entry, sent
from tokenyard.broker.nats.names import Names, token
from tokenyard.broker.nats.records import Liveness, StoredJob, decode_job, encode_job
from tokenyard.broker.nats.tables import NatsQuotas, NatsRegistry
from tokenyard.broker.policy import (
    active_tag,
    advanced,
    backoff_delay,
    claim_order,
    fair_cost,
    hold_for,
    joinable,
    lapsed,
    next_turn,
    overdue,
    staging_score,
    stamp_by_model,
)
from tokenyard.broker.tables import settlement
from tokenyard.config import BrokerSettings
from tokenyard.errors import BrokerUnavailable, QueueFull
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
    decode,
    decode_event,
    encode,
)

EXPECT_LAST = "Nats-Expected-Last-Subject-Sequence"
MARKER = "Ty-Claim"  # header of the claim marker: an events message no reader is shown
LAST = "Ty-Last"  # header of a job's last message holding two events: its tail and Finished
MSG_ID = "Nats-Msg-Id"
RESEND_S = 20.0  # how long a write whose answer was lost is sent again (a cluster electing)
REVISION = "Ty-Rev"  # header of a lane message: its record's revision when it was enqueued
ENQUEUED_AT = "Ty-At"  # and the record's enqueue time (a first claim writes the record whole)
_WRONG_LAST = 10071  # JetStream: wrong last sequence
_FULL = (10077, 10078)  # JetStream: maximum messages (or bytes) exceeded
POLL_S = 0.2  # a blocked claim looks afresh at least this often (retries, expired leases)
DUPLICATE_WINDOW_S = 120.0  # a lane drops a message whose Nats-Msg-Id it saw this recently
# how long a resend waits for the record of the job its idempotency key names (the other try
# may be between the key and the record) before taking the key over
RECORD_GRACE_S = 2.0
TENANT_REFRESH_S = 0.5  # how old a lane's list of tenant subjects may be when it has work


class _Fenced(Exception):
    """The lease is no longer ours: another holder, or the job ended."""


@dataclass
class _LaneView:
    """What a worker knows of one lane: its subjects with messages, and fair-share clocks."""

    subjects: dict[str, int] = field(default_factory=dict)
    read_at: float = 0.0
    # fair share (policy.py): tenant subject -> start tag; those with jobs waiting; each
    # tenant's weight and last job's cost (to plan a claim of many); the virtual time
    tags: dict[str, float] = field(default_factory=dict)
    active: set[str] = field(default_factory=set)
    weight: dict[str, float] = field(default_factory=dict)
    cost: dict[str, float] = field(default_factory=dict)
    virtual: float = 0.0


@dataclass
class _Holding:
    """This process's knowledge of a lease it holds: the record as it wrote it and its
    revision, and the events subject's last sequence (both are fences)."""

    job: StoredJob
    revision: int
    last_seq: int
    marker: int  # its claim marker's sequence: names its events, unlike a delivery number
    appended: int = 0  # events it stored: the next one's place names its id


class NatsQueue(QueueCore):
    """The queue core on NATS JetStream (nats-server >= 2.11)."""

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
        self.quotas = quotas
        self.audit = audit_trail
        self.registry = registry
        self._rng = rng or random.Random()
        self._rules = machine.Rules(
            lease_s=settings.lease_s, max_deliveries=settings.max_deliveries
        )
        self._rounds: dict[str, int] = defaultdict(int)
        self._idle: dict[str, bool] = {}  # per model: the last claim found nothing
        self._lanes: dict[str, _LaneView] = defaultdict(_LaneView)
        self._consumers: set[tuple[str, str]] = set()
        self._holding: dict[str, _Holding] = {}  # lease entry id -> what fences it
        self._wakes: dict[str, asyncio.Event] = {}
        self._wake_subs: dict[str, Any] = {}
        self._models: set[str] = set()
        self._group = GroupCommit(
            self.enqueue_many,
            max_batch=settings.enqueue_batch,
            window_s=settings.enqueue_window_s,
        )

    async def close(self) -> None:
        await self._group.close()
        await self.audit.flush()
        for sub in self._wake_subs.values():
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._wake_subs.clear()

    # -- streams, consumers, KV -------------------------------------------------------------
    async def _jobs(self) -> KeyValue:
        ttl = max(self.settings.record_ttl_s, self.settings.idempotency_ttl_s)
        return await self.conn.kv(self.names.jobs_bucket, ttl_s=ttl)

    async def _lane(self, model: str, priority: Priority, pool: int) -> str:
        return await self.conn.stream(
            StreamConfig(
                name=self.names.lane_stream(model, priority, pool),
                subjects=[self.names.lane_subjects(model, priority, pool)],
                retention=RetentionPolicy.WORK_QUEUE,
                allow_direct=True,
                max_msgs=self.settings.max_queue_depth,
                discard=DiscardPolicy.NEW,
                storage=StorageType.FILE,
                duplicate_window=DUPLICATE_WINDOW_S,
            )
        )

    async def _events_stream(self) -> str:
        return await self._kept_stream(self.names.events_stream, self.names.events_subjects)

    async def _dead_stream(self) -> str:
        return await self._kept_stream(self.names.dead_stream, self.names.dead_subjects)

    async def _kept_stream(self, name: str, subjects: str) -> str:
        """A stream of what a job left behind (events, dead letters), kept `record_ttl_s`."""
        return await self.conn.stream(
            StreamConfig(
                name=name,
                subjects=[subjects],
                retention=RetentionPolicy.LIMITS,
                max_age=self.settings.record_ttl_s,
                storage=StorageType.FILE,
                allow_direct=True,
            )
        )

    async def _consumer(self, stream: str, subject: str) -> str:
        name = Names.consumer(subject)
        if (stream, name) in self._consumers:
            return name
        js = await self.conn.js()
        await sent(
            js.add_consumer(
                stream,
                ConsumerConfig(
                    durable_name=name,
                    filter_subject=subject,
                    ack_wait=self.settings.lease_s,
                    max_deliver=-1,  # the record counts deliveries (a hand-back is none)
                    max_ack_pending=-1,
                    # a tenant that stopped sending leaves no consumer behind for ever
                    inactive_threshold=max(3600.0, self.settings.lease_s * 4),
                ),
            )
        )
        self._consumers.add((stream, name))
        return name

    async def _pull(self, stream: str, subject: str, batch: int) -> list[Msg]:
        """Up to `batch` messages of a lane subject now, without waiting (one request; 404
        says there are none, 408 the request expired). A consumer the server removed (idle past
        its inactive threshold: 409, or no responder at all) is made again and asked once more."""
        for _ in range(2):
            consumer = await self._consumer(stream, subject)
            request = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
            msgs, end = await self.conn.replies(request, {"batch": batch, "no_wait": True}, batch)
            if msgs or end is None or (end.headers or {}).get("Status") not in ("409", "503"):
                return msgs
            self._consumers.discard((stream, consumer))
        return []

    async def _ack(self, reply: str, verb: bytes = b"+ACK") -> None:
        nc = await self.conn.client()
        await sent(nc.publish(reply, verb))

    async def _wake(self, model: str, subjects: Sequence[str]) -> None:
        """Tell blocked claims which lane subjects just got work (a core publish, no ack)."""
        nc = await self.conn.client()
        for subject in set(subjects):
            await sent(nc.publish(self.names.wake(model), subject.encode()))

    async def _wake_event(self, model: str) -> asyncio.Event:
        """Set on every wake of the model; each wake also marks its subject in the lane view,
        so a claim sees a new tenant without reading the stream's subjects."""
        event = self._wakes.get(model)
        if event is None:
            event = self._wakes[model] = asyncio.Event()
            nc = await self.conn.client()

            async def on_wake(msg: Msg) -> None:
                subject = msg.data.decode()
                try:
                    view = self._lanes[self.names.stream_of_subject(subject)]
                except ValueError:
                    return
                view.subjects[subject] = view.subjects.get(subject, 0) + 1
                event.set()

            self._wake_subs[model] = await sent(nc.subscribe(self.names.wake(model), cb=on_wake))
        return event

    # -- records ----------------------------------------------------------------------------
    async def _get(self, job_id: str) -> tuple[StoredJob, int] | None:
        kv = await self._jobs()
        try:
            entry = await sent(kv.get(Names.job(job_id)))
        except nats.js.errors.KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        return decode_job(entry.value), entry.revision or 0

    async def _cas(self, job: StoredJob, revision: int) -> int | None:
        """Write the record if it is still at `revision`; its new revision, None if not."""
        kv = await self._jobs()
        try:
            return int(
                await sent(kv.update(Names.job(job.spec.id), encode_job(job), last=revision))
            )
        except nats.js.errors.KeyWrongLastSequenceError:
            return None
        except nats.js.errors.APIError as exc:
            if exc.err_code == _WRONG_LAST:
                return None
            raise

    async def _publish_event(
        self,
        job_id: str,
        data: bytes,
        expect: int | None,
        marker: bool = False,
        msg_id: str | None = None,
        last: bool = False,
    ) -> int:
        """Append to a job's events (`last`: `data` is its tail and Finished); raises _Fenced
        when `expect` is no longer the last.

        With a `msg_id`, a publish the server may or may not have stored (a timeout, a
        failover) is sent again for up to RESEND_S, and one refused because `expect` is no
        longer the last counts as stored when the message right after `expect` has its id (an
        earlier try of it: this one's, or a call sent again).
        """
        js = await self.conn.js()
        await self._events_stream()
        headers = {} if expect is None else {EXPECT_LAST: str(expect)}
        if marker:
            headers[MARKER] = "1"
        if last:
            headers[LAST] = "1"
        if msg_id:
            headers[MSG_ID] = msg_id
        give_up, pause = time.monotonic() + RESEND_S, 0.05
        while True:
            try:
                ack = await sent(
                    js.publish(self.names.events(job_id), data, headers=headers or None)
                )
                return int(ack.seq)
            except BrokerUnavailable:
                if msg_id is None or time.monotonic() > give_up:
                    raise
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.5)
            except nats.js.errors.APIError as exc:
                if exc.err_code != _WRONG_LAST:
                    raise
                stored = await self._stored_after(job_id, expect, msg_id)
                if stored is None:
                    raise _Fenced from exc
                return stored

    async def _stored_after(
        self, job_id: str, expect: int | None, msg_id: str | None
    ) -> int | None:
        """The sequence of the job's event right after `expect` if its id is `msg_id`."""
        if expect is None or not msg_id:
            return None
        stream = await self._events_stream()
        rows = await self.conn.get_batch(stream, self.names.events(job_id), expect, 1)
        if rows and rows[0][2].get(MSG_ID) == msg_id:
            return rows[0][0]
        return None

    async def _last_finished(self, job_id: str) -> tuple[int, JobResult | None]:
        """The events subject's last sequence, and the job's result if that is its Finished."""
        last, data, headers = await self._last_event(job_id)
        if data is None or headers.get(MARKER):
            return last, None
        event = _events_of(data, headers)[-1]
        return last, event.result if isinstance(event, Finished) else None

    async def _last_event(self, job_id: str) -> tuple[int, bytes | None, dict[str, str]]:
        """The events subject's last (sequence, data, headers); (0, None, {}) if none."""
        stream = await self._events_stream()
        js = await self.conn.js()
        try:
            msg = await sent(js.get_last_msg(stream, self.names.events(job_id), direct=True))
        except nats.js.errors.NotFoundError:
            return 0, None, {}
        return int(msg.seq or 0), msg.data, dict(msg.headers or {})

    async def _end(
        self,
        job: StoredJob,
        revision: int,
        result: JobResult,
        reason: str | None = None,
        error: str | None = None,
        expect: int | None = None,
    ) -> bool:
        """A terminal write by the broker itself (cancel, expiry, dead letter): its Finished
        event after the events' last (`expect`, a holder's own; else read here), then the
        record, its lane message gone, quota and audit. False when the job moved meanwhile (an
        event came first, or it had ended: its record now follows its Finished)."""
        job_id = job.spec.id
        if expect is None:
            expect, ended = await self._last_finished(job_id)
            if ended is not None:
                await self._mend(job, revision, ended, None)
                return False
        # an id of this ending alone: two enders must never pass for one another
        msg_id = f"{job_id}.e{uuid.uuid4().hex[:16]}"
        finished = encode(Finished(result=result))
        try:
            await self._publish_event(job_id, finished, expect, msg_id=msg_id)
        except _Fenced:
            return False
        turned = await self._follow(job, revision, result)
        await self._drop_message(job)
        if reason is not None:
            await self._dead_letter_entry(job, reason, error)
        if turned:
            await self._settle([(job.spec, result)])
        return True

    async def _ended(
        self, job: StoredJob, revision: int, step: Step, expect: int | None = None
    ) -> bool:
        """Carry out a step of the machine that ends the job (`_end`), with its dead letter
        and counters."""
        job.take_on(step.state)
        assert step.state.result is not None
        letter = next((e for e in step.effects if isinstance(e, Bury)), None)
        reason, error = (None, None) if letter is None else (letter.reason, letter.error)
        if not await self._end(job, revision, step.state.result, reason, error, expect):
            return False
        for effect in step.effects:
            if isinstance(effect, Count) and effect.name != "dead":  # dead: the stream counts
                await self._count(job.spec.model, effect.name)
        if step.state.cancel:
            await self._mark(Names.cancels(job.spec.model), job.spec.id, False)
        return True

    async def _follow(self, job: StoredJob, revision: int, result: JobResult) -> bool:
        """Make the record terminal with `result`, whose Finished is in (so no one appends or
        takes the job any more), whatever it says meanwhile; whether this write did it (the one
        that does settles the job)."""
        for _ in range(64):
            job.status = result.status
            job.result = result
            job.finished_at = self.clock()
            if await self._cas(job, revision) is not None:
                return True
            found = await self._get(job.spec.id)
            if found is None or found[0].terminal:
                return False
            job, revision = found
        return False

    async def _drop_message(self, job: StoredJob) -> None:
        """Delete the job's waiting message from its lane (it ended before a claim)."""
        if not job.lane:
            return
        if not job.seq:
            job.seq = await self._find_message(job)
            if not job.seq:
                return
        js = await self.conn.js()
        with contextlib.suppress(nats.js.errors.APIError):  # acknowledged (taken), or gone
            await sent(js.delete_msg(job.lane, job.seq))

    async def _find_message(self, job: StoredJob, limit: int = 100_000) -> int:
        """The sequence of the job's message on its subject (0: none), by a scan: only cancels
        and expiries of waiting jobs come here."""
        after = 0
        while after < limit:
            rows = await self.conn.get_batch(job.lane, job.subject, after, 1000)
            for seq, data, _ in rows:
                if decode(data, JobSpec).id == job.spec.id:
                    return seq
            if len(rows) < 1000:
                return 0
            after = rows[-1][0]
        return 0

    async def _dead_letter_entry(self, job: StoredJob, reason: str, error: str | None) -> None:
        js = await self.conn.js()
        await self._dead_stream()
        entry = DeadLetter(
            job_id=job.spec.id,
            model=job.spec.model,
            priority=job.spec.priority,
            reason=reason,
            error=error,
            deliveries=job.deliveries,
            at=self.clock(),
        )
        await sent(js.publish(self.names.dead(job.spec.model), encode(entry)))

    async def _settle(self, ended: Sequence[tuple[JobSpec, JobResult]]) -> None:
        """Quota settlement and terminal audit entries of jobs that just ended."""
        held = [settlement(spec, result) for spec, result in ended if spec.quota]
        now = self.clock()
        self.audit.append_soon([audit.terminal(spec, result, now) for spec, result in ended])
        if held:
            await self.quotas.settle(held)

    # -- producing --------------------------------------------------------------------------
    async def enqueue(self, spec: JobSpec) -> EnqueueResult:
        return await self._group.enqueue(spec)

    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[EnqueueResult]:
        """Per model all-or-nothing against the lane bounds: a refused job takes back the
        model's jobs this call added."""
        now = self.clock()
        by_model = stamp_by_model(specs, now, self.settings.pool_bounds)
        results: list[EnqueueResult | None] = [None] * len(specs)
        for model, indexes in by_model.items():
            await self._note_model(model)
            # who each prefixed job is held for, in order: the batch's own holds count
            assigned: dict[str, int] = defaultdict(int)
            owners = [await self._owner_for(specs[i], assigned) for i in indexes]
            # the records go in together; the lane messages in the batch's order (a turn each)
            turns = [asyncio.Event() for _ in indexes]
            outcomes = await asyncio.gather(
                *(
                    self._enqueue_one(specs[i], now, o, turns[k - 1] if k else None, turns[k])
                    for k, (i, o) in enumerate(zip(indexes, owners, strict=True))
                ),
                return_exceptions=True,
            )
            full = next((o for o in outcomes if isinstance(o, QueueFull)), None)
            if full is not None:
                await self._take_back(
                    [(specs[i], o) for i, o in zip(indexes, outcomes, strict=True)]
                )
                raise full
            for i, outcome in zip(indexes, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    raise outcome
                results[i] = outcome[0]
            published = [o[1] for o in outcomes if isinstance(o, tuple) and o[1]]
            if published:
                await self._wake(model, published)
        created = [specs[i] for i, r in enumerate(results) if r is not None and r.created]
        if created:
            self.audit.append_soon([audit.received(spec, now) for spec in created])
        return [r for r in results if r is not None]

    async def _note_model(self, model: str) -> None:
        if model in self._models:
            return
        await self._mark(self.names.models_key, model, True)
        self._models.add(model)

    async def _take_back(
        self, outcomes: Sequence[tuple[JobSpec, tuple[EnqueueResult, str] | BaseException]]
    ) -> None:
        """Undo the jobs of a refused batch that were added (their record and message)."""
        kv = await self._jobs()
        for spec, outcome in outcomes:
            if isinstance(outcome, tuple) and outcome[0].collapsed:
                await self._unjoin(outcome[0].job_id)
            if isinstance(outcome, tuple) and outcome[0].created and not outcome[0].collapsed:
                found = await self._get(spec.id)
                if found is not None:
                    await self._drop_message(found[0])
                try:
                    await sent(kv.purge(Names.job(spec.id)))
                    if spec.idempotency_key:
                        key = Names.idempotency(spec.model, spec.tenant, spec.idempotency_key)
                        await sent(kv.purge(key))
                    if spec.collapse_key:
                        await sent(kv.purge(Names.collapse(spec.model, spec.collapse_key)))
                except nats.js.errors.APIError:
                    pass

    async def _unjoin(self, job_id: str) -> None:
        """One follower fewer, without cancelling (its join was taken back)."""
        for _ in range(16):
            found = await self._get(job_id)
            if found is None:
                return
            job, revision = found
            job.followers = max(1, job.followers - 1)
            if await self._cas(job, revision) is not None:
                return

    async def _claim_key(self, kv: KeyValue, key: str, job_id: str) -> str | None:
        """Create `key` -> `job_id`; the job id it already names when it exists."""
        try:
            await sent(kv.create(key, job_id.encode()))
            return None
        except nats.js.errors.KeyWrongLastSequenceError:
            pass
        try:
            entry = await sent(kv.get(key))
        except nats.js.errors.KeyNotFoundError:
            return None  # gone meanwhile: take it
        return entry.value.decode() if entry.value else None

    async def _enqueue_one(
        self,
        spec: JobSpec,
        now: float,
        owner: str | None,
        after: asyncio.Event | None,
        turn: asyncio.Event,
    ) -> tuple[EnqueueResult, str]:
        """(result, the subject it was published on or ''): the job's record, its keys, then
        its lane message, sent once the job before it in the batch sent its own (`after`)."""
        try:
            return await self._enqueue_in_turn(spec, now, owner, after, turn)
        finally:
            turn.set()

    async def _enqueue_in_turn(
        self,
        spec: JobSpec,
        now: float,
        owner: str | None,
        after: asyncio.Event | None,
        turn: asyncio.Event,
    ) -> tuple[EnqueueResult, str]:
        kv = await self._jobs()
        resend: tuple[StoredJob, int] | None = None
        if spec.idempotency_key:
            key = Names.idempotency(spec.model, spec.tenant, spec.idempotency_key)
            other = await self._claim_key(kv, key, spec.id)
            if other is not None and other != spec.id:
                first = await self._first_try(kv, key, other, spec.id)
                if first == "stands":
                    return EnqueueResult(job_id=other, created=False), ""
                if first != "taken over":
                    resend = first
        if resend is not None:
            # the key's first try may have died between its record and its message
            (job, revision), created = resend, False
            spec, subject = job.spec, job.subject
        elif spec.collapse_key:
            joined = await self._join(kv, spec)
            if joined is not None:
                return EnqueueResult(job_id=joined, created=False, collapsed=True), ""
        if resend is None:
            stream = await self._lane(spec.model, spec.priority, spec.pool)
            if owner is not None:
                subject = self.names.held_subject(spec.model, spec.priority, spec.pool, owner)
            else:
                subject = self.names.tenant_subject(
                    spec.model, spec.priority, spec.pool, spec.tenant
                )
            job = StoredJob(
                spec=spec, status=JobStatus.QUEUED, enqueued_at=now, lane=stream, subject=subject
            )
            created = True
            try:
                revision = int(await sent(kv.create(Names.job(spec.id), encode_job(job))))
            except nats.js.errors.KeyWrongLastSequenceError:
                # A resent enqueue (same job id): its first try may have died between the
                # record and the message (a broker crash).
                found = await self._get(spec.id)
                if found is None or not await self._maybe_unpublished(found[0]):
                    return EnqueueResult(job_id=spec.id, created=False), ""
                job, revision = found
                subject, created = job.subject, False
        # a message published again on the record's subject: Nats-Msg-Id drops it if the first
        # had landed after all
        headers = {MSG_ID: spec.id, REVISION: str(revision), ENQUEUED_AT: repr(now)}
        if after is not None:
            await after.wait()
        try:
            # written to the connection in turn; its answer is awaited after the turn passes
            pending = await self.conn.publish_soon(subject, encode(spec), headers)
            turn.set()
            await self.conn.acked(pending)
        except nats.js.errors.APIError as exc:
            if exc.err_code in _FULL:
                await sent(kv.purge(Names.job(spec.id)))
                lane = f"{spec.model}/{spec.priority.name.lower()}"
                raise QueueFull(
                    lane, self.settings.max_queue_depth, self.settings.max_queue_depth
                ) from exc
            raise
        # the record does not learn the message's sequence (a write more per job): a cancel or
        # expiry of a waiting job finds its message by scanning the subject (`_drop_message`)
        return EnqueueResult(job_id=spec.id, created=created), subject

    async def _first_try(
        self, kv: KeyValue, key: str, other: str, job_id: str
    ) -> tuple[StoredJob, int] | Literal["stands", "taken over"]:
        """What a resend finds under an idempotency key another try claimed: that job stands;
        its record (queued and maybe never published: publish it again); or no record came
        (that try died between the key and the record) and the key now names `job_id`."""
        for _ in range(int(RECORD_GRACE_S / 0.1)):
            found = await self._get(other)
            if found is not None:
                return found if await self._maybe_unpublished(found[0]) else "stands"
            await asyncio.sleep(0.1)  # the other try may be between its key and its record
        try:
            entry = await sent(kv.get(key))
            if entry.value != other.encode():
                return "stands"
            await sent(kv.update(key, job_id.encode(), last=entry.revision))
        except nats.js.errors.Error:
            return "stands"  # changed meanwhile: a later resend looks again
        return "taken over"

    async def _maybe_unpublished(self, job: StoredJob) -> bool:
        """Whether the queued job's lane message may never have been published: never taken,
        and (past the lane's duplicate window, where a resend would not be dropped) not found
        on its subject."""
        if job.status is not JobStatus.QUEUED or job.seq or job.deliveries or job.last_error:
            return False
        if self.clock() - job.enqueued_at < DUPLICATE_WINDOW_S * 0.9:
            return True
        return not await self._find_message(job)

    async def _join(self, kv: KeyValue, spec: JobSpec) -> str | None:
        """The job in flight (or just succeeded: policy `joinable`) this identical request joins
        (one more follower), if any."""
        assert spec.collapse_key
        key = Names.collapse(spec.model, spec.collapse_key)
        for _ in range(8):
            other = await self._claim_key(kv, key, spec.id)
            if other is None or other == spec.id:
                return None
            found = await self._record_of(other)
            grace = self.settings.collapse_grace_s
            while found is not None and joinable(
                found[0].status, found[0].finished_at, self.clock(), grace
            ):
                job, revision = found
                job.followers += 1
                if await self._cas(job, revision) is not None:
                    return other
                # another follower wrote it first (one wins each round): read it again
                found = await self._get(other)
            # its job ended (and is not joined any more): this request takes the key over,
            # unless another one did first
            try:
                entry = await sent(kv.get(key))
                if entry.value != other.encode():
                    continue
                await sent(kv.update(key, spec.id.encode(), last=entry.revision))
                return None
            except nats.js.errors.Error:
                continue
        return None

    async def _record_of(self, job_id: str) -> tuple[StoredJob, int] | None:
        """The record of the job a collapse key names; the job that claimed the key writes its
        record next, so one not there yet is waited for (RECORD_GRACE_S at most: that try died
        between the two, or its lane was full)."""
        give_up, pause = time.monotonic() + RECORD_GRACE_S, 0.005
        while (found := await self._get(job_id)) is None and time.monotonic() < give_up:
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.1)
        return found

    async def _is_live(self, model: str, worker: str) -> bool:
        """Whether the worker's heartbeat holds."""
        return worker in {w.consumer for w in await self.registry.workers(model)}

    async def _owner_for(self, spec: JobSpec, assigned: dict[str, int]) -> str | None:
        """The live worker a job with a known prefix is held for, if any."""
        if not spec.prefix_key:
            return None
        kv = await self._jobs()
        try:
            entry = await sent(kv.get(Names.prefix_owner(spec.model, spec.prefix_key)))
        except nats.js.errors.KeyNotFoundError:
            return None
        owner, _, until = (entry.value or b"").decode().partition(" ")
        if not owner or float(until or 0) <= self.clock():
            return None
        if not await self._is_live(spec.model, owner):
            return None
        stream = await self._lane(spec.model, spec.priority, spec.pool)
        subject = self.names.held_subject(spec.model, spec.priority, spec.pool, owner)
        held = (await self._subjects(stream)).get(subject, 0) + assigned[subject]
        if not hold_for(owner, held, self.settings.affinity_max_held):
            return None
        assigned[subject] += 1
        return owner

    # -- consuming --------------------------------------------------------------------------
    async def _subjects(self, stream: str) -> dict[str, int]:
        """Messages per subject of a lane stream (waiting and in flight)."""
        try:
            answer = await self.conn.api(f"STREAM.INFO.{stream}", {"subjects_filter": ">"})
        except nats.js.errors.NotFoundError:
            return {}
        subjects: dict[str, int] = answer.get("state", {}).get("subjects") or {}
        return subjects

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
        woke = await self._wake_event(model)
        # While claims keep finding work, what this worker knows of the lanes (kept current by
        # wake-ups) is enough. After an idle claim, and after each wait, a claim reads the lanes
        # afresh: wake-ups of two lanes may arrive out of order (strict priority would slip),
        # and some work announces itself with none (a redelivery after a lapsed lease, a
        # retry's backoff ending).
        fresh = self._idle.get(model, True)
        while True:
            woke.clear()
            leases = await self._claim_once(model, consumer, slots, pools, batch_room, fresh)
            left = give_up_at - time.monotonic()
            self._idle[model] = not leases
            if leases or (fresh and left <= 0):
                return leases
            if not fresh:
                fresh = True
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woke.wait(), min(left, POLL_S))

    async def _claim_once(
        self,
        model: str,
        consumer: str,
        slots: int,
        pools: Sequence[int],
        batch_room: int | None,
        fresh: bool = False,
    ) -> list[Lease]:
        order = claim_order(len(Priority), self._rounds[model], self.settings.starvation_every)
        self._rounds[model] += 1
        lanes = [(Priority(p), pool) for p in order for pool in pools]
        streams = await asyncio.gather(*(self._lane(model, p, pool) for p, pool in lanes))
        views = await asyncio.gather(*(self._view(s, fresh) for s in streams))
        leases: list[Lease] = []
        mine = token(consumer)
        for (priority, _), stream, view in zip(lanes, streams, views, strict=True):
            room = slots - len(leases)
            if priority is Priority.BATCH and batch_room is not None:
                taken = sum(1 for lease in leases if lease.priority is Priority.BATCH)
                room = min(room, max(0, batch_room) - taken)
            if room <= 0:
                continue
            if not view.subjects:
                continue
            got = await self._claim_lane(model, stream, view, consumer, mine, room)
            leases += got
            if len(leases) >= slots:
                break
        return leases

    async def _view(self, stream: str, fresh: bool = False) -> _LaneView:
        view = self._lanes[stream]
        now = time.monotonic()
        if fresh or now - view.read_at > TENANT_REFRESH_S:
            view.subjects = {s: n for s, n in (await self._subjects(stream)).items() if n > 0}
            view.read_at = now
        return view

    async def _claim_lane(
        self, model: str, stream: str, view: _LaneView, consumer: str, mine: str, room: int
    ) -> list[Lease]:
        leases: list[Lease] = []
        held = [s for s in view.subjects if Names.subject_kind(s)[0] == "a"]
        own = [s for s in held if Names.subject_kind(s)[1] == mine]
        for subject in own:  # jobs held for this worker first
            msgs = await self._pull(stream, subject, room - len(leases))
            leases += await self._take(msgs, consumer, affinity=True)
        now = self.clock()
        for subject in held:  # then jobs another worker kept waiting too long
            if subject in own or len(leases) >= room:
                continue
            while len(leases) < room:
                msgs = await self._pull(stream, subject, 1)
                if not msgs:
                    break
                spec = decode(msgs[0].data, JobSpec)
                if not overdue(spec.created_at, now, self.settings.affinity_wait_s):
                    await self._ack(msgs[0].reply or "", b"-NAK")
                    break
                leases += await self._take(msgs, consumer, affinity=True)
        tenants = [s for s in view.subjects if Names.subject_kind(s)[0] == "t"]
        for subject in tenants:
            if subject not in view.active:
                view.tags[subject] = active_tag(view.tags.get(subject, 0.0), view.virtual)
                view.active.add(subject)
        while len(leases) < room and view.active:
            plan = _fair_plan(view, room - len(leases))
            pulled = await asyncio.gather(
                *(self._pull_tenant(stream, s, n) for s, n in plan.items())
            )
            taken: dict[str, list[Lease]] = {}
            drained = False
            for (subject, wanted), msgs in zip(plan.items(), pulled, strict=True):
                if len(msgs) < wanted:
                    drained = True
                    view.active.discard(subject)  # drained: it keeps its tag while idle
                    view.subjects.pop(subject, None)
                taken[subject] = await self._take(msgs, consumer, affinity=False)
            # the tags move in turn order, by what each job really costs
            while any(taken.values()):
                subject = next_turn({s: view.tags[s] for s, got in taken.items() if got})
                lease = taken[subject].pop(0)
                view.weight[subject] = lease.spec.weight
                view.cost[subject] = float(fair_cost(lease.spec))
                view.virtual = view.tags[subject]
                view.tags[subject] = advanced(
                    view.tags[subject], fair_cost(lease.spec), lease.spec.weight
                )
                leases.append(lease)
            if not any(pulled) and not drained:
                break
        if not leases:
            view.read_at = 0.0  # look at the lane afresh next time
        return leases

    async def _pull_tenant(self, stream: str, subject: str, n: int) -> list[Msg]:
        msgs = await self._pull(stream, subject, n)
        # within what one pull takes: earliest deadline first, then arrival
        return sorted(msgs, key=lambda m: staging_score(decode(m.data, JobSpec)))

    async def _take(self, msgs: Sequence[Msg], consumer: str, affinity: bool) -> list[Lease]:
        outcomes = await asyncio.gather(*(self._take_one(m, consumer, affinity) for m in msgs))
        return [lease for lease in outcomes if lease is not None]

    async def _take_one(self, msg: Msg, consumer: str, affinity: bool) -> Lease | None:
        """Turn a delivered message into a lease: the record says running under this consumer
        (compare-and-set), and a claim marker fences the events subject."""
        reply = msg.reply or ""
        spec = decode(msg.data, JobSpec)
        fast = await self._take_first(msg, spec, consumer, affinity)
        if fast is not None:
            return fast
        revision = 0
        job: StoredJob | None = None
        for _ in range(6):
            if job is None:
                found = await self._get(spec.id)
                if found is None:
                    await self._ack(reply, b"+TERM")  # its record expired: nothing to run
                    return None
                job, revision = found
            if job.seq and job.seq != msg.metadata.sequence.stream:
                await self._ack(reply)  # moved (requeued) since this message
                return None
            now = self.clock()
            taken = machine.take(job.state(), consumer, now, self._rules)
            if taken is Refused.FINISHED:
                await self._ack(reply)
                return None
            if taken is Refused.NOT_YET:
                # redelivered while its holder's lease (as renewed) still runs: not ours yet
                delay = int((job.lease_until - now) * 1e9)
                await self._ack(reply, b"-NAK " + json.dumps({"delay": delay}).encode())
                return None
            assert isinstance(taken, Step)
            if taken.ended:  # its deadline passed, every delivery was used, or it was cancelled
                if await self._ended(job, revision, taken):
                    await self._ack(reply)
                    return None
                job = None
                continue
            if job.last_error is not None and job.status is JobStatus.QUEUED:
                await self._mark(Names.delayed(spec.model), spec.id, False)
            job.take_on(taken.state)
            job.affinity = affinity
            job.seq = int(msg.metadata.sequence.stream)
            job.lane = msg.metadata.stream
            new_revision = await self._cas(job, revision)
            if new_revision is None:
                job = None
                continue
            break
        else:
            await self._ack(reply, b"-NAK")
            return None
        assert job is not None
        last, resumable, finished = await self._fence_events(job.spec.id, job.deliveries)
        if finished is not None:
            await self._mend(job, new_revision, finished, reply)
            return None
        return await self._leased(reply, job, new_revision, last, resumable)

    async def _take_first(
        self, msg: Msg, spec: JobSpec, consumer: str, affinity: bool
    ) -> Lease | None:
        """The common case in one round trip: a first delivery of a job whose record is as
        enqueued (the message names its revision). The record is written from the message, and
        the claim marker goes beside it (a marker expecting no events lands only on a job no
        one ever held). None: take the general path."""
        headers = msg.headers or {}
        now = self.clock()
        if REVISION not in headers or (spec.deadline is not None and spec.deadline <= now):
            return None
        job = StoredJob(
            spec=spec,
            status=JobStatus.RUNNING,
            deliveries=1,
            enqueued_at=float(headers.get(ENQUEUED_AT, "0")),
            started_at=now,
            worker=consumer,
            lane=msg.metadata.stream,
            subject=msg.subject,
            seq=int(msg.metadata.sequence.stream),
            lease_until=now + self.settings.lease_s,
            affinity=affinity,
        )
        written, marker = await asyncio.gather(
            self._cas(job, int(headers[REVISION])), self._first_marker(spec.id, 1)
        )
        if written is None:
            return None
        if marker is None:
            last, resumable, finished = await self._fence_events(spec.id, 1)
            if finished is not None:
                await self._mend(job, written, finished, msg.reply or "")
                return None
        else:
            last, resumable = marker, False
        return await self._leased(msg.reply or "", job, written, last, resumable)

    async def _first_marker(self, job_id: str, delivery: int) -> int | None:
        try:
            return await self._publish_event(
                job_id, b"", 0, marker=True, msg_id=_event_id(job_id, delivery, "m0")
            )
        except _Fenced:
            return None

    async def _leased(
        self, reply: str, job: StoredJob, revision: int, last: int, resumable: bool
    ) -> Lease:
        self._holding[reply] = _Holding(job, revision, last, marker=last)
        if job.spec.prefix_key:
            await self._own_prefix(job.spec, job.worker or "")
        lease_spec = msgspec.structs.replace(job.spec, attempt=job.deliveries - 1)
        return Lease(
            spec=lease_spec,
            entry_id=reply,
            consumer=job.worker or "",
            resumable=resumable,
            affinity=job.affinity,
        )

    async def _fence_events(self, job_id: str, delivery: int) -> tuple[int, bool, JobResult | None]:
        """Append the claim marker; (its sequence, whether earlier events exist, None). A job
        whose events end with its Finished gets no marker: (0, True, that result)."""
        expect = 0
        for _ in range(8):
            # named by the place it expects: a try whose answer was lost is found there
            msg_id = _event_id(job_id, delivery, f"m{expect}")
            try:
                marker = await self._publish_event(job_id, b"", expect, marker=True, msg_id=msg_id)
                return marker, expect > 0, None
            except _Fenced:
                pass
            expect, ended = await self._last_finished(job_id)
            if ended is not None:
                return 0, True, ended
        raise _Fenced

    async def _mend(
        self, job: StoredJob, revision: int, result: JobResult, reply: str | None
    ) -> None:
        """The record of a job whose Finished is in but whose writer never wrote the record
        (it died, or the broker failed over, in between): terminal now, not run again. `reply`:
        the lane message a claim holds (None: a reader or a broker-side ending met it)."""
        job.status = result.status
        job.result = result
        job.finished_at = self.clock()
        if await self._cas(job, revision) is None:
            if reply:
                await self._ack(reply, b"-NAK")  # changed meanwhile: the redelivery looks again
            return
        if reply:
            await self._ack(reply)
        if job.cancel:
            await self._mark(Names.cancels(job.spec.model), job.spec.id, False)
        await self._settle([(job.spec, result)])

    async def _own_prefix(self, spec: JobSpec, consumer: str) -> None:
        """This worker owns the prefix now, unless another live worker does (sticky)."""
        assert spec.prefix_key
        kv = await self._jobs()
        key = Names.prefix_owner(spec.model, spec.prefix_key)
        try:
            entry = await sent(kv.get(key))
            owner, _, until = (entry.value or b"").decode().partition(" ")
            if (
                owner
                and owner != consumer
                and float(until or 0) > self.clock()
                and await self._is_live(spec.model, owner)
            ):
                return
        except nats.js.errors.KeyNotFoundError:
            pass
        expires = self.clock() + self.settings.affinity_ttl_s
        await sent(kv.put(key, f"{consumer} {expires!r}".encode()))

    async def _count(self, model: str, name: str) -> None:
        def plus_one(raw: bytes | None) -> tuple[bytes, None]:
            return str(int(raw or b"0") + 1).encode(), None

        await kv_change(await self._jobs(), Names.counter(model, name), plus_one)

    async def _counter(self, model: str, name: str) -> int:
        raw, _ = await kv_entry(await self._jobs(), Names.counter(model, name))
        return int(raw or b"0")

    # -- holding a lease --------------------------------------------------------------------
    async def _ours(self, lease: Lease) -> tuple[StoredJob, int] | None:
        """The record, if the lease still holds it (running, this consumer, this delivery)."""
        found = await self._get(lease.spec.id)
        if found is None:
            return None
        job, revision = found
        if job.status is not JobStatus.RUNNING or not _names(job, lease):
            return None
        return job, revision

    async def renew(self, leases: Sequence[Lease]) -> list[bool]:
        def extend(job: StoredJob) -> None:
            job.lease_until = self.clock() + self.settings.lease_s

        async def one(lease: Lease) -> bool:
            if not await self._write_held(lease, extend):
                return False
            await self._ack(lease.entry_id, b"+WPI")
            return True

        return list(await asyncio.gather(*(one(lease) for lease in leases)))

    async def append_events(self, events: Sequence[tuple[Lease, JobEvent]]) -> list[bool]:
        """In order per job; a job's later events are not tried once one was fenced."""
        flags = [False] * len(events)
        by_job: dict[str, list[int]] = defaultdict(list)
        for i, (lease, _) in enumerate(events):
            by_job[lease.entry_id].append(i)

        started: dict[str, tuple[int, int]] = {}

        async def job_events(entry: str, indexes: list[int]) -> None:
            holding = self._holding.get(entry)
            if holding is None:
                return
            started[entry] = (holding.appended, holding.last_seq)
            for i in indexes:
                lease, event = events[i]
                # named by its holder and its place among the holder's events, not by the try:
                # sent again, it has the same id and is found stored, not taken for a zombie's
                place = str(holding.appended + 1)
                msg_id = _event_id(lease.spec.id, holding.marker, place)
                try:
                    holding.last_seq = await self._publish_event(
                        lease.spec.id, encode(event), holding.last_seq, msg_id=msg_id
                    )
                except _Fenced:
                    return
                holding.appended += 1
                flags[i] = True

        outcomes = await asyncio.gather(
            *(job_events(e, ix) for e, ix in by_job.items()), return_exceptions=True
        )
        failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if isinstance(failed, BrokerUnavailable):
            # the caller keeps this call's events and sends them all again: each job starts
            # over where it stood, so they get the same ids and those stored are found, not
            # doubled (after any other error nothing is sent again: what is stored stands)
            for entry, (appended, last_seq) in started.items():
                holding = self._holding.get(entry)
                if holding is not None:
                    holding.appended, holding.last_seq = appended, last_seq
        if failed is not None:
            raise failed
        return flags

    async def complete_many(
        self,
        items: Sequence[tuple[Lease, JobResult]],
        tails: Sequence[TokenChunk | None] | None = None,
    ) -> list[bool]:
        outcomes = await asyncio.gather(
            *(
                self._complete(lease, result, None if tails is None else tails[i])
                for i, (lease, result) in enumerate(items)
            ),
            return_exceptions=True,  # none still running when the caller sends them again
        )
        ended = [(items[i][0].spec, items[i][1]) for i, ok in enumerate(outcomes) if ok is True]
        if ended:
            await self._settle(ended)
        failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failed is not None:
            raise failed
        return [ok is True for ok in outcomes]

    async def _write_held(self, lease: Lease, change: Callable[[StoredJob], None]) -> bool:
        """Apply `change` to the held record by compare-and-set; when someone else wrote it
        meanwhile (a cancel request), read it again and retry while the lease is ours. A write
        whose answer was lost (a failover) counts when the record reads as written."""
        holding = self._holding.get(lease.entry_id)
        if holding is None or not _names(holding.job, lease):
            return False
        job, revision = holding.job, holding.revision
        give_up, pause = time.monotonic() + RESEND_S, 0.05
        for _ in range(64):
            change(job)
            try:
                written = await self._cas(job, revision)
            except BrokerUnavailable:
                if time.monotonic() > give_up:
                    raise
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.5)
                found = await self._get(job.spec.id)
                if found is not None and encode_job(found[0]) == encode_job(job):
                    holding.job, holding.revision = found
                    return True
                continue
            if written is not None:
                holding.job, holding.revision = job, written
                return True
            found = await self._ours(lease)
            if found is None:
                return False
            job, revision = found
        return False

    async def _complete(self, lease: Lease, result: JobResult, tail: TokenChunk | None) -> bool:
        """The tail and the Finished event first, in one message fenced like any append, then
        the record: a worker dying in between leaves a Finished that the next claim, ending or
        reader copies into the record, never a terminal record without its last events. True
        when this write made the record terminal (it settles the job)."""
        holding = self._holding.get(lease.entry_id)
        if holding is None or not _names(holding.job, lease):
            await self._count(lease.spec.model, "fenced")
            return False
        job_id = lease.spec.id
        finished = Finished(result=result)
        data = encode(finished) if tail is None else encode([tail, finished])
        msg_id = _event_id(job_id, holding.marker, "f")
        try:
            await self._publish_event(
                job_id, data, holding.last_seq, msg_id=msg_id, last=tail is not None
            )
        except _Fenced:
            self._holding.pop(lease.entry_id, None)
            await self._count(lease.spec.model, "fenced")
            return False

        def end(job: StoredJob) -> None:
            job.status = result.status
            job.result = result
            job.finished_at = self.clock()

        # the record follows: as held (one write), else whatever it says now (a reap requeued
        # the job meanwhile; no later holder can run it, its claim meets this Finished)
        turned = False
        if not holding.job.terminal:  # else a call sent again: written and settled before
            turned = await self._write_held(lease, end)
            if not turned:
                found = await self._get(job_id)
                turned = found is not None and await self._follow(*found, result)
        self._holding.pop(lease.entry_id, None)
        await self._ack(lease.entry_id)
        if holding.job.cancel:
            await self._mark(Names.cancels(lease.spec.model), lease.spec.id, False)
        if not turned:
            await self._count(lease.spec.model, "fenced")
        return turned

    async def retry(self, lease: Lease, error: str) -> bool:
        return await self._fail(lease, error, "failed", force_dead=False) == 1

    async def dead_letter(self, lease: Lease, reason: str, error: str | None = None) -> bool:
        return await self._fail(lease, error or reason, reason, force_dead=True) == 0

    async def _fail(self, lease: Lease, error: str, reason: str, force_dead: bool) -> int:
        """1: retried after backoff; 0: dead-lettered (at the delivery limit, or forced);
        2: ended cancelled (a client asked while it ran); -1: the lease was lost."""
        found = await self._ours(lease)
        if found is None:
            return -1
        job, revision = found
        delay = backoff_delay(
            lease.spec.attempt, self.settings.backoff_base_s, self.settings.backoff_max_s, self._rng
        )
        step = machine.fail(
            job.state(),
            lease.consumer,
            error,
            self.clock(),
            self._rules,
            delay,
            reason if force_dead else None,
        )
        if not isinstance(step, Step):
            return -1
        if step.ended:
            holding = self._holding.get(lease.entry_id)
            expect = None if holding is None else holding.last_seq
            if not await self._ended(job, revision, step, expect):
                return -1
            self._holding.pop(lease.entry_id, None)
            await self._ack(lease.entry_id)
            return 0 if step.state.status is JobStatus.DEAD else 2
        job.take_on(step.state)
        if await self._cas(job, revision) is None:
            return -1
        self._holding.pop(lease.entry_id, None)
        await self._mark(Names.delayed(job.spec.model), job.spec.id, True)
        nak = json.dumps({"delay": int(delay * 1e9)}).encode()
        await self._ack(lease.entry_id, b"-NAK " + nak)
        return 1

    async def release(self, leases: Sequence[Lease]) -> int:
        """Hand jobs back at once, charging no delivery; an affinity job goes to its lane."""

        async def one(lease: Lease) -> bool:
            found = await self._ours(lease)
            if found is None:
                return False
            job, revision = found
            step = machine.release(job.state(), lease.consumer, self.clock())
            if not isinstance(step, Step):
                return False
            if step.ended:  # a client asked to cancel it: it ends here
                holding = self._holding.get(lease.entry_id)
                expect = None if holding is None else holding.last_seq
                if not await self._ended(job, revision, step, expect):
                    return False
                self._holding.pop(lease.entry_id, None)
                await self._ack(lease.entry_id)
                return True
            job.take_on(step.state)
            if lease.affinity:
                return await self._requeue(job, revision, lease.entry_id)
            if await self._cas(job, revision) is None:
                return False
            self._holding.pop(lease.entry_id, None)
            await self._ack(lease.entry_id, b"-NAK")
            return True

        released = sum(await asyncio.gather(*(one(lease) for lease in leases)))
        for lease in leases:
            spec = lease.spec
            subject = self.names.tenant_subject(spec.model, spec.priority, spec.pool, spec.tenant)
            await self._wake(spec.model, [subject])
        return released

    async def _requeue(self, job: StoredJob, revision: int, reply: str | None) -> bool:
        """Put a job again at the back of its tenant's subject of the lane (a new message; the
        old one is acknowledged by `reply`, or deleted)."""
        spec = job.spec
        job.affinity = False
        job.subject = self.names.tenant_subject(spec.model, spec.priority, spec.pool, spec.tenant)
        old_seq = job.seq
        new_revision = await self._cas(job, revision)
        if new_revision is None:
            return False
        js = await self.conn.js()
        # no revision header: a requeued job's claim reads its record (deliveries and all)
        ack = await sent(js.publish(job.subject, encode(spec)))
        if reply:
            self._holding.pop(reply, None)
            await self._ack(reply)
        elif old_seq:
            with contextlib.suppress(nats.js.errors.APIError):
                await sent(js.delete_msg(job.lane, old_seq))
        job.seq = int(ack.seq)
        await self._cas(job, new_revision)
        await self._wake(spec.model, [job.subject])
        return True

    async def beat(self, model: str, consumer: str) -> None:
        until = self.clock() + self.settings.liveness_s

        def beaten(raw: bytes | None) -> tuple[bytes | None, None]:
            live = Liveness() if raw is None else decode(raw, Liveness)
            live.until[consumer] = until
            return encode(live), None

        await kv_change(await self._jobs(), Names.live(model), beaten)

    async def reap(self, model: str, expired: bool = True) -> ReapReport:
        """Requeue (to the back of its tenant's subject) each job whose holder's liveness
        lapsed or, with `expired`, whose lease lapsed, and dead-letter those at the delivery
        limit. Only the messages each consumer has out (between its ack floor and its last
        delivery) are looked at, and only when there is something to look for."""
        now = self.clock()
        requeued: list[str] = []
        dead: list[str] = []
        raw, _ = await kv_entry(await self._jobs(), Names.live(model))
        gone = set(lapsed(decode(raw, Liveness).until, now)) if raw else set()
        if not (expired or gone):
            return ReapReport(requeued=requeued, dead=dead)
        lanes = [(p, pool) for p in Priority for pool in range(self.settings.pool_count)]
        streams = await asyncio.gather(*(self._lane(model, p, pool) for p, pool in lanes))
        for stream, infos in zip(
            streams, await asyncio.gather(*(self._consumer_infos(s) for s in streams)), strict=True
        ):
            for subject, info in infos.items():
                if not info.num_ack_pending:
                    continue
                floor = info.ack_floor.stream_seq if info.ack_floor else 0
                last = info.delivered.stream_seq if info.delivered else 0
                rows = await self.conn.get_batch(stream, subject, floor, max(1, last - floor))
                specs = [decode(data, JobSpec) for seq, data, _ in rows if seq <= last]
                found = await asyncio.gather(*(self._get(spec.id) for spec in specs))
                for spec, hit in zip(specs, found, strict=True):
                    if hit is None:
                        continue
                    job, revision = hit
                    holder_gone = job.worker in gone
                    if not (expired or holder_gone):
                        continue
                    step = machine.lapse(job.state(), now, self._rules, not holder_gone)
                    if not isinstance(step, Step):
                        continue
                    if step.ended:  # its last allowed delivery, or a client asked to cancel
                        ended = await self._ended(job, revision, step)
                        if ended and step.state.status is JobStatus.DEAD:
                            dead.append(spec.id)
                        continue
                    job.take_on(step.state)
                    # a new message at the back of its tenant's subject (an affinity job's too:
                    # any worker may take it now)
                    if await self._requeue(job, revision, None):
                        requeued.append(spec.id)
        if gone:
            await self._forget_lapsed(model, gone, now)
        return ReapReport(requeued=requeued, dead=dead)

    async def _forget_lapsed(self, model: str, gone: set[str], now: float) -> None:
        """Drop workers whose jobs a reap took over, unless one beat again meanwhile."""

        def forget(raw: bytes | None) -> tuple[bytes | None, None]:
            live = Liveness() if raw is None else decode(raw, Liveness)
            still = [w for w in gone if live.until.get(w, now + 1.0) <= now]
            for worker in still:
                del live.until[worker]
            return (encode(live) if still else None), None

        await kv_change(await self._jobs(), Names.live(model), forget)

    # -- cancellation -----------------------------------------------------------------------
    async def cancel(self, job_id: str) -> CancelOutcome:
        return await self._cancel(job_id, 0)

    async def leave(self, job_id: str, followers: int = 1) -> CancelOutcome:
        return await self._cancel(job_id, max(1, followers))

    async def _cancel(self, job_id: str, leaving: int) -> CancelOutcome:
        for _ in range(16):
            found = await self._get(job_id)
            if found is None:
                return CancelOutcome.NOT_FOUND
            job, revision = found
            step = machine.cancel(job.state(), self.clock(), leaving)
            if not isinstance(step, Step):
                return CancelOutcome.ALREADY_FINISHED
            if step.ended:
                if await self._ended(job, revision, step):
                    await self._mark(Names.delayed(job.spec.model), job_id, False)
                    return CancelOutcome.CANCELLED
                continue
            job.take_on(step.state)
            if await self._cas(job, revision) is None:
                continue
            if not step.effects:
                return CancelOutcome.FOLLOWED
            await self._mark(Names.cancels(job.spec.model), job_id, True)
            return CancelOutcome.SIGNALLED
        return CancelOutcome.NOT_FOUND

    async def cancelled(self, model: str, job_ids: Sequence[str]) -> set[str]:
        if not job_ids:
            return set()
        return await self._marked(Names.cancels(model)) & set(job_ids)

    # -- events and records -----------------------------------------------------------------
    async def read_events(
        self, job_id: str, after: str = "0", block_s: float = 0.0, count: int = 1000
    ) -> list[tuple[str, JobEvent]]:
        found = await self.read_events_many({job_id: after}, block_s, count)
        return [(eid, event) for _, eid, event in found]

    async def read_events_many(
        self,
        cursors: Mapping[str, str],
        block_s: float = 0.0,
        count: int = 1000,
    ) -> list[tuple[str, str, JobEvent]]:
        if not cursors:
            return []
        stream = await self._events_stream()
        if block_s <= 0:
            return await self._read(stream, cursors, count)
        subjects = {self.names.events(j): j for j in cursors}
        nc = await self.conn.client()
        woke = asyncio.Event()

        async def on_event(msg: Msg) -> None:
            # a claim marker is no event for a reader
            if msg.subject in subjects and not (msg.headers and msg.headers.get(MARKER)):
                woke.set()

        # subscribe before reading, so an event appended in between wakes the wait
        subs = [await sent(nc.subscribe(s, cb=on_event)) for s in subjects]
        try:
            give_up = time.monotonic() + block_s
            settle = 0.0
            while True:
                woke.clear()
                found = await self._read(stream, cursors, count)
                left = give_up - time.monotonic()
                if found or left <= 0:
                    return found
                if settle and settle < 0.05:
                    # a core subscriber hears of a message before a direct get can read it back
                    # from the stream: after a wake-up, read again shortly before waiting on
                    await asyncio.sleep(settle)
                    settle *= 2
                    continue
                try:
                    await asyncio.wait_for(woke.wait(), left)
                except TimeoutError:
                    return []
                settle = 0.001
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _read(
        self, stream: str, cursors: Mapping[str, str], count: int
    ) -> list[tuple[str, str, JobEvent]]:
        async def one(job_id: str, after: str) -> list[tuple[str, str, JobEvent]]:
            # claim markers take places in a batch but are no events: read on past them. The
            # cursor's own message is read again: a job's last message holds two events, and
            # the cursor may be its first
            out: list[tuple[str, str, JobEvent]] = []
            floor = _cursor(after)
            seq = max(0, floor[0] - 1)
            while len(out) < count:
                want = count - len(out)
                rows = await self.conn.get_batch(stream, self.names.events(job_id), seq, want)
                for n, data, headers in rows:
                    if headers.get(MARKER):
                        continue
                    for part, event in enumerate(_events_of(data, headers)):
                        if (n, part) > floor:
                            out.append((job_id, f"{n}-{part}" if part else str(n), event))
                if len(rows) < want:
                    break
                seq = rows[-1][0]
            return out[:count]

        parts = await asyncio.gather(*(one(j, a) for j, a in cursors.items()))
        return [row for part in parts for row in part]

    async def record(self, job_id: str) -> JobRecord | None:
        found = await self._get(job_id)
        if found is None:
            return None
        job, revision = found
        if job.status is JobStatus.RUNNING and job.lease_until <= self.clock():
            # its holder may have died between its Finished and the record: follow the events
            _, ended = await self._last_finished(job_id)
            if ended is not None:
                await self._mend(job, revision, ended, None)
                found = await self._get(job_id)
                if found is not None:
                    job = found[0]
        return job.record()

    async def records(self, job_ids: Sequence[str]) -> list[JobRecord | None]:
        return list(await asyncio.gather(*(self.record(j) for j in job_ids)))

    # -- introspection ----------------------------------------------------------------------
    async def _lane_counts(
        self, model: str
    ) -> list[tuple[Priority, int, dict[str, int], dict[str, Any]]]:
        """Per lane: (priority, pool, subject counts, consumers' info by subject)."""
        out = []
        for priority in Priority:
            for pool in range(self.settings.pool_count):
                stream = await self._lane(model, priority, pool)
                subjects = await self._subjects(stream)
                infos = await self._consumer_infos(stream)
                out.append((priority, pool, subjects, infos))
        return out

    async def _consumer_infos(self, stream: str) -> dict[str, Any]:
        js = await self.conn.js()
        try:
            infos = await sent(js.consumers_info(stream))
        except nats.js.errors.NotFoundError:
            return {}
        return {info.config.filter_subject or "": info for info in infos}

    async def stats(self, model: str) -> BrokerStats:
        now = self.clock()
        waiting: dict[Priority, int] = defaultdict(int)
        in_flight: dict[Priority, int] = defaultdict(int)
        oldest: dict[Priority, float] = {}
        for priority, _, subjects, infos in await self._lane_counts(model):
            for subject, n in subjects.items():
                info = infos.get(subject)
                pending = int(info.num_ack_pending) if info is not None else 0
                in_flight[priority] += pending
                waiting[priority] += max(0, n - pending)
        delayed = await self._delayed(model)
        jobs = await self._waiting_ages(model, now)
        for priority, age in jobs.items():
            oldest[priority] = age
        lanes = [
            LaneStats(
                model,
                p,
                waiting=waiting[p],
                in_flight=in_flight[p],
                oldest_waiting_age_s=oldest.get(p) if waiting[p] else None,
            )
            for p in Priority
        ]
        dead = await self._dead_count(model)
        return BrokerStats(
            model=model,
            lanes=lanes,
            delayed=delayed,
            dead_letters=dead,
            fenced_completions=await self._counter(model, "fenced"),
            expired=await self._counter(model, "expired"),
        )

    async def _waiting_ages(self, model: str, now: float) -> dict[Priority, float]:
        """Per priority, the age of its oldest message (the first in each lane stream)."""
        js = await self.conn.js()
        out: dict[Priority, float] = {}
        for priority in Priority:
            for pool in range(self.settings.pool_count):
                stream = self.names.lane_stream(model, priority, pool)
                try:
                    info = await sent(js.stream_info(stream))
                except nats.js.errors.NotFoundError:
                    continue
                if not info.state.messages:
                    continue
                try:
                    msg = await sent(js.get_msg(stream, info.state.first_seq))
                except nats.js.errors.NotFoundError:
                    continue
                spec = decode(msg.data or b"", JobSpec)
                out[priority] = max(out.get(priority, 0.0), max(0.0, now - spec.created_at))
        return out

    async def _marked(self, key: str) -> set[str]:
        """The members of a small set kept in one KV entry (cancels asked, retries waiting)."""
        raw, _ = await kv_entry(await self._jobs(), key)
        return set(decode(raw, list[str])) if raw else set()

    async def _mark(self, key: str, member: str, on: bool) -> None:
        """Add or remove a member, by compare-and-set."""

        def marked(raw: bytes | None) -> tuple[bytes | None, None]:
            members = set(decode(raw, list[str])) if raw else set()
            if (member in members) == on:
                return None, None
            return encode(sorted(members | {member} if on else members - {member})), None

        await kv_change(await self._jobs(), key, marked)

    async def _delayed(self, model: str) -> int:
        return len(await self._marked(Names.delayed(model)))

    async def _dead_count(self, model: str) -> int:
        stream = await self._dead_stream()
        subjects = await self._subjects(stream)
        return int(subjects.get(self.names.dead(model), 0))

    async def depth(self, model: str) -> int:
        lanes = [(p, pool) for p in Priority for pool in range(self.settings.pool_count)]
        streams = await asyncio.gather(*(self._lane(model, p, pool) for p, pool in lanes))
        counts = await asyncio.gather(*(self._subjects(s) for s in streams))
        return sum(sum(c.values()) for c in counts)

    async def backlog(self, model: str) -> list[LaneBacklog]:
        out = []
        per: dict[Priority, tuple[int, int, dict[str, TenantBacklog]]] = {}
        for priority, _, subjects, infos in await self._lane_counts(model):
            queued, flying, tenants = per.get(priority, (0, 0, {}))
            for subject, n in subjects.items():
                info = infos.get(subject)
                pending = int(info.num_ack_pending) if info is not None else 0
                flying += pending
                waiting = max(0, n - pending)
                kind, _ = Names.subject_kind(subject)
                if kind != "t":
                    queued += waiting  # held for a worker; a tenant's are staged by tenant
                elif waiting > 0:
                    tenant, weight = await self._tenant_of(subject)
                    was = tenants.get(tenant)
                    tenants[tenant] = TenantBacklog(
                        tenant, waiting + (was.staged if was else 0), weight
                    )
            per[priority] = (queued, flying, tenants)
        for priority in Priority:
            queued, flying, tenants = per.get(priority, (0, 0, {}))
            out.append(LaneBacklog(priority, queued, flying, list(tenants.values())))
        return out

    async def _tenant_of(self, subject: str) -> tuple[str, float]:
        """A tenant subject's tenant name and weight, from its first message."""
        stream = self.names.stream_of_subject(subject)
        rows = await self.conn.get_batch(stream, subject, 0, 1)
        if not rows:
            return Names.subject_kind(subject)[1], 1.0
        spec = decode(rows[0][1], JobSpec)
        return spec.tenant, spec.weight

    async def dead_letters(self, model: str, count: int = 100) -> list[DeadLetter]:
        stream = await self._dead_stream()
        rows = await self.conn.get_batch(stream, self.names.dead(model), 0, count)
        return [decode(data, DeadLetter) for _, data, _ in rows]

    async def models(self) -> list[str]:
        return sorted(await self._marked(self.names.models_key))


def _event_id(job_id: str, writer: int, n: str) -> str:
    """An event's message id: its job, who wrote it (a holder's events: its claim marker's
    sequence; a claim marker: its delivery) and its place (`n`: 1, 2...; `f` the last message;
    `m<sequence>` a marker expecting that sequence before it)."""
    return f"{job_id}.{writer}.{n}"


def _names(job: StoredJob, lease: Lease) -> bool:
    """Whether the record names the lease's holder and delivery."""
    return job.worker == lease.consumer and job.deliveries == lease.spec.attempt + 1


def _cursor(after: str) -> tuple[int, int]:
    """An event id as (stream sequence, place in its message): 'S' the message's first event,
    'S-1' its second (a job's Finished after its tail); '0' or '' reads from the start."""
    seq, _, part = after.partition("-")
    try:
        return max(0, int(seq or 0)), max(0, int(part or 0))
    except ValueError:
        return 0, 0


def _events_of(data: bytes, headers: Mapping[str, str]) -> list[JobEvent]:
    """The events one message of a job's subject holds: one, or its tail and Finished."""
    if headers.get(LAST):
        return decode(data, list[JobEvent])
    return [decode_event(data)]


def _fair_plan(view: _LaneView, room: int) -> dict[str, int]:
    """How many jobs to pull from each active tenant, turn by turn as policy.py orders them,
    guessing each job's cost from the tenant's last one."""
    tags = {s: view.tags[s] for s in view.active}
    plan: dict[str, int] = defaultdict(int)
    for _ in range(room):
        subject = next_turn(tags)
        plan[subject] += 1
        tags[subject] = advanced(
            tags[subject], view.cost.get(subject, 1.0), view.weight.get(subject, 1.0)
        )
    return dict(plan)
