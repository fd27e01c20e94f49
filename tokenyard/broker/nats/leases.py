"""Holding a lease on NATS: renewals, events, completion (events first, then the record), retry,
dead letter, release, and the reap of lapsed leases and workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import nats.js.errors

from tokenyard.broker import audit, machine
from tokenyard.broker.core import Lease, Preempted, ReapReport
from tokenyard.broker.machine import Step
from tokenyard.broker.nats.connection import kv_change, kv_entry, sent
from tokenyard.broker.nats.endings import Endings
from tokenyard.broker.nats.names import Names
from tokenyard.broker.nats.records import Liveness, StoredJob, encode_job
from tokenyard.broker.nats.store import RESEND_S, Fenced, Holding, Part, Store, event_id
from tokenyard.broker.policy import backoff_delay, lapsed
from tokenyard.errors import BrokerUnavailable
from tokenyard.messages import (
    Finished,
    JobEvent,
    JobResult,
    JobSpec,
    JobStatus,
    Priority,
    TokenChunk,
    decode,
    encode,
)


class Leases(Part):
    """The lease holder's side of the queue core, and the reap."""

    def __init__(self, store: Store, endings: Endings) -> None:
        super().__init__(store)
        self.endings = endings  # the endings every part's steps end jobs through

    async def _ours(self, lease: Lease) -> tuple[StoredJob, int] | None:
        """The record, if the lease still holds it (running, this consumer, this delivery).
        A lease this process no longer holds is not: a delivery handed back uncharged (a
        release, a preemption) and taken again by the same consumer has the same count."""
        if lease.entry_id not in self.store.holding:
            return None
        found = await self.store.get(lease.spec.id)
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
            await self.store.ack(lease.entry_id, b"+WPI")
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
            holding = self.store.holding.get(entry)
            if holding is None:
                return
            started[entry] = (holding.appended, holding.last_seq)
            for i in indexes:
                lease, event = events[i]
                # named by its holder and its place among the holder's events, not by the try:
                # sent again, it has the same id and is found stored, not taken for a zombie's
                place = str(holding.appended + 1)
                msg_id = event_id(lease.spec.id, holding.marker, place)
                try:
                    holding.last_seq = await self.store.publish_event(
                        lease.spec.id, encode(event), holding.last_seq, msg_id=msg_id
                    )
                except Fenced:
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
                holding = self.store.holding.get(entry)
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
        outcomes: list[bool | BaseException | None] = [None] * len(items)
        # the completions that end a job by its Finished alone (`_ends_by_events`) written
        # together (one round trip) and awaited in turn, no task each; the others, and any
        # whose first try did not land plainly, go through `_complete` (sent again there)
        chosen: list[tuple[int, Holding]] = []
        firsts: list[tuple[str, bytes, int, str, bool]] = []
        for i, (lease, result) in enumerate(items):
            holding = self.store.holding.get(lease.entry_id)
            if (
                holding is None
                or holding.finishing
                or not _names(holding.job, lease)
                or not _ends_by_events(lease.spec, result)
            ):
                continue
            tail = None if tails is None else tails[i]
            msg_id = event_id(lease.spec.id, holding.marker, "f")
            # the same lease twice in one call: the second goes through `_complete` (fenced)
            holding.finishing = True
            chosen.append((i, holding))
            firsts.append(
                (lease.spec.id, _finished(result, tail), holding.last_seq, msg_id, tail is not None)
            )
        try:
            pendings = await self.store.events_all(firsts)
        except Exception:  # none was written: each goes through `_complete`
            for _, holding in chosen:
                holding.finishing = False
            chosen, pendings = [], []
        for (i, holding), pending in zip(chosen, pendings, strict=True):
            try:
                await self.conn.acked(pending)
            except Exception:
                continue
            finally:
                holding.finishing = False
            # each lane message acknowledged as soon as its Finished landed: acks held back
            # until the call's last answer came cost more than they saved (measured)
            await self._ended_by_events(items[i][0], holding)
            outcomes[i] = True
        rest = [i for i, outcome in enumerate(outcomes) if outcome is None]
        others = await asyncio.gather(
            *(
                self._complete(items[i][0], items[i][1], None if tails is None else tails[i])
                for i in rest
            ),
            return_exceptions=True,  # none still running when the caller sends them again
        )
        for i, outcome in zip(rest, others, strict=True):
            outcomes[i] = outcome
        ended = [(items[i][0].spec, items[i][1]) for i, ok in enumerate(outcomes) if ok is True]
        if ended:
            await self.store.settle(ended)
        failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failed is not None:
            raise failed
        return [ok is True for ok in outcomes]

    async def _write_held(self, lease: Lease, change: Callable[[StoredJob], None]) -> bool:
        """Apply `change` to the held record by compare-and-set; when someone else wrote it
        meanwhile (a cancel request), read it again and retry while the lease is ours. A write
        whose answer was lost (a failover) counts when the record reads as written."""
        holding = self.store.holding.get(lease.entry_id)
        if holding is None or not _names(holding.job, lease):
            return False
        job, revision = holding.job, holding.revision
        give_up, pause = time.monotonic() + RESEND_S, 0.05
        for _ in range(64):
            change(job)
            try:
                written = await self.store.cas(job, revision)
            except BrokerUnavailable:
                if time.monotonic() > give_up:
                    raise
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.5)
                found = await self.store.get(job.spec.id)
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
        when this call ended the job (it settles it).

        A job without quota ends with its Finished alone (one write, one round trip): its
        record is left running, and whoever reads it next copies the Finished in (`mend`), as
        after a worker died in between; its settlement is its audit entry, written here. A job
        with quota (settled exactly once, by whoever turns its record) and one ending cancelled
        (the cancel's mark is cleared once the record shows it) write their record too."""
        holding = self.store.holding.get(lease.entry_id)
        if holding is None or holding.finishing or not _names(holding.job, lease):
            await self.store.count(lease.spec.model, "fenced")
            return False
        job_id = lease.spec.id
        data = _finished(result, tail)
        msg_id = event_id(job_id, holding.marker, "f")
        holding.finishing = True  # the same lease twice in one call: the second is fenced
        try:
            await self.store.publish_event(
                job_id, data, holding.last_seq, msg_id=msg_id, last=tail is not None
            )
        except Fenced:
            self.store.holding.pop(lease.entry_id, None)
            await self.store.count(lease.spec.model, "fenced")
            return False
        finally:
            holding.finishing = False  # a call sent again after an error goes through
        if _ends_by_events(lease.spec, result):
            await self._ended_by_events(lease, holding)
            return True

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
                found = await self.store.get(job_id)
                turned = found is not None and await self.endings.follow(*found, result)
        self.store.holding.pop(lease.entry_id, None)
        await self.store.ack(lease.entry_id)
        if holding.job.cancel:
            await self.store.mark(Names.cancels(lease.spec.model), lease.spec.id, False)
        if not turned:
            await self.store.count(lease.spec.model, "fenced")
        # a job without quota is settled by whoever wrote its Finished (`_ends_by_events`)
        return turned or not lease.spec.quota

    async def _ended_by_events(self, lease: Lease, holding: Holding) -> None:
        """After the Finished that ended the job landed: the lane message acknowledged."""
        await self.store.ack(lease.entry_id)  # before the holding goes: a call sent again
        self.store.holding.pop(lease.entry_id, None)  # acks it again, and settles it once
        if holding.job.cancel:
            await self.store.mark(Names.cancels(lease.spec.model), lease.spec.id, False)

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
            lease.spec.attempt,
            self.settings.backoff_base_s,
            self.settings.backoff_max_s,
            self.store.rng,
        )
        step = machine.fail(
            job.state(),
            lease.consumer,
            error,
            self.clock(),
            self.store.rules,
            delay,
            reason if force_dead else None,
        )
        if not isinstance(step, Step):
            return -1
        if step.ended:
            holding = self.store.holding.get(lease.entry_id)
            expect = None if holding is None else holding.last_seq
            if not await self.endings.ended(job, revision, step, expect):
                return -1
            self.store.holding.pop(lease.entry_id, None)
            await self.store.ack(lease.entry_id)
            return 0 if step.state.status is JobStatus.DEAD else 2
        job.take_on(step.state)
        if await self.store.cas(job, revision) is None:
            return -1
        self.store.holding.pop(lease.entry_id, None)
        await self.store.mark(Names.delayed(job.spec.model), job.spec.id, True)
        nak = json.dumps({"delay": int(delay * 1e9)}).encode()
        await self.store.ack(lease.entry_id, b"-NAK " + nak)
        return 1

    async def release(self, leases: Sequence[Lease]) -> int:
        """Hand jobs back at once, charging no delivery; an affinity job goes to its lane."""
        return sum(1 for done in await self.hand_back(leases, preempt=False) if done)

    async def hand_back(self, leases: Sequence[Lease], preempt: bool) -> list[Preempted]:
        """`release`, or with `preempt` a preemption (machine.preempt: counted, refused past
        the bound). The message is NAKed, not replaced: JetStream redelivers it ahead of newer
        messages, so the job keeps its place in its tenant's subject (an affinity job goes to
        the back of it, as a release's does). A release's handed back job reads PREEMPTED."""

        async def one(lease: Lease) -> Preempted:
            found = await self._ours(lease)
            if found is None:
                return Preempted.KEPT
            job, revision = found
            now = self.clock()
            if preempt:
                step = machine.preempt(job.state(), lease.consumer, now, self.store.rules)
            else:
                step = machine.release(job.state(), lease.consumer, now)
            if not isinstance(step, Step):
                return Preempted.KEPT
            if step.ended:  # a client asked to cancel it: it ends here
                holding = self.store.holding.get(lease.entry_id)
                expect = None if holding is None else holding.last_seq
                if not await self.endings.ended(job, revision, step, expect):
                    return Preempted.KEPT
                self.store.holding.pop(lease.entry_id, None)
                await self.store.ack(lease.entry_id)
                return Preempted.CANCELLED
            job.take_on(step.state)
            if lease.affinity:
                back = await self._requeue(job, revision, lease.entry_id)
                return Preempted.PREEMPTED if back else Preempted.KEPT
            if await self.store.cas(job, revision) is None:
                return Preempted.KEPT
            self.store.holding.pop(lease.entry_id, None)
            await self.store.ack(lease.entry_id, b"-NAK")
            return Preempted.PREEMPTED

        released = list(await asyncio.gather(*(one(lease) for lease in leases)))
        if preempt:
            now = self.clock()
            # a job its client cancelled meanwhile ended: no preemption to audit
            moved = [
                x for x, how in zip(leases, released, strict=True) if how is Preempted.PREEMPTED
            ]
            self.store.audit.append_soon([audit.preempted(x.spec, now) for x in moved])
        for lease in leases:
            spec = lease.spec
            subject = self.names.tenant_subject(spec.model, spec.priority, spec.pool, spec.tenant)
            await self.store.wake(spec.model, [subject])
        return released

    async def _requeue(self, job: StoredJob, revision: int, reply: str | None) -> bool:
        """Put a job again at the back of its tenant's subject of the lane (a new message; the
        old one is acknowledged by `reply`, or deleted)."""
        spec = job.spec
        job.affinity = False
        tenant = self.names.tenant_subject(spec.model, spec.priority, spec.pool, spec.tenant)
        job.subject = Names.job_subject(tenant, spec.id)
        old_seq = job.seq
        # the new message's sequence is not known until it is published: a claim that meets it
        # before the record names it takes it (naming the old one, the record would have it
        # acknowledged as moved, and the job lost)
        job.seq = 0
        new_revision = await self.store.cas(job, revision)
        if new_revision is None:
            return False
        js = await self.conn.js()
        # no revision header: a requeued job's claim reads its record (deliveries and all)
        ack = await sent(js.publish(job.subject, encode(spec)))
        if reply:
            self.store.holding.pop(reply, None)
            await self.store.ack(reply)
        elif old_seq:
            with contextlib.suppress(nats.js.errors.APIError):
                await sent(js.delete_msg(job.lane, old_seq))
        job.seq = int(ack.seq)
        await self.store.cas(job, new_revision)
        await self.store.wake(spec.model, [job.subject])
        return True

    async def beat(self, model: str, consumer: str) -> None:
        until = self.clock() + self.settings.liveness_s

        def beaten(raw: bytes | None) -> tuple[bytes | None, None]:
            live = Liveness() if raw is None else decode(raw, Liveness)
            live.until[consumer] = until
            return encode(live), None

        await kv_change(await self.store.jobs(), Names.live(model), beaten)

    async def reap(self, model: str, expired: bool = True) -> ReapReport:
        """Requeue (to the back of its tenant's subject) each job whose holder's liveness
        lapsed or, with `expired`, whose lease lapsed, and dead-letter those at the delivery
        limit. Only the messages each consumer has out (between its ack floor and its last
        delivery) are looked at, and only when there is something to look for."""
        now = self.clock()
        requeued: list[str] = []
        dead: list[str] = []
        raw, _ = await kv_entry(await self.store.jobs(), Names.live(model))
        gone = set(lapsed(decode(raw, Liveness).until, now)) if raw else set()
        if not (expired or gone):
            return ReapReport(requeued=requeued, dead=dead)
        lanes = [(p, pool) for p in Priority for pool in range(self.settings.pool_count)]
        streams = await asyncio.gather(*(self.store.lane(model, p, pool) for p, pool in lanes))
        for stream, infos in zip(
            streams,
            await asyncio.gather(*(self.store.consumer_infos(s) for s in streams)),
            strict=True,
        ):
            for subject, info in infos.items():
                if not info.num_ack_pending:
                    continue
                floor = info.ack_floor.stream_seq if info.ack_floor else 0
                last = info.delivered.stream_seq if info.delivered else 0
                rows = await self.conn.get_batch(stream, subject, floor, max(1, last - floor))
                specs = [decode(data, JobSpec) for seq, data, _ in rows if seq <= last]
                found = await asyncio.gather(*(self.store.get(spec.id) for spec in specs))
                for spec, hit in zip(specs, found, strict=True):
                    if hit is None:
                        continue
                    job, revision = hit
                    holder_gone = job.worker in gone
                    if not (expired or holder_gone):
                        continue
                    step = machine.lapse(job.state(), now, self.store.rules, not holder_gone)
                    if not isinstance(step, Step):
                        continue
                    if step.ended:  # its last allowed delivery, or a client asked to cancel
                        ended = await self.endings.ended(job, revision, step)
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

        await kv_change(await self.store.jobs(), Names.live(model), forget)


def _finished(result: JobResult, tail: TokenChunk | None) -> bytes:
    """A completion's last message: its Finished, after its tail when it has one."""
    finished = Finished(result=result)
    return encode(finished) if tail is None else encode([tail, finished])


def _ends_by_events(spec: JobSpec, result: JobResult) -> bool:
    """Whether a completion writes its Finished alone (the record follows when next read)."""
    return not spec.quota and result.status is not JobStatus.CANCELLED


def _names(job: StoredJob, lease: Lease) -> bool:
    """Whether the record names the lease's holder and delivery."""
    return job.worker == lease.consumer and job.deliveries == lease.spec.attempt + 1
