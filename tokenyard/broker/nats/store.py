"""The state every part of the NATS queue core shares (store.Store) and its primitive writes and
reads: a job's record by compare-and-set, its events fenced by the expected last sequence, lane
messages, acknowledgements, wake-ups, and the small sets and counters kept in KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import nats.js.errors
from nats.js.api import ConsumerConfig, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.kv import KeyValue

from tokenyard.broker import audit, machine
from tokenyard.broker.core import Clock
from tokenyard.broker.nats.audit import NatsAudit
from tokenyard.broker.nats.connection import NatsConnection, kv_change, kv_entry, sent
from tokenyard.broker.nats.names import Names
from tokenyard.broker.nats.records import StoredJob, decode_job, encode_job
from tokenyard.broker.nats.tables import NatsQuotas, NatsRegistry
from tokenyard.broker.nats.waiting import waiting_job
from tokenyard.broker.tables import settlement
from tokenyard.config import BrokerSettings
from tokenyard.errors import BrokerUnavailable
from tokenyard.messages import (
    DeadLetter,
    Finished,
    JobEvent,
    JobResult,
    JobSpec,
    Priority,
    decode,
    decode_event,
    encode,
)

log = logging.getLogger(__name__)

EXPECT_LAST = "Nats-Expected-Last-Subject-Sequence"
MARKER = "Ty-Claim"  # header of the claim marker: an events message no reader is shown
LAST = "Ty-Last"  # header of a job's last message holding two events: its tail and Finished
# header of a claim marker sent whatever came before it (an earlier holder kept appending): the
# last sequence its claimer had seen, so that an earlier holder's Finished after it is found
SINCE = "Ty-Since"
MSG_ID = "Nats-Msg-Id"
RESEND_S = 20.0  # how long a write whose answer was lost is sent again (a cluster electing)
# header of a keyed job's lane message: its record's revision when it was enqueued (a job no
# key names has no record until its first claim writes it, expecting none: revision 0)
REVISION = "Ty-Rev"
WRONG_LAST = 10071  # JetStream: wrong last sequence
DUPLICATE_WINDOW_S = 120.0  # a lane drops a message whose Nats-Msg-Id it saw this recently


class Fenced(Exception):
    """The lease is no longer ours: another holder, or the job ended."""


@dataclass
class Holding:
    """This process's knowledge of a lease it holds: the record as it wrote it and its
    revision, and the events subject's last sequence (both are fences)."""

    job: StoredJob
    revision: int
    last_seq: int
    marker: int  # its claim marker's sequence (0: a first holder, which has none): names its
    # events, unlike a delivery number
    appended: int = 0  # events it stored: the next one's place names its id
    finishing: bool = False  # a completion of it is under way (a second one is fenced)


class Store:
    """What every part of the queue shares: the settings, the connection, the tables it
    settles in, the leases this process holds, and the writes and reads of one record, one
    job's events, a lane's messages and the small KV sets and counters."""

    def __init__(
        self,
        settings: BrokerSettings,
        conn: NatsConnection,
        names: Names,
        quotas: NatsQuotas,
        audit_trail: NatsAudit,
        registry: NatsRegistry,
        clock: Clock,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.conn = conn
        self.names = names
        self.quotas = quotas
        self.audit = audit_trail
        self.registry = registry
        self.rng = rng or random.Random()  # retry backoff's jitter
        self.rules = machine.Rules.of(settings)
        self.consumers: set[tuple[str, str]] = set()
        self.holding: dict[str, Holding] = {}  # lease entry id -> what fences it
        self._lanes: dict[tuple[str, Priority, int], str] = {}  # lane streams made
        self._events = ""  # the events stream, once made
        self._waking: dict[str, set[str]] = {}  # model -> lane subjects `wake_soon` gathered
        self._waker: asyncio.Task[None] | None = None

    async def jobs(self) -> KeyValue:
        ttl = max(self.settings.record_ttl_s, self.settings.idempotency_ttl_s)
        # direct gets: a record is read on the connection's long-lived inbox (`get`)
        return await self.conn.kv(self.names.jobs_bucket, ttl_s=ttl, direct=True)

    async def lane(self, model: str, priority: Priority, pool: int) -> str:
        made = self._lanes.get((model, priority, pool))
        if made is not None:
            return made
        self._lanes[(model, priority, pool)] = made = await self._make_lane(model, priority, pool)
        return made

    async def _make_lane(self, model: str, priority: Priority, pool: int) -> str:
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

    async def events_stream(self) -> str:
        if not self._events:
            names = self.names
            self._events = await self.kept_stream(names.events.stream, names.events.subjects)
        return self._events

    async def dead_stream(self) -> str:
        return await self.kept_stream(self.names.dead.stream, self.names.dead.subjects)

    async def kept_stream(self, name: str, subjects: str) -> str:
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

    async def consumer(self, stream: str, subject: str) -> str:
        name = Names.consumer(subject)
        if (stream, name) in self.consumers:
            return name
        js = await self.conn.js()
        await sent(
            js.add_consumer(
                stream,
                ConsumerConfig(
                    durable_name=name,
                    filter_subject=f"{subject}.*",  # each job's message has a subject
                    ack_wait=self.settings.lease_s,
                    max_deliver=-1,  # the record counts deliveries (a hand-back is none)
                    max_ack_pending=-1,
                    # a tenant that stopped sending leaves no consumer behind for ever
                    inactive_threshold=max(3600.0, self.settings.lease_s * 4),
                ),
            )
        )
        self.consumers.add((stream, name))
        return name

    async def ack(self, reply: str, verb: bytes = b"+ACK") -> None:
        nc = await self.conn.client()
        await sent(nc.publish_now(reply, verb, "", None))

    async def wake(self, model: str, subjects: Sequence[str]) -> None:
        """Tell blocked claims which lane subjects just got work (a core publish, no ack)."""
        nc = await self.conn.client()
        lanes = sorted({Names.lane_subject_of(s) for s in subjects})
        await sent(nc.publish(self.names.wake(model), " ".join(lanes).encode()))

    def wake_soon(self, model: str, subjects: Sequence[str]) -> None:
        """`wake`, sent once the enqueues answered in the same turn of the loop have gathered
        their subjects: one wake-up for them all, each one a message every worker reads."""
        self._waking.setdefault(model, set()).update(subjects)
        if self._waker is None:
            self._waker = asyncio.get_running_loop().create_task(self._wake_gathered())

    async def _wake_gathered(self) -> None:
        try:
            while self._waking:
                waking, self._waking = self._waking, {}
                for model, subjects in waking.items():
                    await self.wake(model, sorted(subjects))
        except BrokerUnavailable as exc:
            # the jobs are stored: a blocked claim finds them by its next look (POLL_S)
            log.warning("wake-up not sent: %s", exc)
        finally:
            self._waker = None

    async def woken(self) -> None:
        """Wait for the wake-ups `wake_soon` gathered to be sent (before closing)."""
        if self._waker is not None:
            await asyncio.gather(self._waker, return_exceptions=True)

    async def get(self, job_id: str) -> tuple[StoredJob, int] | None:
        """The job's record and its revision (a direct get on the long-lived inbox); a queued
        job with none yet (no key named it): as its lane message says, revision 0 (a write
        of it expects no record: a claim's, a cancel's, a join's race by compare-and-set)."""
        found = await self.record(job_id)
        if found is not None:
            return found
        waiting = await waiting_job(self.conn, self.names, self.settings.pool_count, job_id)
        if waiting is not None:
            return waiting, 0
        # taken (or ended) between the two reads: its record was written before its message went
        return await self.record(job_id)

    async def record(self, job_id: str) -> tuple[StoredJob, int] | None:
        """The job's stored record alone, and its revision."""
        await self.jobs()
        bucket = self.names.jobs_bucket
        found = await self.conn.direct_last(
            Names.kv_stream(bucket), Names.kv_subject(bucket, Names.job(job_id))
        )
        if found is None or found[2].get("KV-Operation") in ("DEL", "PURGE"):
            return None
        return decode_job(found[1]), found[0]

    async def cas(self, job: StoredJob, revision: int) -> int | None:
        """Write the record if it is still at `revision` (0: only where none is); its new
        revision, None if not."""
        return await self.conn.acked(await self.cas_soon(job, revision))

    async def cas_soon(self, job: StoredJob, revision: int) -> asyncio.Future[int | None]:
        """`cas` written now, its answer awaited later (several cost one round trip)."""
        [answer] = await self.cas_all([(job, revision)])
        return answer

    async def cas_all(
        self, writes: Sequence[tuple[StoredJob, int]]
    ) -> list[asyncio.Future[int | None]]:
        """`cas` of each (record, revision) written now as one buffer write (all or none),
        their answers awaited later."""
        if not writes:
            return []
        await self.jobs()
        bucket = self.names.jobs_bucket
        answers = await self.conn.publish_all(
            [
                (
                    Names.kv_subject(bucket, Names.job(job.spec.id)),
                    encode_job(job),
                    {EXPECT_LAST: str(revision)},
                )
                for job, revision in writes
            ]
        )
        return [_wrong_last_is_none(answer) for answer in answers]

    async def publish_event(
        self,
        job_id: str,
        data: bytes,
        expect: int | None,
        marker: bool = False,
        msg_id: str | None = None,
        last: bool = False,
        since: int | None = None,
    ) -> int:
        """Append to a job's events (`last`: `data` is its tail and Finished; `since`: a marker
        sent with no `expect`, after that sequence); raises Fenced when `expect` is no longer
        the last.

        With a `msg_id`, a publish the server may or may not have stored (a timeout, a
        failover) is sent again for up to RESEND_S, and one refused because `expect` is no
        longer the last counts as stored when the message right after `expect` has its id (an
        earlier try of it: this one's, or a call sent again).
        """
        await self.events_stream()
        headers = _event_headers(expect, marker, msg_id, last, since)
        give_up, pause = time.monotonic() + RESEND_S, 0.05
        while True:
            try:
                return await self.conn.publish_acked(
                    self.names.events(job_id), data, headers=headers or None
                )
            except BrokerUnavailable:
                if msg_id is None or time.monotonic() > give_up:
                    raise
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.5)
            except nats.js.errors.APIError as exc:
                if exc.err_code != WRONG_LAST:
                    raise
                stored = await self.stored_after(job_id, expect, msg_id)
                if stored is None:
                    raise Fenced from exc
                return stored

    async def events_all(
        self, firsts: Sequence[tuple[str, bytes, int, str, bool]]
    ) -> list[asyncio.Future[int]]:
        """`publish_event`'s first tries of several (job id, data, expect, msg id, last),
        written now as one buffer write (all or none), their answers awaited later; a caller
        whose try failed sends it again through `publish_event`."""
        if not firsts:
            return []
        await self.events_stream()
        return await self.conn.publish_all(
            [
                (self.names.events(job_id), data, _event_headers(expect, False, msg_id, last, None))
                for job_id, data, expect, msg_id, last in firsts
            ]
        )

    async def stored_after(self, job_id: str, expect: int | None, msg_id: str | None) -> int | None:
        """The sequence of the job's event right after `expect` if its id is `msg_id`."""
        if expect is None or not msg_id:
            return None
        stream = await self.events_stream()
        rows = await self.conn.get_batch(stream, self.names.events(job_id), expect, 1)
        if rows and rows[0][2].get(MSG_ID) == msg_id:
            return rows[0][0]
        return None

    async def last_finished(self, job_id: str) -> tuple[int, JobResult | None]:
        """The events subject's last sequence, and the job's result if that is its Finished
        (or, the last being a marker sent after unseen events, if one of those is)."""
        last, ended, _ = await self.ending(job_id)
        return last, ended

    async def ending(self, job_id: str) -> tuple[int, JobResult | None, float | None]:
        """`last_finished`, and when the server stored that Finished (None: not known)."""
        last, data, headers = await self.last_event(job_id)
        if data is not None and SINCE in headers:
            return last, await self.finished_between(job_id, int(headers[SINCE]), last), None
        if data is None or headers.get(MARKER):
            return last, None, None
        event = events_of(data, headers)[-1]
        if not isinstance(event, Finished):
            return last, None, None
        return last, event.result, _stamp(headers.get("Nats-Time-Stamp", ""))

    async def finished_between(self, job_id: str, after: int, before: int) -> JobResult | None:
        """The result of a Finished among the job's events after `after`, before `before`."""
        stream = await self.events_stream()
        while True:
            rows = await self.conn.get_batch(stream, self.names.events(job_id), after, 64)
            for seq, data, headers in rows:
                if seq >= before:
                    return None
                if headers.get(MARKER):
                    continue
                event = events_of(data, headers)[-1]
                if isinstance(event, Finished):
                    return event.result
            if len(rows) < 64:
                return None
            after = rows[-1][0]

    async def last_event(self, job_id: str) -> tuple[int, bytes | None, dict[str, str]]:
        """The events subject's last (sequence, data, headers, the server's own among them);
        (0, None, {}) if none. A direct get on the long-lived inbox."""
        stream = await self.events_stream()
        found = await self.conn.direct_last(stream, self.names.events(job_id))
        return (0, None, {}) if found is None else found

    async def drop_message(self, job: StoredJob) -> None:
        """Delete the job's waiting message from its lane (it ended before a claim)."""
        if not job.lane:
            return
        if not job.seq:
            job.seq = await self.find_message(job)
            if not job.seq:
                return
        js = await self.conn.js()
        with contextlib.suppress(nats.js.errors.APIError):  # acknowledged (taken), or gone
            await sent(js.delete_msg(job.lane, job.seq))

    async def find_message(self, job: StoredJob, limit: int = 100_000) -> int:
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

    async def dead_letter_entry(self, job: StoredJob, reason: str, error: str | None) -> None:
        js = await self.conn.js()
        await self.dead_stream()
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

    async def settle(self, ended: Sequence[tuple[JobSpec, JobResult]]) -> None:
        """Quota settlement and terminal audit entries of jobs that just ended."""
        held = [settlement(spec, result) for spec, result in ended if spec.quota]
        now = self.clock()
        self.audit.append_soon([audit.terminal(spec, result, now) for spec, result in ended])
        if held:
            await self.quotas.settle(held)

    async def is_live(self, model: str, worker: str) -> bool:
        """Whether the worker's heartbeat holds."""
        return worker in {w.consumer for w in await self.registry.workers(model)}

    async def subjects(self, stream: str, only: str = ">") -> dict[str, int]:
        """Messages per subject of a stream (waiting and in flight), a lane's jobs counted on
        their tenant's or held subject; `only`: the subjects matching this filter."""
        subjects: dict[str, int] = defaultdict(int)
        seen = 0
        while True:  # a job's own subject each: the server pages past 100,000 subjects
            try:
                answer = await self.conn.api(
                    f"STREAM.INFO.{stream}", {"subjects_filter": only, "offset": seen}
                )
            except nats.js.errors.NotFoundError:
                return {}
            page = answer.get("state", {}).get("subjects") or {}
            for subject, n in page.items():
                subjects[Names.lane_subject_of(subject)] += n
            seen += len(page)
            if not page or seen >= int(answer.get("total", 0)):
                return dict(subjects)

    async def count(self, model: str, name: str) -> None:
        def plus_one(raw: bytes | None) -> tuple[bytes, None]:
            return str(int(raw or b"0") + 1).encode(), None

        await kv_change(await self.jobs(), Names.counter(model, name), plus_one)

    async def counter(self, model: str, name: str) -> int:
        raw, _ = await kv_entry(await self.jobs(), Names.counter(model, name))
        return int(raw or b"0")

    async def waiting(self, stream: str) -> dict[str, int]:
        """Messages not yet delivered per lane subject that has a consumer (one answer per
        consumer, where `subjects` lists each waiting job's subject)."""
        infos = await self.consumer_infos(stream)
        return {f[:-2]: int(info.num_pending or 0) for f, info in infos.items() if f.endswith(".*")}

    async def consumer_infos(self, stream: str) -> dict[str, Any]:
        js = await self.conn.js()
        try:
            infos = await sent(js.consumers_info(stream))
        except nats.js.errors.NotFoundError:
            return {}
        return {info.config.filter_subject or "": info for info in infos}

    async def marked(self, key: str) -> set[str]:
        """The members of a small set kept in one KV entry (cancels asked, retries waiting)."""
        raw, _ = await kv_entry(await self.jobs(), key)
        return set(decode(raw, list[str])) if raw else set()

    async def mark(self, key: str, member: str, on: bool) -> None:
        """Add or remove a member, by compare-and-set."""

        def marked(raw: bytes | None) -> tuple[bytes | None, None]:
            members = set(decode(raw, list[str])) if raw else set()
            if (member in members) == on:
                return None, None
            return encode(sorted(members | {member} if on else members - {member})), None

        await kv_change(await self.jobs(), key, marked)


def event_id(job_id: str, writer: int, n: str) -> str:
    """An event's message id: its job, who wrote it (a holder's events: its claim marker's
    sequence, 0 for a first holder; a claim marker: its delivery) and its place (`n`: 1, 2...;
    `f` the last message; `m<sequence>` a marker expecting that sequence before it)."""
    return f"{job_id}.{writer}.{n}"


def _event_headers(
    expect: int | None, marker: bool, msg_id: str | None, last: bool, since: int | None
) -> dict[str, str]:
    headers = {} if expect is None else {EXPECT_LAST: str(expect)}
    if marker:
        headers[MARKER] = "1"
    if last:
        headers[LAST] = "1"
    if since is not None:
        headers[SINCE] = str(since)
    if msg_id:
        headers[MSG_ID] = msg_id
    return headers


def _stamp(text: str) -> float | None:
    """Unix seconds of a server time stamp (RFC 3339, nanoseconds); None if there is none."""
    whole, _, fraction = text.rstrip("Z").partition(".")
    try:
        at = datetime.fromisoformat(whole).replace(tzinfo=UTC).timestamp()
        return at + float(f"0.{fraction or 0}")
    except ValueError:
        return None


def events_of(data: bytes, headers: Mapping[str, str]) -> list[JobEvent]:
    """The events one message of a job's subject holds: one, or its tail and Finished."""
    if headers.get(LAST):
        return decode(data, list[JobEvent])
    return [decode_event(data)]


def _wrong_last_is_none(answer: asyncio.Future[int]) -> asyncio.Future[int | None]:
    """A compare-and-set's answer: its new revision, None when another write came first."""
    out: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()

    def done(fut: asyncio.Future[int]) -> None:
        if fut.cancelled():
            out.cancel()
            return
        exc = fut.exception()
        if out.done():
            return
        if exc is None:
            out.set_result(fut.result())
        elif isinstance(exc, nats.js.errors.APIError) and exc.err_code == WRONG_LAST:
            out.set_result(None)
        else:
            out.set_exception(exc)

    answer.add_done_callback(done)
    return out


class Part:
    """A role of the NATS queue core (enqueue.py, claims.py, leases.py, endings.py, reads.py,
    introspection.py): each works on the one shared store."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.settings = store.settings
        self.clock = store.clock
        self.conn = store.conn
        self.names = store.names
