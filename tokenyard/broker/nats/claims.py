"""Claims on NATS: pulls from each tenant's consumer in a lane by fair share, and the take of a
delivered message (its record by compare-and-set, a claim marker fencing its events).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec
import nats.js.errors
from nats.aio.msg import Msg

from tokenyard.broker import machine
from tokenyard.broker.core import Claim, Lease
from tokenyard.broker.machine import Refused, Step
from tokenyard.broker.nats.client import delivered
from tokenyard.broker.nats.connection import sent
from tokenyard.broker.nats.endings import Endings
from tokenyard.broker.nats.names import Names, token
from tokenyard.broker.nats.records import StoredJob
from tokenyard.broker.nats.store import REVISION, Fenced, Holding, Part, Store, event_id
from tokenyard.broker.nats.waiting import ENQUEUED_AT
from tokenyard.broker.policy import (
    active_tag,
    advanced,
    claim_order,
    fair_cost,
    next_turn,
    overdue,
    staging_score,
)
from tokenyard.messages import JobResult, JobSpec, JobStatus, Priority, decode

POLL_S = 0.2  # a blocked claim looks afresh at least this often (retries, expired leases)
TENANT_REFRESH_S = 0.5  # how old a lane's list of tenant subjects may be when it has work


class _Delivery(NamedTuple):
    """A lane message a claim took, its job, and who takes it (and whether from its held
    subject)."""

    msg: Msg
    spec: JobSpec
    consumer: str
    affinity: bool


@dataclass
class LaneView:
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


class Claims(Part):
    """The claiming side of the queue core: what this worker knows of the lanes, and the takes."""

    def __init__(self, store: Store, endings: Endings) -> None:
        super().__init__(store)
        self.endings = endings  # the endings every part's steps end jobs through
        self._rounds: dict[str, int] = defaultdict(int)
        self._idle: dict[str, bool] = {}  # per model: the last claim found nothing
        self._lanes: dict[str, LaneView] = defaultdict(LaneView)
        self._wakes: dict[str, asyncio.Event] = {}
        self._wake_subs: dict[str, Any] = {}

    async def close(self) -> None:
        for sub in self._wake_subs.values():
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._wake_subs.clear()

    async def _pull(self, stream: str, subject: str, batch: int) -> list[Msg]:
        """Up to `batch` messages of a lane subject now, without waiting (one request; 404
        says there are none, 408 the request expired). A consumer the server removed (idle past
        its inactive threshold: 409, or no responder at all) is made again and asked once more."""
        for _ in range(2):
            consumer = await self.store.consumer(stream, subject)
            msgs, end = await self.conn.pull(stream, consumer, batch)
            if msgs or end is None or (end.headers or {}).get("Status") not in ("409", "503"):
                return msgs
            self.store.consumers.discard((stream, consumer))
        return []

    async def _wake_event(self, model: str) -> asyncio.Event:
        """Set on every wake of the model; each wake also marks its subject in the lane view,
        so a claim sees a new tenant without reading the stream's subjects."""
        event = self._wakes.get(model)
        if event is None:
            event = self._wakes[model] = asyncio.Event()
            nc = await self.conn.client()

            def on_wake(_: bytes, __: bytes, data: bytes, ___: dict[str, str] | None) -> None:
                # the lane subjects one enqueue filled, together: a claim woken by it sees
                # them all (strict priority holds over one call's jobs)
                for subject in data.decode().split():
                    try:
                        view = self._lanes[self.names.stream_of_subject(subject)]
                    except ValueError:
                        continue
                    view.subjects[subject] = view.subjects.get(subject, 0) + 1
                event.set()

            sub = await sent(nc.subscribe(self.names.wake(model)))
            nc.on_raw(sub._id, on_wake)  # from the read loop (one a job when enqueues are apart)
            self._wake_subs[model] = sub
        return event

    async def claim(self, ask: Claim) -> list[Lease]:
        """`Leases.claim` of at least one slot."""
        model, consumer, slots, block_s, pools, batch_room = ask
        give_up_at = time.monotonic() + block_s
        woke = await self._wake_event(model)
        # While claims find work, and after a wake-up, what this worker knows of the lanes
        # (kept current by wake-ups) is enough. A claim about to give up reads the lanes
        # afresh, and so does one whose wait ran POLL_S without a wake-up: some work announces
        # itself with none (a redelivery after a lapsed lease, a retry's backoff ending).
        fresh = self._idle.get(model, True)
        while True:
            woke.clear()
            leases = await self._claim_once(model, consumer, slots, pools, batch_room, fresh)
            left = give_up_at - time.monotonic()
            self._idle[model] = not leases
            if leases or (fresh and left <= 0):
                return leases
            if left <= 0 or woke.is_set():
                fresh = left <= 0
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woke.wait(), min(left, POLL_S))
            fresh = not woke.is_set()

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
        # known lanes and views read lately cost no task each (a claim of one job is common)
        streams = [await self.store.lane(model, p, pool) for p, pool in lanes]
        now = time.monotonic()
        if fresh or any(now - self._lanes[s].read_at > TENANT_REFRESH_S for s in streams):
            views = await asyncio.gather(*(self._view(s, fresh) for s in streams))
        else:
            views = [self._lanes[s] for s in streams]
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

    async def _view(self, stream: str, fresh: bool = False) -> LaneView:
        view = self._lanes[stream]
        now = time.monotonic()
        if fresh:
            # every subject with messages: each job has its own, so this listing is as long as
            # the lane; only a claim that found nothing (or heard nothing) pays for it
            view.subjects = {s: n for s, n in (await self.store.subjects(stream)).items() if n > 0}
            view.read_at = now
        elif now - view.read_at > TENANT_REFRESH_S:
            # while claims find work: what each tenant's consumer has waiting, one answer per
            # tenant; a subject whose consumer is not made yet (a wake-up named it) is kept
            waiting = await self.store.waiting(stream)
            kept = {s: n for s, n in view.subjects.items() if s not in waiting}
            view.subjects = kept | {s: n for s, n in waiting.items() if n > 0}
            view.read_at = now
        return view

    async def _claim_lane(
        self, model: str, stream: str, view: LaneView, consumer: str, mine: str, room: int
    ) -> list[Lease]:
        leases: list[Lease] = []
        held = [s for s in view.subjects if Names.subject_kind(s)[0] == "a"]
        own = [s for s in held if Names.subject_kind(s)[1] == mine]
        for subject in own:  # jobs held for this worker first
            msgs = await self._pull(stream, subject, room - len(leases))
            leases += await self._take(_decoded(msgs), consumer, affinity=True)
        now = self.clock()
        for subject in held:  # then jobs another worker kept waiting too long
            if subject in own or len(leases) >= room:
                continue
            while len(leases) < room:
                msgs = await self._pull(stream, subject, 1)
                if not msgs:
                    break
                [(msg, spec)] = _decoded(msgs)
                if not overdue(spec.created_at, now, self.settings.affinity_wait_s):
                    await self.store.ack(msg.reply or "", b"-NAK")
                    break
                leases += await self._take([(msg, spec)], consumer, affinity=True)
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
            for (subject, wanted), got in zip(plan.items(), pulled, strict=True):
                if len(got) < wanted:
                    drained = True
                    view.active.discard(subject)  # drained: it keeps its tag while idle
                    view.subjects.pop(subject, None)
                taken[subject] = await self._take(got, consumer, affinity=False)
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

    async def _pull_tenant(self, stream: str, subject: str, n: int) -> list[tuple[Msg, JobSpec]]:
        pulled = _decoded(await self._pull(stream, subject, n))
        # within what one pull takes: earliest deadline first, then arrival
        return sorted(pulled, key=lambda pair: staging_score(pair[1]))

    async def _take(
        self, pulled: Sequence[tuple[Msg, JobSpec]], consumer: str, affinity: bool
    ) -> list[Lease]:
        """Leases of pulled messages (each with its job, decoded once)."""
        deliveries = [_Delivery(m, s, consumer, affinity) for m, s in pulled]
        # first deliveries: their records written together (one round trip) and awaited in
        # turn, no task each; the others (and those whose write lost: a record was there, of a
        # retry, a cancel, a keyed job taken meanwhile) one by one
        firsts = [self._first(d) for d in deliveries]
        sent_writes = iter(await self.store.cas_all([f for f in firsts if f is not None]))
        writes = [None if first is None else next(sent_writes) for first in firsts]
        leases: list[Lease | None] = [None] * len(deliveries)
        rest: list[int] = []
        for i, (first, write) in enumerate(zip(firsts, writes, strict=True)):
            written = None if write is None else await self.conn.acked(write)
            if first is None or written is None:
                rest.append(i)
                continue
            # no claim marker: the first holder's appends expect no events before them, so an
            # ending's Finished that came first (a cancel or expiry cut off before its record)
            # fences them as a marker would; its record follows that Finished when next read
            leases[i] = await self._leased(
                deliveries[i].msg.reply or "", first[0], written, 0, False
            )
        if rest:
            taken = await asyncio.gather(*(self._take_one(deliveries[i]) for i in rest))
            for i, lease in zip(rest, taken, strict=True):
                leases[i] = lease
        return [lease for lease in leases if lease is not None]

    async def _take_one(self, delivery: _Delivery) -> Lease | None:
        """Turn a delivered message into a lease: the record says running under this consumer
        (compare-and-set), and a claim marker fences the events subject (the general path:
        `_first` did not apply, or its write lost to another)."""
        msg, spec, consumer, affinity = delivery
        reply = msg.reply or ""
        revision = 0
        job: StoredJob | None = None
        for _ in range(6):
            if job is None:
                found = await self.store.get(spec.id)
                if found is None:  # neither its record nor (it was deleted) its message
                    await self.store.ack(reply, b"+TERM")
                    return None
                job, revision = found
            lane, seq = delivered(msg)
            if job.seq and job.seq != seq:
                await self.store.ack(reply)  # moved (requeued) since this message
                return None
            now = self.clock()
            taken = machine.take(job.state(), consumer, now, self.store.rules)
            if taken is Refused.FINISHED:
                await self.store.ack(reply)
                return None
            if taken is Refused.NOT_YET:
                # redelivered while its holder's lease (as renewed) still runs: not ours yet
                delay = int((job.lease_until - now) * 1e9)
                await self.store.ack(reply, b"-NAK " + json.dumps({"delay": delay}).encode())
                return None
            assert isinstance(taken, Step)
            if taken.ended:  # its deadline passed, every delivery was used, or it was cancelled
                if await self.endings.ended(job, revision, taken):
                    await self.store.ack(reply)
                    return None
                job = None
                continue
            if job.last_error is not None and job.status is JobStatus.QUEUED:
                await self.store.mark(Names.delayed(spec.model), spec.id, False)
            job.take_on(taken.state)
            job.affinity = affinity
            job.seq = seq
            job.lane = lane
            new_revision = await self.store.cas(job, revision)
            if new_revision is None:
                job = None
                continue
            break
        else:
            await self.store.ack(reply, b"-NAK")
            return None
        assert job is not None
        last, resumable, finished = await self._fence_events(job.spec.id, job.deliveries)
        if finished is not None:
            await self.endings.mend(job, new_revision, finished, reply)
            return None
        return await self._leased(reply, job, new_revision, last, resumable)

    def _first(self, delivery: _Delivery) -> tuple[StoredJob, int] | None:
        """The common case, one write after the pull: a first delivery, the record to write
        from the message and the revision it replaces: a keyed job's as its enqueue wrote it
        (the message names it), else none (0: a plain job has no record until now, and one
        that is there, of a retry, a cancel or a resend, makes the write lose); no claim marker
        is needed (no one held the job before). None: the general path."""
        msg, spec, consumer, affinity = delivery
        headers = msg.headers or {}
        now = self.clock()
        if spec.deadline is not None and spec.deadline <= now:
            return None
        if REVISION in headers:
            revision = int(headers[REVISION])
        elif ENQUEUED_AT in headers:
            revision = 0
        else:
            return None  # a requeue's message: its record says what happened
        lane, seq = delivered(msg)
        job = StoredJob(
            spec=spec,
            status=JobStatus.RUNNING,
            deliveries=1,
            enqueued_at=float(headers.get(ENQUEUED_AT, "0")),
            started_at=now,
            worker=consumer,
            lane=lane,
            subject=msg.subject,
            seq=seq,
            lease_until=now + self.settings.lease_s,
            affinity=affinity,
        )
        return job, revision

    async def _leased(
        self, reply: str, job: StoredJob, revision: int, last: int, resumable: bool
    ) -> Lease:
        self.store.holding[reply] = Holding(job, revision, last, marker=last)
        if job.spec.prefix_key:
            await self._own_prefix(job.spec, job.worker or "")
        lease_spec = msgspec.structs.replace(job.spec, attempt=job.deliveries - 1)
        return Lease(
            spec=lease_spec,
            entry_id=reply,
            consumer=job.worker or "",
            resumable=resumable,
            affinity=job.affinity,
            preemptions=job.preemptions,
        )

    async def _fence_events(self, job_id: str, delivery: int) -> tuple[int, bool, JobResult | None]:
        """Append the claim marker; (its sequence, whether earlier events exist, None). A job
        whose events end with its Finished gets no marker: (0, True, that result)."""
        expect = 0
        for _ in range(2):
            # named by the place it expects: a try whose answer was lost is found there
            msg_id = event_id(job_id, delivery, f"m{expect}")
            try:
                marker = await self.store.publish_event(
                    job_id, b"", expect, marker=True, msg_id=msg_id
                )
                return marker, expect > 0, None
            except Fenced:
                pass
            expect, ended = await self.store.last_finished(job_id)
            if ended is not None:
                return 0, True, ended
        # An earlier holder is still appending (it lost the job and does not know yet) faster
        # than a look and a try: the marker goes in after whatever it wrote, naming where this
        # claim last looked, and a Finished it wrote in between ends the job as above.
        msg_id = event_id(job_id, delivery, f"s{expect}")
        marker = await self.store.publish_event(
            job_id, b"", None, marker=True, msg_id=msg_id, since=expect
        )
        ended = await self.store.finished_between(job_id, expect, marker)
        if ended is not None:
            return 0, True, ended
        return marker, True, None

    async def _own_prefix(self, spec: JobSpec, consumer: str) -> None:
        """This worker owns the prefix now, unless another live worker does (sticky)."""
        assert spec.prefix_key
        kv = await self.store.jobs()
        key = Names.prefix_owner(spec.model, spec.prefix_key)
        try:
            entry = await sent(kv.get(key))
            owner, _, until = (entry.value or b"").decode().partition(" ")
            if (
                owner
                and owner != consumer
                and float(until or 0) > self.clock()
                and await self.store.is_live(spec.model, owner)
            ):
                return
        except nats.js.errors.KeyNotFoundError:
            pass
        expires = self.clock() + self.settings.affinity_ttl_s
        await sent(kv.put(key, f"{consumer} {expires!r}".encode()))


def _fair_plan(view: LaneView, room: int) -> dict[str, int]:
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


def _decoded(msgs: Sequence[Msg]) -> list[tuple[Msg, JobSpec]]:
    return [(m, decode(m.data, JobSpec)) for m in msgs]
