"""The queue core on RabbitMQ lanes over the Valkey job table: the order of each change's
steps between the two.

RabbitMQ holds the lanes (lanes.py: quorum queues a worker consumes with prefetch = its
capacity, delay queues for retries, a dead-letter queue per model); the Valkey job table holds
the record (one hash), events (one stream per job), cancellation, quotas and audit in the same
round trip as each state change, and beside each record what the lanes fence by (ledger.py:
per lane a waiting and a lease set, each change one script of lua/).

Fencing: a job's record names its one live message (`msg`) and, while it runs, its lease token.
A claim takes a message only while the record names it, so a copy made stale by a requeue,
retry or withdrawal is dropped; a worker writes only while the record names its token, so a
zombie whose lease was reaped, or whose connection died and whose message RabbitMQ gave to
another worker, is fenced off. A requeue publishes its new message before the record names it:
a crash in between leaves a stale copy, never a job with no message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Sequence
from typing import NamedTuple

from tokenyard.broker import audit, machine
from tokenyard.broker.amqp.affinity import Affinity
from tokenyard.broker.amqp.connection import AmqpConnection, Refused
from tokenyard.broker.amqp.lanes import Delivery, RabbitLanes, new_msg
from tokenyard.broker.amqp.ledger import Ledger
from tokenyard.broker.amqp.names import Names
from tokenyard.broker.core import (
    CancelOutcome,
    Claim,
    EnqueueResult,
    Lease,
    Preempted,
    ReapReport,
    admitted,
)
from tokenyard.broker.lanes import LanesOnTable
from tokenyard.broker.outcomes import cancelled_result, dead_result, expired_result
from tokenyard.broker.policy import backoff_delay, stamp_by_model
from tokenyard.broker.redis.connection import SOCKET_TIMEOUT_S
from tokenyard.broker.redis.connection import text as as_text
from tokenyard.broker.redis.table import ValkeyJobTable
from tokenyard.errors import QueueFull
from tokenyard.messages import JobEvent, JobResult, JobSpec, JobStatus, Priority, TokenChunk, decode

log = logging.getLogger(__name__)

REAP_BATCH = 200  # leases looked at per lane and reap; dead letters drained per reap
# A message a claim met before its record (an enqueue publishes a job no key names while its
# record is admitted) is asked about again after EARLY_RETRY_S, held meanwhile, then after as
# long as it has waited (EARLY_RETRY_MAX_S at most): the record of an enqueue in flight comes
# within a round trip, so a message still without one is likely an orphan. It is dropped once
# its record has not come for EARLY_HOLD_S, past the deadline of any admit (an admit unanswered
# by then failed its enqueue): a message whose admission failed with the tables unreachable, so
# that no tombstone says so, or a stale copy that outlived its ended job's record
EARLY_RETRY_S = 0.02
EARLY_RETRY_MAX_S = 1.0
EARLY_HOLD_S = 2 * SOCKET_TIMEOUT_S
# A job published after its record (a key names it, or a worker holds it) whose publish is not
# confirmed this long after its admit lost its producer between the two, past any admit's and
# publish's deadline: a reap publishes it, if no resend did (a live producer's late message
# would only be stale, dropped at its claim)
ORPHAN_AFTER_S = EARLY_HOLD_S


class _Early(NamedTuple):
    """A delivery met before its job's record: held (unacked) until it is asked about again."""

    delivery: Delivery  # its `held_since`: when a claim first met it
    due: float  # when to ask again (monotonic)
    generation: int  # the AMQP connection it came on: one that closed took it back


class AmqpQueue(LanesOnTable):
    """RabbitMQ lanes over the Valkey job table."""

    table: ValkeyJobTable

    def __init__(self, table: ValkeyJobTable, amqp: AmqpConnection, names: Names) -> None:
        super().__init__(table)
        self.conn = table.conn
        self.keys = table.keys
        self.lanes = RabbitLanes(table.settings, amqp, names)
        self.ledger = self.counts = Ledger(table)
        self.amqp = amqp
        self.names = names
        self.affinity = Affinity(table, amqp, names)
        self._early: dict[str, list[_Early]] = {}  # model -> deliveries met before their records

    # -- producing -------------------------------------------------------------------------
    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[EnqueueResult]:
        """Records (one script per model, with the receipts) and each new job's message,
        confirmed. Each model's jobs all or none (core.QueueCore): a model whose lane is full,
        by the records' count or by RabbitMQ refusing a message, has its jobs withdrawn.

        A job no key names and no worker holds (most) is published while its record is
        admitted, not after: one at a time an enqueue waits for the confirm alone, not for the
        admit and then the confirm. Its message may reach a claim before its record: take.lua
        says so (5) and the claim holds it and asks again (`_take`). One whose admission was
        refused, or failed, leaves a tombstone, so its message is dropped as stale. A job with a
        key may join another job or resend its own, a held job goes to its worker's queue:
        those are published after their records, as the admit says."""
        now = self.clock()
        by_model = stamp_by_model(specs, now, self.settings.pool_bounds)
        for model in by_model:
            await self.lanes.declare(model)
        msgs = [new_msg() for _ in specs]
        holders = await self.affinity.holders(specs)  # prefix affinity: '' for most
        calls = [
            self.ledger.admit(
                model,
                [
                    (specs[i], msgs[i], holders[i], not _unkeyed(specs[i], holders[i]))
                    for i in indexes
                ],
                now,
            )
            for model, indexes in by_model.items()
        ]
        receipts = [audit.received(spec, now) for spec in specs]
        early = [i for i, spec in enumerate(specs) if _unkeyed(spec, holders[i])]
        sends = [
            asyncio.ensure_future(self.lanes.publish(specs[i], specs[i].id, msgs[i])) for i in early
        ]
        try:
            # in this task, not one of gather's: the audit trail holds a task's receipts for
            # it, and this task takes back those of jobs not created (below)
            admitting = await self.table.eval_audited(calls, receipts)
        except Exception:  # nothing stands: undo what may have landed
            await asyncio.gather(*sends, return_exceptions=True)
            await self._unadmit(specs, early, msgs, repr(now))
            raise
        except BaseException:
            for send in sends:
                send.cancel()
            raise
        sending = await asyncio.gather(*sends, return_exceptions=True)
        early_sent: dict[int, BaseException | None] = dict(zip(early, sending, strict=True))
        replies, ids = admitting
        await self.table.note_models(by_model)
        results: list[EnqueueResult | None] = [None] * len(specs)
        publish: list[int] = []  # the new jobs, and resent ones whose message never went out
        full: QueueFull | None = None
        for indexes, (code, rows) in zip(by_model.values(), replies, strict=True):
            if code == -1:  # none of this model's jobs was added
                full = full or self.table.lane_full(specs, indexes, rows)
                continue
            for i, (created, job_id, joined, again) in zip(indexes, rows, strict=True):
                results[i] = EnqueueResult(
                    job_id=as_text(job_id), created=created == 1, collapsed=joined == 1
                )
                if again == 1:
                    publish.append(i)
        # a refused job's message that landed: stale from now on (a refused publish sent none)
        refused = [
            specs[i].id
            for i, o in early_sent.items()
            if results[i] is None and not isinstance(o, Refused)
        ]
        if refused:  # unmarked, such a message is only held a while longer (EARLY_HOLD_S)
            with contextlib.suppress(Exception):
                await self.ledger.gone(refused)
        late = [i for i in publish if i not in early_sent]  # (an early one's `again` is its own)
        sent = await asyncio.gather(
            *(self._publish(specs[i], results[i], msgs[i], holders[i]) for i in late),
            return_exceptions=True,
        )
        outcomes = dict(zip(late, sent, strict=True))
        outcomes |= {i: early_sent[i] for i in publish if i in early_sent}
        failed = {i: o for i, o in outcomes.items() if isinstance(o, BaseException)}
        broken = next((o for o in failed.values() if not isinstance(o, Refused)), None)
        if broken is not None:  # the call's failure (the connection's): nothing stands
            await self.ledger.withdraw(specs, results, by_model, msgs)
            await self.table.audit.take_back(ids)
            raise broken
        if failed:  # RabbitMQ refused a message: its lane is full, its model's jobs withdrawn
            refused_models = {specs[i].model for i in failed}
            dropped = {m: indexes for m, indexes in by_model.items() if m in refused_models}
            await self.ledger.withdraw(specs, results, dropped, msgs)
            for i in (i for indexes in dropped.values() for i in indexes):
                results[i] = None
            queue = next(o.queue for o in failed.values() if isinstance(o, Refused))
            limit = self.settings.max_queue_depth
            full = full or QueueFull(queue, limit, limit)
        await self.table.audit.take_back(
            [ids[i] for i, r in enumerate(results) if r is None or not r.created]
        )
        # confirmed: a resend of these finds them published. Not the early ones: they were
        # admitted unpublished, and a resend of one still queued (by its id: no key names it)
        # republishes it, the first message then stale: one message more on a rare path, not a
        # round trip on every enqueue
        standing = [i for i in late if results[i] is not None]
        if standing:
            await self.ledger.published(
                [specs[i] for i in standing], [_id(results[i]) for i in standing]
            )
        return admitted(results, full)

    async def _unadmit(
        self, specs: Sequence[JobSpec], early: list[int], msgs: list[str], made_at: str
    ) -> None:
        """After an admit that failed (its outcome unknown): take back the early jobs' records,
        had the admit (at `made_at`) made them, and leave their tombstones, so a message of
        theirs that landed is dropped. Best effort: with the tables unreachable, a claim holds
        such a message while its record might still come (EARLY_HOLD_S), then drops it."""
        if not early:
            return
        guessed: list[EnqueueResult | None] = [None] * len(specs)
        for i in early:
            guessed[i] = EnqueueResult(job_id=specs[i].id, created=True, collapsed=False)
        by_model: dict[str, list[int]] = {}
        for i in early:
            by_model.setdefault(specs[i].model, []).append(i)
        with contextlib.suppress(Exception):
            await self.ledger.withdraw(specs, guessed, by_model, msgs, made_at)

    async def _publish(
        self, spec: JobSpec, result: EnqueueResult | None, msg: str, holder: str
    ) -> None:
        """A job's message on its lane, or, for a new job admit.lua held (prefix affinity), in
        the held queue of the worker it is held for (a resend goes to the lane)."""
        if holder and result is not None and result.created:
            await self.affinity.publish(spec, result.job_id, msg, holder)
        else:
            await self.lanes.publish(spec, _id(result), msg)

    # -- consuming -------------------------------------------------------------------------
    async def _claim(self, ask: Claim) -> list[Lease]:
        """What RabbitMQ pushed to this process's lane consumers, in claim order (strict
        priority, anti-starvation rounds), at most `slots`; topped up with basic.get where a
        push cannot bring more now; else wait for a push up to `block_s`. Consumers are made by
        the first blocking claim (a worker's): a claim that may not wait, with none made, takes
        exactly what is ready by basic.get alone."""
        model, consumer, slots, block_s, pools, batch_room = ask
        await self.lanes.declare(model)
        feed = await self.lanes.feed(model, pools, slots, block=block_s > 0)
        give_up_at = time.monotonic() + block_s
        while True:
            order = self._next_order(model, len(Priority))
            # messages met before their records and due again, jobs held for this worker
            # (prefix affinity), then the lanes
            got = self._early_due(model, pools, slots)
            room = None if batch_room is None else batch_room - _batch(got)
            got += await self.affinity.take_own(
                model, consumer, order, pools, slots - len(got), room
            )
            room = None if batch_room is None else batch_room - _batch(got)
            got += await self.lanes.pull(
                model, feed, order, pools, slots - len(got), room, block=block_s > 0
            )
            if got:
                leases = await self._take(model, consumer, got)
                if leases:
                    return leases
                continue  # only stale copies: they are gone now, look again at once
            wait = give_up_at - time.monotonic()
            if wait <= 0 or feed is None:
                return []
            early = min((e.due for e in self._early.get(model, ())), default=float("inf"))
            poll = self.affinity.poll_s(model, consumer)
            await self.lanes.wait(feed, min(wait, poll, max(0.0, early - time.monotonic())))

    def _early_due(self, model: str, pools: Sequence[int], slots: int) -> list[Delivery]:
        """The held deliveries met before their records that are due to be asked about again
        (at most `slots`, of `pools`); one whose connection closed is forgotten (RabbitMQ
        delivers it again)."""
        held = self._early.get(model)
        if not held:
            return []
        now = time.monotonic()
        due: list[Delivery] = []
        keep: list[_Early] = []
        for entry in held:
            if not self.amqp.alive(entry.generation):
                continue
            if entry.due <= now and len(due) < slots and entry.delivery.lane.pool in pools:
                due.append(entry.delivery)
            else:
                keep.append(entry)
        self._early[model] = keep
        return due

    def _hold_early(self, model: str, delivery: Delivery) -> bool:
        """Hold a delivery met before its record to ask again (False: held too long already,
        its record will not come)."""
        now = time.monotonic()
        since = now if delivery.held_since is None else delivery.held_since
        if now - since > EARLY_HOLD_S:
            return False
        after = min(max(EARLY_RETRY_S, now - since), EARLY_RETRY_MAX_S)
        entry = _Early(delivery._replace(held_since=since), now + after, self.amqp.generation)
        self._early.setdefault(model, []).append(entry)
        return True

    async def _take(
        self,
        model: str,
        consumer: str,
        got: Sequence[Delivery],
    ) -> list[Lease]:
        """Lease what the records still name; ack what is stale, expired or dead; hold what
        came before its record (`_hold_early`)."""
        now = self.clock()
        items, pending = [], []
        for delivery in got:
            job_id = delivery.message.body.decode()
            if self.lanes.rehold(job_id, delivery):
                continue
            token = secrets.token_hex(8)
            msg = delivery.message.message_id or ""
            lane = (model, delivery.lane.priority, delivery.lane.pool)
            pending.append((delivery, job_id, token))
            items.append(self.ledger.take_item(job_id, msg, token, lane))
        if not items:
            return []
        dead_error = machine.lapsed_error(self.settings.max_deliveries)
        call = self.ledger.take(model, consumer, items, now, dead_error)
        rows = await self.conn.run(call)
        leases: list[Lease] = []
        ended: list[tuple[JobSpec, JobResult | None]] = []
        for (delivery, job_id, token), (code, spec_bytes, attempt, resumable, preempted) in zip(
            pending, rows, strict=True
        ):
            if code == 5 and self._hold_early(model, delivery):
                continue
            if code == 1:
                spec = decode(spec_bytes, JobSpec)
                spec.attempt = int(attempt)
                self.lanes.hold(token, job_id, delivery)
                if spec.prefix_key:
                    self.affinity.took_prefix(model, consumer)
                leases.append(
                    Lease(
                        spec=spec,
                        entry_id=token,
                        consumer=consumer,
                        resumable=resumable == 1,
                        affinity=self.affinity.affine(model, delivery),
                        preemptions=int(preempted),
                    )
                )
                continue
            await self.lanes.drop(delivery)
            if code == 2:
                ended.append((decode(spec_bytes, JobSpec), expired_result()))
            elif code == 3:
                ended.append((decode(spec_bytes, JobSpec), dead_result(dead_error)))
            elif code == 4:
                ended.append((decode(spec_bytes, JobSpec), cancelled_result()))
        if ended:  # rare: their end goes to the audit trail (and settles any quota)
            await self.table.settle(ended)
        # a lane is FIFO: within each lane, what one claim took runs earliest deadline first
        rank = {
            lane: i
            for i, lane in enumerate(dict.fromkeys((d.lane.priority, d.lane.pool) for d in got))
        }
        leases.sort(
            key=lambda lease: (
                rank[lease.spec.priority, lease.spec.pool],
                lease.spec.deadline is None,
                lease.spec.deadline or 0.0,
            )
        )
        return leases

    # -- settling --------------------------------------------------------------------------
    async def renew(self, leases: Sequence[Lease]) -> list[bool]:
        return await self.ledger.renew(leases, self.clock() + self.settings.lease_s)

    async def append_events(self, events: Sequence[tuple[Lease, JobEvent]]) -> list[bool]:
        return await self.ledger.emit(events)

    async def complete_many(
        self,
        items: Sequence[tuple[Lease, JobResult]],
        tails: Sequence[TokenChunk | None] | None = None,
    ) -> list[bool]:
        # fenced or not, the delivery is done with: a fenced one's message is stale or gone
        return await self.table.complete_many(
            items, tails, self.ledger.complete, then=self.lanes.let_go
        )

    async def _fail(self, lease: Lease, error: str, reason: str, force_dead: bool) -> int:
        """1 retrying (after backoff, through a delay queue), 0 dead-lettered, 2 ended
        cancelled (a client asked while it ran), -1 fenced."""
        spec = lease.spec
        delay = backoff_delay(
            spec.attempt, self.settings.backoff_base_s, self.settings.backoff_max_s, self._rng
        )
        # the machine decides on what the lease knows (this is delivery attempt + 1); whether a
        # client asked to cancel meanwhile, bury.lua and requeue.lua read under the fence
        held = machine.JobState(
            status=JobStatus.RUNNING, deliveries=spec.attempt + 1, holder=lease.consumer
        )
        forced = reason if force_dead else None
        step = machine.fail(held, lease.consumer, error, self.clock(), self.rules, delay, forced)
        if not isinstance(step, machine.Step):  # (its holder fails it: never refused)
            return -1
        if step.ended:  # dead-lettered
            [code] = await self.ledger.bury([(lease, step)], cancel_wins=not force_dead)
            await self.lanes.let_go([lease])
            return {1: 0, 2: 2}.get(code, -1)
        msg, delay = await self.lanes.publish_after(spec, delay)
        [code] = await self.ledger.requeue([(lease, msg)], error=error, due_at=self.clock() + delay)
        await self.lanes.let_go([lease])
        return {1: 1, 2: 2}.get(code, -1)

    async def release(self, leases: Sequence[Lease]) -> int:
        """Hand jobs back (drain): a new message each, then the records point at it, uncharged."""
        return sum(1 for code in await self._hand_back(leases, -1) if code)

    async def preempt(self, leases: Sequence[Lease]) -> list[Preempted]:
        """`release`, counted and bounded (requeue.lua). The new message goes to the back of
        its lane's queue (RabbitMQ has no insert at the head): a preempted job runs after the
        jobs already waiting in its lane. One refused keeps its lease and its delivery."""
        codes = await self._hand_back(leases, self.settings.max_preemptions)
        return await self.table.preempted(leases, codes)

    async def _hand_back(self, leases: Sequence[Lease], max_preemptions: int) -> list[int]:
        if not leases:
            return []
        moved = await self.lanes.republish(leases)
        codes = await self.ledger.requeue(moved, uncharge=True, max_preemptions=max_preemptions)
        # a refused preemption (3) keeps its delivery: the holder runs the job on
        await self.lanes.let_go([lease for lease, c in zip(leases, codes, strict=True) if c != 3])
        return codes

    async def reap(self, model: str, expired: bool = True) -> ReapReport:
        """Leases whose holder's liveness lapsed and, with `expired`, those past their
        deadline: dead-letter those at the delivery limit, requeue the rest under new
        messages; then move what RabbitMQ dead-lettered into the stream. (A holder whose
        connection closed lost its messages already: RabbitMQ delivers them again and
        take.lua hands them on.)"""
        await self.lanes.declare(model)
        now = self.clock()
        rows = await self.ledger.expired(model, expired, now, REAP_BATCH)
        found = await self.records([as_text(row[0]) for row in rows])
        dying: list[tuple[Lease, machine.Step]] = []
        again: list[Lease] = []
        lapsed: set[str] = set()  # job ids whose holder lapsed: their deadline need not be past
        for (_, consumer, token, deliveries, gone), rec in zip(rows, found, strict=True):
            if rec is None:
                continue
            lease = Lease(spec=rec.spec, entry_id=as_text(token), consumer=as_text(consumer))
            # expired.lua found its lease past or its holder gone: the machine says what next
            held = machine.JobState(
                status=JobStatus.RUNNING, deliveries=int(deliveries), holder=lease.consumer
            )
            step = machine.lapse(held, now, self.rules, holder_alive=False)
            if isinstance(step, machine.Step) and step.ended:
                dying.append((lease, step))
            else:
                again.append(lease)
            if int(gone):
                lapsed.add(rec.spec.id)
        dead_ids: list[str] = []
        if dying:
            codes = await self.ledger.bury(dying, cancel_wins=True)
            dead_ids = [lease.spec.id for (lease, _), c in zip(dying, codes, strict=True) if c == 1]
        requeued: list[str] = []
        for group, by in (
            ([x for x in again if x.spec.id not in lapsed], now),
            ([x for x in again if x.spec.id in lapsed], 0.0),
        ):
            if group:
                codes = await self.ledger.requeue(await self.lanes.republish(group), expired_by=by)
                requeued += [lease.spec.id for lease, c in zip(group, codes, strict=True) if c == 1]
        if expired:
            dead_ids += await self._drain_dead(model)
            await self._publish_orphans(model)
        return ReapReport(requeued=requeued, dead=dead_ids)

    async def _publish_orphans(self, model: str) -> None:
        """Publish the jobs whose producers died between their records and their messages
        and that no resend finished (unpublished.lua): queued, they would wait unrun for good,
        counted in the lane's depth and oldest age."""
        before = self.clock() - ORPHAN_AFTER_S
        found = await self.ledger.unpublished(model, before, REAP_BATCH, new_msg() + ".")
        if not found:
            return
        sent = await asyncio.gather(
            *(self.lanes.publish(spec, job_id, msg) for job_id, spec, msg in found),
            return_exceptions=True,
        )
        # one refused (its lane full) or lost stays in the set, for the next reap
        done = [row for row, outcome in zip(found, sent, strict=True) if outcome is None]
        if done:
            await self.ledger.published([spec for _, spec, _ in done], [j for j, _, _ in done])
        log.warning(
            "published %d of %d job(s) of %s whose producer died before their message",
            len(done),
            len(found),
            model,
        )

    async def _drain_dead(self, model: str) -> list[str]:
        """Messages RabbitMQ dead-lettered (returned past `x-delivery-limit`): the jobs they
        still speak for are dead letters, with RabbitMQ's reason. One records read and one
        script for the lot."""
        messages = await self.lanes.dead(model, REAP_BATCH)
        if not messages:
            return []
        found = await self.records([m.body.decode() for m in messages])
        dying = []
        for message, rec in zip(messages, found, strict=True):
            if rec is not None:
                why = str((message.headers or {}).get("x-first-death-reason", "delivery_limit"))
                error = f"RabbitMQ dead-lettered its message ({why})"
                dying.append((rec.spec, message.message_id or "", why, error))
        # buried before the acks: a crash between leaves them to drain again
        buried = await self.ledger.bury_messages(model, dying)
        await self.lanes.ack_dead(messages)
        await self.table.settle(buried)
        return [spec.id for spec, _ in buried]

    # -- cancellation ----------------------------------------------------------------------
    async def cancel(self, job_id: str) -> CancelOutcome:
        return await self._unwait(job_id, await self.table.cancel(job_id))

    async def leave(self, job_id: str, followers: int = 1) -> CancelOutcome:
        return await self._unwait(job_id, await self.table.leave(job_id, followers))

    async def _unwait(self, job_id: str, outcome: CancelOutcome) -> CancelOutcome:
        if outcome is CancelOutcome.CANCELLED:
            await self.ledger.unwait(job_id)
        return outcome


def _unkeyed(spec: JobSpec, holder: str) -> bool:
    """Whether an enqueue publishes the job while its record is admitted: no idempotency or
    collapse key (admit.lua could make it another job's) and held for no worker."""
    return not spec.idempotency_key and not spec.collapse_key and not holder


def _batch(got: Sequence[Delivery]) -> int:
    return sum(1 for d in got if d.lane.priority is Priority.BATCH)


def _id(result: EnqueueResult | None) -> str:
    """The job id of an admitted job's result (an enqueue publishes only those)."""
    assert result is not None
    return result.job_id
