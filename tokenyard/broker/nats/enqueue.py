"""Enqueue on NATS: a job no key names is its lane message alone (one round trip; its first
claim writes its record, waiting.py reads it meanwhile); a keyed job's idempotency or collapse
key, its record and its lane message, where a resend under the same key finishes a job whose
producer died between them.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Awaitable, Sequence
from typing import Literal, TypeVar

import nats.js.errors
from nats.js.kv import KeyValue

from tokenyard.broker import audit
from tokenyard.broker.core import EnqueueResult, admitted
from tokenyard.broker.nats.connection import Duplicate, sent
from tokenyard.broker.nats.names import Names
from tokenyard.broker.nats.records import StoredJob, encode_job
from tokenyard.broker.nats.store import DUPLICATE_WINDOW_S, MSG_ID, REVISION, Part, Store
from tokenyard.broker.nats.waiting import ENQUEUED_AT
from tokenyard.broker.policy import hold_for, joinable, stamp_by_model
from tokenyard.errors import QueueFull
from tokenyard.messages import JobSpec, JobStatus, encode

_FULL = (10077, 10078)  # JetStream: maximum messages (or bytes) exceeded
# how long a resend waits for the record of the job its idempotency key names (the other try
# may be between the key and the record) before taking the key over
RECORD_GRACE_S = 2.0

T = TypeVar("T")


class Enqueuer(Part):
    """The producing side of the queue core."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self._models: set[str] = set()  # models this process noted in the models set

    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[EnqueueResult]:
        """Per model all-or-nothing against the lane bounds (core.QueueCore): a refused job
        takes back the model's jobs this call added; the other models' stand."""
        now = self.clock()
        by_model = stamp_by_model(specs, now, self.settings.pool_bounds)
        results: list[EnqueueResult | None] = [None] * len(specs)
        full: QueueFull | None = None
        for model, indexes in by_model.items():
            await self._note_model(model)
            # who each prefixed job is held for, in order: the batch's own holds count
            assigned: dict[str, int] = defaultdict(int)
            owners = [await self._owner_for(specs[i], assigned) for i in indexes]
            # the records go in together; the lane messages in the batch's order (a turn each)
            outcomes: list[tuple[EnqueueResult, str] | BaseException]
            if all(
                o is None and not specs[i].idempotency_key and not specs[i].collapse_key
                for i, o in zip(indexes, owners, strict=True)
            ):  # the common call: no task to run each job, no turn to wait for
                plain = [specs[i] for i in indexes]
                outcomes = await self._enqueue_plain_many(plain, now)
            elif len(indexes) == 1:
                try:
                    outcomes = [
                        await self._enqueue_one(
                            specs[indexes[0]], now, owners[0], None, asyncio.Event()
                        )
                    ]
                except QueueFull as exc:
                    outcomes = [exc]
            else:
                turns = [asyncio.Event() for _ in indexes]
                outcomes = await asyncio.gather(
                    *(
                        _passing(
                            turns[k],
                            self._enqueue_one(
                                specs[i], now, o, turns[k - 1] if k else None, turns[k]
                            ),
                        )
                        for k, (i, o) in enumerate(zip(indexes, owners, strict=True))
                    ),
                    return_exceptions=True,
                )
            refused = next((o for o in outcomes if isinstance(o, QueueFull)), None)
            if refused is not None:
                await self._take_back(
                    [(specs[i], o) for i, o in zip(indexes, outcomes, strict=True)]
                )
                full = full or refused
                continue
            for i, outcome in zip(indexes, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    raise outcome
                results[i] = outcome[0]
            published = [o[1] for o in outcomes if isinstance(o, tuple) and o[1]]
            if published:
                self.store.wake_soon(model, published)
        created = [specs[i] for i, r in enumerate(results) if r is not None and r.created]
        if created:
            self.store.audit.append_soon([audit.received(spec, now) for spec in created])
        return admitted(results, full)

    async def _note_model(self, model: str) -> None:
        if model in self._models:
            return
        await self.store.mark(self.names.models_key, model, True)
        self._models.add(model)

    async def _take_back(
        self, outcomes: Sequence[tuple[JobSpec, tuple[EnqueueResult, str] | BaseException]]
    ) -> None:
        """Undo the jobs of a refused batch that were added (their record and message)."""
        kv = await self.store.jobs()
        for spec, outcome in outcomes:
            if isinstance(outcome, tuple) and outcome[0].collapsed:
                await self._unjoin(outcome[0].job_id)
            if isinstance(outcome, tuple) and outcome[0].created and not outcome[0].collapsed:
                found = await self.store.get(spec.id)
                if found is not None:
                    await self.store.drop_message(found[0])
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
            found = await self.store.get(job_id)
            if found is None:
                return
            job, revision = found
            job.followers = max(1, job.followers - 1)
            if await self.store.cas(job, revision) is not None:
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
        its lane message, sent once the job before it in the batch sent its own (`after`); its
        `turn` passes when it sends its own (the caller passes it however this ends)."""
        kv = await self.store.jobs()
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
            job = await self._new_job(spec, now, owner)
            subject, created = job.subject, True
            if not spec.idempotency_key and not spec.collapse_key:
                return await self._enqueue_plain(job, now, after, turn)
            try:
                revision = int(await sent(kv.create(Names.job(spec.id), encode_job(job))))
            except nats.js.errors.KeyWrongLastSequenceError:
                # A resent enqueue (same job id): its first try may have died between the
                # record and the message (a broker crash).
                found = await self.store.get(spec.id)
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
                raise self._full(spec) from exc
            raise
        # the record does not learn the message's sequence (a write more per job): a cancel or
        # expiry of a waiting job finds its message by scanning the subject (`_drop_message`)
        return EnqueueResult(job_id=spec.id, created=created), subject

    async def _new_job(self, spec: JobSpec, now: float, owner: str | None) -> StoredJob:
        """The record of a job enqueued now, on its tenant's subject or held for `owner`."""
        stream = await self.store.lane(spec.model, spec.priority, spec.pool)
        if owner is not None:
            subject = self.names.held_subject(spec.model, spec.priority, spec.pool, owner)
        else:
            subject = self.names.tenant_subject(spec.model, spec.priority, spec.pool, spec.tenant)
        # its consumer made before its first job (once a process): claims busy with other
        # tenants see the new one in their consumers' counts, not only by a wake-up
        await self.store.consumer(stream, subject)
        subject = Names.job_subject(subject, spec.id)
        return StoredJob(
            spec=spec, status=JobStatus.QUEUED, enqueued_at=now, lane=stream, subject=subject
        )

    async def _enqueue_plain_many(
        self, specs: Sequence[JobSpec], now: float
    ) -> list[tuple[EnqueueResult, str] | BaseException]:
        """`_enqueue_plain` of jobs no key names and none is held for: their lane messages
        written together in order, their answers awaited in turn (one round trip, no task and
        no turn to wait for per job); each outcome as `gather` with `return_exceptions`."""
        jobs = [await self._new_job(spec, now, None) for spec in specs]
        at = repr(now)
        # one buffer write: all of them go, or (refused) none does
        messages = await self.conn.publish_all(
            [
                (job.subject, encode(job.spec), {MSG_ID: job.spec.id, ENQUEUED_AT: at})
                for job in jobs
            ]
        )
        outcomes: list[tuple[EnqueueResult, str] | BaseException] = []
        for job, message in zip(jobs, messages, strict=True):
            published = await _outcome(self.conn.acked(message))
            outcomes.append(await _outcome(self._plain_result(job, published)))
        return outcomes

    async def _enqueue_plain(
        self, job: StoredJob, now: float, after: asyncio.Event | None, turn: asyncio.Event
    ) -> tuple[EnqueueResult, str]:
        """A job no key names, in one round trip: its lane message alone, which is its record
        until its first claim writes one (expecting none)."""
        headers = {MSG_ID: job.spec.id, ENQUEUED_AT: repr(now)}
        if after is not None:
            await after.wait()
        pending = await self.conn.publish_soon(job.subject, encode(job.spec), headers)
        turn.set()
        published = await _outcome(self.conn.acked(pending))
        return await self._plain_result(job, published)

    async def _plain_result(
        self, job: StoredJob, published: int | BaseException
    ) -> tuple[EnqueueResult, str]:
        """What the answer to a plain enqueue's message makes of it (raises QueueFull when the
        lane was full)."""
        if isinstance(published, nats.js.errors.APIError) and published.err_code in _FULL:
            raise self._full(job.spec) from published
        if isinstance(published, BaseException):
            raise published
        # a resent enqueue of the job id: Nats-Msg-Id dropped the copy within the lane's
        # duplicate window (past it, the claim that meets the second copy finds the record the
        # first one's claim wrote, and acknowledges it as moved or ended)
        created = not isinstance(published, Duplicate)
        return EnqueueResult(job_id=job.spec.id, created=created), job.subject

    def _full(self, spec: JobSpec) -> QueueFull:
        lane = f"{spec.model}/{spec.priority.name.lower()}"
        return QueueFull(lane, self.settings.max_queue_depth, self.settings.max_queue_depth)

    async def _first_try(
        self, kv: KeyValue, key: str, other: str, job_id: str
    ) -> tuple[StoredJob, int] | Literal["stands", "taken over"]:
        """What a resend finds under an idempotency key another try claimed: that job stands;
        its record (queued and maybe never published: publish it again); or no record came
        (that try died between the key and the record) and the key now names `job_id`."""
        for _ in range(int(RECORD_GRACE_S / 0.1)):
            found = await self.store.get(other)
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
        return not await self.store.find_message(job)

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
                if await self.store.cas(job, revision) is not None:
                    return other
                # another follower wrote it first (one wins each round): read it again
                found = await self.store.get(other)
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
        while (found := await self.store.get(job_id)) is None and time.monotonic() < give_up:
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.1)
        return found

    async def _owner_for(self, spec: JobSpec, assigned: dict[str, int]) -> str | None:
        """The live worker a job with a known prefix is held for, if any."""
        if not spec.prefix_key:
            return None
        kv = await self.store.jobs()
        try:
            entry = await sent(kv.get(Names.prefix_owner(spec.model, spec.prefix_key)))
        except nats.js.errors.KeyNotFoundError:
            return None
        owner, _, until = (entry.value or b"").decode().partition(" ")
        if not owner or float(until or 0) <= self.clock():
            return None
        if not await self.store.is_live(spec.model, owner):
            return None
        stream = await self.store.lane(spec.model, spec.priority, spec.pool)
        subject = self.names.held_subject(spec.model, spec.priority, spec.pool, owner)
        # the jobs held for it now: its subject's alone (a job's own subject each)
        held = (await self.store.subjects(stream, f"{subject}.*")).get(subject, 0)
        held += assigned[subject]
        if not hold_for(owner, held, self.settings.affinity_max_held):
            return None
        assigned[subject] += 1
        return owner


async def _passing(turn: asyncio.Event, step: Awaitable[T]) -> T:
    """`step`'s outcome; `turn` passes however it ends (the batch's next job waits for it)."""
    try:
        return await step
    finally:
        turn.set()


async def _outcome(answer: Awaitable[T]) -> T | BaseException:
    """An answer's result, or what it raised (as `gather(return_exceptions=True)` gives)."""
    try:
        return await answer
    except Exception as exc:
        return exc
