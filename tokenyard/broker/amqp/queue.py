"""The queue core on RabbitMQ lanes, with its records, leases and events in the Redis tables.

RabbitMQ holds the lanes: a quorum queue per (model, priority, pool) bounded with
`x-max-length` + `reject-publish` (a full lane is a 429), `x-delivery-limit` and a dead-letter
queue per model for a message whose holders keep dying. A worker's blocking claim consumes each
lane with prefetch = its capacity: what it runs stays unacked, so RabbitMQ pushes it at most its
free slots (back-pressure); a claim takes what was pushed in claim order, and basic.get (one
Raft command per message on a quorum queue) tops up only a claim that may not wait or a lane
whose prefetch is full. Everything else is the Redis backend's, by the same scripts' rules: the
record (one hash), events (one stream per job), cancellation, quotas and audit in the same round
trip as each state change.

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
import secrets
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

from aio_pika.abc import AbstractIncomingMessage

from tokenyard.broker import audit
from tokenyard.broker.amqp import scripts
from tokenyard.broker.amqp.connection import AmqpConnection, Arguments, Refused
from tokenyard.broker.amqp.names import Names
from tokenyard.broker.core import (
    BrokerStats,
    CancelOutcome,
    EnqueueResult,
    LaneBacklog,
    LaneStats,
    Lease,
    ReapReport,
)
from tokenyard.broker.lanes import LanesOnTable
from tokenyard.broker.machine import lapsed_error
from tokenyard.broker.outcomes import cancelled_result, dead_result, expired_result
from tokenyard.broker.policy import backoff_delay, claim_order, stamp_by_model
from tokenyard.broker.redis.connection import ms
from tokenyard.broker.redis.connection import text as as_text
from tokenyard.broker.redis.scripts import Call, Empty
from tokenyard.broker.redis.table import ValkeyJobTable
from tokenyard.errors import QueueFull
from tokenyard.messages import (
    Finished,
    JobEvent,
    JobResult,
    JobSpec,
    Priority,
    TokenChunk,
    decode,
    encode,
)

# A retry waits in the delay queue whose TTL is the first of these at or above its backoff
# (rounded up: never sooner than the backoff asks); each lane has one queue per delay used.
DELAYS_MS = (50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 30_000, 60_000, 120_000)
# A blocked claim looks at the lanes at least this often: a lane whose whole prefetch this
# process holds gets no pushes, so its new messages are found by basic.get only.
WAKE_CAP_S = 1.0
REAP_BATCH = 200  # leases looked at per lane and reap; dead letters drained per reap
DELIVERY_LIMIT_FACTOR = 4  # RabbitMQ's delivery limit, over tokenyard's (see _lane_args)
# A resend republishes a job still queued and unpublished only once it is this old: its first
# producer may still be publishing it
RESEND_AFTER_S = 2.0


_PRIORITIES = list(Priority)  # claim_order's lane indexes, highest priority first


def _delay_ms(delay_s: float) -> int:
    wanted = delay_s * 1000
    return next((d for d in DELAYS_MS if d >= wanted), DELAYS_MS[-1])


def _room(lane: _Lane, left: int, batch_left: int) -> int:
    """How many more a claim with `left` free slots takes from `lane` (the batch lane: capped)."""
    return min(left, batch_left) if lane.priority is Priority.BATCH else left


def _new_msg() -> str:
    return secrets.token_hex(8)


class _Lane:
    """A lane this process consumes: what RabbitMQ pushed that no claim took yet."""

    def __init__(self, name: str, priority: Priority, pool: int) -> None:
        self.name = name
        self.priority = priority
        self.pool = pool
        self.buffer: deque[AbstractIncomingMessage] = deque()
        self.unacked = 0  # pushed and not acked yet: the buffer, and the leases taken from it


class _Feed:
    """A model's lanes as this process consumes them, each with the same prefetch."""

    def __init__(self, prefetch: int) -> None:
        self.prefetch = prefetch
        self.lanes: dict[tuple[Priority, int], _Lane] = {}
        self.arrived = asyncio.Event()
        self.generation = -1  # the AMQP connection its consumers live on


class _Held(NamedTuple):
    """A delivery a lease of this process runs under, acked when the job is settled."""

    job_id: str
    msg: str
    message: AbstractIncomingMessage
    lane: _Lane | None  # the lane whose consumer it came from; None: basic.get


class AmqpQueue(LanesOnTable):
    """RabbitMQ lanes over the Valkey job table."""

    table: ValkeyJobTable

    def __init__(self, table: ValkeyJobTable, amqp: AmqpConnection, names: Names) -> None:
        super().__init__(table)
        self.conn = table.conn
        self.keys = table.keys
        self.amqp = amqp
        self.names = names
        self._held: dict[str, _Held] = {}  # lease token -> its delivery
        self._token_of: dict[str, str] = {}  # job id -> the token this process holds it under
        self._feeds: dict[str, _Feed] = {}  # model -> its lanes' consumers

    # -- lanes -----------------------------------------------------------------------------
    def _lane_key(self, model: str, priority: Priority, pool: int) -> str:
        """The Redis key the lane's bookkeeping hangs off (waiting and lease sets)."""
        return self.keys.lane(model, priority, pool)

    @property
    def delivery_limit(self) -> int:
        """RabbitMQ's `x-delivery-limit` on the lanes: a multiple of `max_deliveries`."""
        return DELIVERY_LIMIT_FACTOR * self.settings.max_deliveries

    def _lane_args(self, model: str) -> Arguments:
        return {
            "x-queue-type": "quorum",
            "x-max-length": self.settings.max_queue_depth,
            "x-overflow": "reject-publish",
            # RabbitMQ's own count of returns: past it the message goes to the model's dead
            # queue, which reap() drains into the dead-letter stream. It also counts what a
            # worker was pushed and gave back unrun (its connection closed), so it is a backstop
            # above tokenyard's own count of deliveries (take.lua), not the limit itself
            "x-delivery-limit": self.delivery_limit,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": self.names.dead(model),
            "x-dead-letter-strategy": "at-least-once",
        }

    async def _lanes(self, model: str) -> None:
        """Declare the model's lanes and dead queue, once per process."""
        dead = self.names.dead(model)
        if self.amqp.declared(dead):
            return
        await self.amqp.declare(dead, {"x-queue-type": "quorum"})
        args = self._lane_args(model)
        for priority in Priority:
            for pool in range(self.settings.pool_count):
                await self.amqp.declare(self.names.lane(model, priority, pool), args)

    async def _delay_queue(self, spec: JobSpec, delay_ms: int) -> str:
        lane = self.names.lane(spec.model, spec.priority, spec.pool)
        name = self.names.delay(lane, delay_ms)
        if not self.amqp.declared(name):
            await self.amqp.declare(
                name,
                {
                    "x-queue-type": "quorum",
                    "x-message-ttl": delay_ms,
                    "x-overflow": "reject-publish",
                    "x-dead-letter-exchange": "",
                    "x-dead-letter-routing-key": lane,
                    "x-dead-letter-strategy": "at-least-once",
                },
            )
        return name

    # -- producing -------------------------------------------------------------------------
    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[EnqueueResult]:
        """Records first (one script per model, with the receipts), then each new job's message,
        confirmed; a refused one withdraws the whole batch (QueueFull: nothing added)."""
        now = self.clock()
        by_model = stamp_by_model(specs, now, self.settings.pool_bounds)
        for model in by_model:
            await self._lanes(model)
        msgs = [_new_msg() for _ in specs]
        calls = []
        for model, indexes in by_model.items():
            items = []
            for i in indexes:
                spec = specs[i]
                items.append(
                    (
                        self._job_keys(spec),
                        scripts.AdmitItemArgs(
                            job_id=spec.id,
                            spec=encode(spec),
                            deadline="" if spec.deadline is None else repr(spec.deadline),
                            use_idem="1" if spec.idempotency_key else "0",
                            use_inflight="1" if spec.collapse_key else "0",
                            msg=msgs[i],
                            lane=self._lane_key(spec.model, spec.priority, spec.pool),
                        ),
                    )
                )
            calls.append(
                scripts.ADMIT.call(
                    Empty(),
                    scripts.AdmitArgs(
                        now=repr(now),
                        idem_ttl_ms=ms(self.settings.idempotency_ttl_s),
                        job_prefix=self.keys.job_prefix(model),
                        max_depth=self.settings.max_queue_depth,
                        resend_after_s=repr(RESEND_AFTER_S),
                        collapse_grace_s=repr(self.settings.collapse_grace_s),
                    ),
                    items,
                )
            )
        receipts = [audit.received(spec, now) for spec in specs]
        replies, ids = await self.table.eval_audited(calls, receipts)
        await self.table.note_models(by_model)
        results: list[EnqueueResult] = [EnqueueResult(job_id="", created=False)] * len(specs)
        publish: list[int] = []  # the new jobs, and resent ones whose message never went out
        full: QueueFull | None = None
        for indexes, (code, rows) in zip(by_model.values(), replies, strict=True):
            if code == -1:  # none of this model's jobs was added
                full = self.table.lane_full(specs, indexes, rows)
                continue
            for i, (created, job_id, joined, again) in zip(indexes, rows, strict=True):
                results[i] = EnqueueResult(
                    job_id=as_text(job_id), created=created == 1, collapsed=joined == 1
                )
                if again == 1:
                    publish.append(i)
        if full is not None:  # the other models' jobs are withdrawn: all or nothing
            await self._withdraw(specs, results, by_model, msgs)
            await self.table.audit.take_back(ids)
            raise full
        sent = await asyncio.gather(
            *(
                self.amqp.publish(
                    self.names.lane(specs[i].model, specs[i].priority, specs[i].pool),
                    results[i].job_id.encode(),
                    msgs[i],
                )
                for i in publish
            ),
            return_exceptions=True,
        )
        failed = [outcome for outcome in sent if isinstance(outcome, BaseException)]
        if failed:
            await self._withdraw(specs, results, by_model, msgs)
            await self.table.audit.take_back(ids)
            refused = next((f for f in failed if isinstance(f, Refused)), None)
            if refused is not None:
                raise QueueFull(
                    refused.queue, self.settings.max_queue_depth, self.settings.max_queue_depth
                )
            raise failed[0]
        await self.table.audit.take_back([ids[i] for i, r in enumerate(results) if not r.created])
        if publish:  # confirmed: a resend of these finds them published
            await self.conn.checked(
                [("HSET", self.keys.job(results[i].job_id), "pub", 1) for i in publish]
            )
        return results

    def _job_keys(self, spec: JobSpec) -> scripts.JobKeys:
        job, idem, inflight = self.table.admission_keys(spec)
        return scripts.JobKeys(job=job, idem=idem, inflight=inflight, waiting=self._sets(spec)[0])

    async def _withdraw(
        self,
        specs: Sequence[JobSpec],
        results: Sequence[EnqueueResult],
        by_model: dict[str, list[int]],
        msgs: Sequence[str],
    ) -> None:
        calls = [
            scripts.WITHDRAW.call(
                Empty(),
                scripts.JobPrefixArg(job_prefix=self.keys.job_prefix(model)),
                [
                    (
                        self._job_keys(specs[i]),
                        scripts.WithdrawItemArgs(
                            job_id=specs[i].id,
                            created="1" if results[i].created else "0",
                            joined=results[i].job_id if results[i].collapsed else "",
                            msg=msgs[i],
                        ),
                    )
                    for i in indexes
                ],
            )
            for model, indexes in by_model.items()
        ]
        await self.conn.eval_many(calls)

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
        """What RabbitMQ pushed to this process's lane consumers, in claim order (strict
        priority, anti-starvation rounds), at most `slots`; topped up with basic.get where a
        push cannot bring more now; else wait for a push up to `block_s`. Consumers are made by
        the first blocking claim (a worker's): a claim that may not wait, with none made, takes
        exactly what is ready by basic.get alone."""
        if slots <= 0:
            return []
        await self._lanes(model)
        feed = self._feeds.get(model)
        if block_s > 0 or feed is not None:
            feed = await self._feed(model, pools, slots)
        give_up_at = time.monotonic() + block_s
        while True:
            if feed is not None:
                feed.arrived.clear()  # before the buffers are read: a push after it wakes us
            order = claim_order(len(Priority), self._rounds[model], self.settings.starvation_every)
            self._rounds[model] += 1
            lanes = [
                feed.lanes[_PRIORITIES[p], pool]
                if feed is not None
                else _Lane(self.names.lane(model, _PRIORITIES[p], pool), _PRIORITIES[p], pool)
                for p in order
                for pool in pools
            ]
            batch_left = slots if batch_room is None else max(0, batch_room)
            got: list[tuple[_Lane, AbstractIncomingMessage, bool]] = []
            for lane in lanes:
                while lane.buffer and _room(lane, slots - len(got), batch_left) > 0:
                    got.append((lane, lane.buffer.popleft(), True))
                    if lane.priority is Priority.BATCH:
                        batch_left -= 1
            # basic.get (slow on quorum queues: one Raft command each) only where a push cannot
            # bring more now: a claim that may not wait, or a lane whose whole prefetch this
            # process holds
            for lane in lanes:
                room = _room(lane, slots - len(got), batch_left)
                full = feed is not None and lane.unacked >= feed.prefetch
                if room > 0 and (block_s <= 0 or full):
                    pulled = await self.amqp.get(lane.name, room)
                    got += [(lane, message, False) for message in pulled]
                    if lane.priority is Priority.BATCH:
                        batch_left -= len(pulled)
            if got:
                leases = await self._take(model, consumer, got)
                if leases:
                    return leases
                continue  # only stale copies: they are gone now, look again at once
            wait = give_up_at - time.monotonic()
            if wait <= 0 or feed is None:
                return []
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(feed.arrived.wait(), min(wait, WAKE_CAP_S))

    async def _feed(self, model: str, pools: Sequence[int], slots: int) -> _Feed:
        """The model's lane consumers (made by the first claim, prefetch = its slots: a
        worker's first claim asks for all of them); made again after a lost connection."""
        feed = self._feeds.get(model)
        if feed is not None and feed.lanes and not self.amqp.alive(feed.generation):
            feed = None  # its consumers died with their connection: RabbitMQ redelivers
        if feed is None:
            feed = self._feeds[model] = _Feed(max(1, slots))
        for priority in Priority:
            for pool in pools:
                if (priority, pool) in feed.lanes:
                    continue
                lane = _Lane(self.names.lane(model, priority, pool), priority, pool)

                def deliver(message: AbstractIncomingMessage, lane: _Lane = lane) -> None:
                    lane.buffer.append(message)
                    lane.unacked += 1
                    feed.arrived.set()

                feed.generation = await self.amqp.consume(lane.name, feed.prefetch, deliver)
                feed.lanes[priority, pool] = lane
        return feed

    async def _take(
        self,
        model: str,
        consumer: str,
        got: Sequence[tuple[_Lane, AbstractIncomingMessage, bool]],
    ) -> list[Lease]:
        """Lease what the records still name; ack what is stale, expired or dead."""
        now = self.clock()
        items, pending = [], []
        for source, message, pushed in got:
            job_id = message.body.decode()
            msg = message.message_id or ""
            via = source if pushed else None
            mine = self._token_of.get(job_id)
            if mine is not None and self._held[mine].msg == msg:
                # our own running job, redelivered after our channel dropped: run on under it
                self._held[mine] = _Held(job_id, msg, message, via)
                continue
            token = secrets.token_hex(8)
            lane = self._lane_key(model, source.priority, source.pool)
            pending.append((message, job_id, msg, token, via))
            items.append(
                (
                    scripts.LeaseItemKeys(
                        job=self.keys.job(job_id),
                        events=self.keys.events(job_id),
                        waiting=self.keys.waiting(lane),
                        leases=self.keys.leases(lane),
                    ),
                    scripts.TakeItemArgs(
                        job_id=job_id, msg=msg, token=token, priority=source.priority.name
                    ),
                )
            )
        if not items:
            return []
        dead_error = lapsed_error(self.settings.max_deliveries)
        call = scripts.TAKE.call(
            scripts.TakeKeys(
                counters=self.keys.counters(model),
                dlq=self.keys.dead_letters(model),
                delayed=self.keys.delayed(model),
                cancels=self.keys.cancels(model),
            ),
            scripts.TakeArgs(
                now=repr(now),
                consumer=consumer,
                lease_s=repr(self.settings.lease_s),
                max_deliveries=self.settings.max_deliveries,
                ttl_ms=self.table.ttl_ms,
                expired_event=self.table.expired,
                dead_event=encode(Finished(result=dead_result(dead_error))),
                dead_error=dead_error,
                cancelled=self.table.cancelled_event,
            ),
            items,
        )
        rows = await self.conn.run(call)
        leases: list[Lease] = []
        ended: list[tuple[JobSpec, JobResult | None]] = []
        for (message, job_id, msg, token, via), (code, spec_bytes, attempt, resumable) in zip(
            pending, rows, strict=True
        ):
            if code == 1:
                spec = decode(spec_bytes, JobSpec)
                spec.attempt = int(attempt)
                self._held[token] = _Held(job_id, msg, message, via)
                self._token_of[job_id] = token
                leases.append(
                    Lease(spec=spec, entry_id=token, consumer=consumer, resumable=resumable == 1)
                )
                continue
            await self._ack(message, via)
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
            for i, lane in enumerate(dict.fromkeys((src.priority, src.pool) for src, _, _ in got))
        }
        leases.sort(
            key=lambda lease: (
                rank[lease.spec.priority, lease.spec.pool],
                lease.spec.deadline is None,
                lease.spec.deadline or 0.0,
            )
        )
        return leases

    def _sets(self, spec: JobSpec) -> tuple[str, str]:
        """(waiting set, lease set) of the job's lane."""
        lane = self._lane_key(spec.model, spec.priority, spec.pool)
        return self.keys.waiting(lane), self.keys.leases(lane)

    def _lease_keys(self, lease: Lease) -> tuple[str, str]:
        """(job key, the lane's lease set) of a lease."""
        return self.keys.job(lease.spec.id), self._sets(lease.spec)[1]

    async def _let_go(self, leases: Sequence[Lease]) -> None:
        """Ack the deliveries these leases ran under: the job is settled (or the lease lost)."""
        acks = []
        for lease in leases:
            held = self._held.pop(lease.entry_id, None)
            if held is None:
                continue
            if self._token_of.get(held.job_id) == lease.entry_id:
                del self._token_of[held.job_id]
            acks.append(self._ack(held.message, held.lane))
        await asyncio.gather(*acks)

    async def _ack(self, message: AbstractIncomingMessage, lane: _Lane | None) -> None:
        """Ack a delivery; one its lane's consumer got frees a place in that prefetch."""
        if lane is not None:
            lane.unacked -= 1
        await self.amqp.ack(message)

    # -- settling --------------------------------------------------------------------------
    async def renew(self, leases: Sequence[Lease]) -> list[bool]:
        deadline = repr(self.clock() + self.settings.lease_s)

        def call(batch: list[int]) -> Call:
            items = []
            for i in batch:
                job, lease_set = self._lease_keys(leases[i])
                items.append(
                    (
                        scripts.RenewItemKeys(job=job, leases=lease_set),
                        scripts.HolderItemArgs(
                            consumer=leases[i].consumer,
                            token=leases[i].entry_id,
                            job_id=leases[i].spec.id,
                        ),
                    )
                )
            return scripts.RENEW.call(Empty(), scripts.DeadlineArg(deadline=deadline), items)

        return await self.table.flags_per_model([lease.spec.model for lease in leases], call)

    async def append_events(self, events: Sequence[tuple[Lease, JobEvent]]) -> list[bool]:
        def call(batch: list[int]) -> Call:
            items = []
            for i in batch:
                lease, event = events[i]
                items.append(
                    (
                        scripts.EventKeys(
                            job=self.keys.job(lease.spec.id), events=self.keys.events(lease.spec.id)
                        ),
                        scripts.EmitItemArgs(
                            consumer=lease.consumer, token=lease.entry_id, event=encode(event)
                        ),
                    )
                )
            return scripts.EMIT.call(Empty(), Empty(), items)

        return await self.table.flags_per_model([lease.spec.model for lease, _ in events], call)

    def _complete_call(
        self, model: str, batch: Sequence[tuple[Lease, JobResult, TokenChunk | None]], now: str
    ) -> Call:
        """The completion of one model's jobs, fenced by their lease tokens."""
        items = []
        for lease, result, tail in batch:
            job, lease_set = self._lease_keys(lease)
            items.append(
                (
                    scripts.CompleteItemKeys(
                        job=job, events=self.keys.events(lease.spec.id), leases=lease_set
                    ),
                    scripts.CompleteItemArgs(
                        consumer=lease.consumer,
                        token=lease.entry_id,
                        job_id=lease.spec.id,
                        status=result.status.value,
                        finished=encode(Finished(result=result)),
                        tail=b"" if tail is None else encode(tail),
                    ),
                )
            )
        return scripts.COMPLETE.call(
            scripts.CompleteKeys(
                cancels=self.keys.cancels(model), counters=self.keys.counters(model)
            ),
            scripts.CompleteArgs(now=now, ttl_ms=self.table.ttl_ms),
            items,
        )

    async def complete_many(
        self,
        items: Sequence[tuple[Lease, JobResult]],
        tails: Sequence[TokenChunk | None] | None = None,
    ) -> list[bool]:
        # fenced or not, the delivery is done with: a fenced one's message is stale or gone
        return await self.table.complete_many(items, tails, self._complete_call, then=self._let_go)

    async def _fail(self, lease: Lease, error: str, reason: str, force_dead: bool) -> int:
        """1 retrying (after backoff, through a delay queue), 0 dead-lettered, 2 ended
        cancelled (a client asked while it ran), -1 fenced."""
        spec = lease.spec
        if force_dead or spec.attempt + 1 >= self.settings.max_deliveries:
            [code] = await self._bury([(lease, error)], reason, cancel_wins=not force_dead)
            await self._let_go([lease])
            return {1: 0, 2: 2}.get(code, -1)
        delay = backoff_delay(
            spec.attempt, self.settings.backoff_base_s, self.settings.backoff_max_s, self._rng
        )
        delay_ms = _delay_ms(delay)
        msg = _new_msg()
        await self.amqp.publish(await self._delay_queue(spec, delay_ms), spec.id.encode(), msg)
        [code] = await self._requeue(
            [(lease, msg)], error=error, due_at=self.clock() + delay_ms / 1000
        )
        await self._let_go([lease])
        return {1: 1, 2: 2}.get(code, -1)

    async def _bury(
        self, dying: Sequence[tuple[Lease, str]], reason: str, cancel_wins: bool = False
    ) -> list[int]:
        """Dead-letter jobs whose lease the caller holds, each with its error (with
        `cancel_wins`, one a client asked to cancel ends cancelled instead); settles those
        that ended. Per job 1 dead, 2 cancelled, 0 fenced."""
        if not dying:
            return []
        ends = [dead_result(f"{reason}: {error}") for _, error in dying]

        def call(batch: list[int]) -> Call:
            items = []
            for i in batch:
                lease, error = dying[i]
                items.append(
                    self._bury_item(
                        lease.spec, reason, error, ends[i], lease=lease, cancel_wins=cancel_wins
                    )
                )
            return scripts.BURY.call(
                self._bury_keys(dying[batch[0]][0].spec.model), self._times(), items
            )

        codes = [0] * len(dying)
        models = [lease.spec.model for lease, _ in dying]
        for batch, reply in await self.table.per_model(models, call):
            for i, code in zip(batch, reply, strict=True):
                codes[i] = int(code)
        await self.table.settle(
            [
                (lease.spec, end if code == 1 else cancelled_result())
                for (lease, _), end, code in zip(dying, ends, codes, strict=True)
                if code
            ]
        )
        return codes

    def _bury_item(
        self,
        spec: JobSpec,
        reason: str,
        error: str,
        end: JobResult,
        lease: Lease | None = None,
        msg: str = "",
        cancel_wins: bool = False,
    ) -> tuple[scripts.BuryItemKeys, scripts.BuryItemArgs]:
        """bury.lua's item for a job, fenced by the `lease` held or else by its message `msg`."""
        waiting, leases = self._sets(spec)
        return (
            scripts.BuryItemKeys(
                job=self.keys.job(spec.id),
                events=self.keys.events(spec.id),
                leases=leases,
                waiting=waiting,
            ),
            scripts.BuryItemArgs(
                job_id=spec.id,
                consumer="" if lease is None else lease.consumer,
                token="" if lease is None else lease.entry_id,
                msg=msg,
                reason=reason,
                error=error,
                finished=encode(Finished(result=end)),
                priority=spec.priority.name,
                cancelled=self.table.cancelled_event if cancel_wins else b"",
            ),
        )

    def _bury_keys(self, model: str) -> scripts.BuryKeys:
        return scripts.BuryKeys(
            dlq=self.keys.dead_letters(model),
            counters=self.keys.counters(model),
            cancels=self.keys.cancels(model),
            delayed=self.keys.delayed(model),
        )

    def _times(self) -> scripts.CompleteArgs:
        return scripts.CompleteArgs(now=repr(self.clock()), ttl_ms=self.table.ttl_ms)

    async def _requeue(
        self,
        moved: Sequence[tuple[Lease, str]],
        error: str = "",
        due_at: float = 0.0,
        uncharge: bool = False,
        expired_by: float = 0.0,
    ) -> list[int]:
        """Point held jobs' records at the new messages already published (see requeue.lua):
        per job 1 requeued, 2 ended cancelled (a client asked; settled here), 0 fenced."""
        if not moved:
            return []
        now = repr(self.clock())

        def call(batch: list[int]) -> Call:
            model = moved[batch[0]][0].spec.model
            items = []
            for i in batch:
                lease, msg = moved[i]
                spec = lease.spec
                job, lease_set = self._lease_keys(lease)
                items.append(
                    (
                        scripts.RequeueItemKeys(
                            job=job,
                            waiting=self._sets(spec)[0],
                            leases=lease_set,
                            events=self.keys.events(spec.id),
                        ),
                        scripts.RequeueItemArgs(
                            consumer=lease.consumer,
                            token=lease.entry_id,
                            job_id=spec.id,
                            msg=msg,
                            uncharge="1" if uncharge else "0",
                            error=error,
                            due_at=repr(due_at),
                        ),
                    )
                )
            return scripts.REQUEUE.call(
                scripts.RequeueKeys(
                    delayed=self.keys.delayed(model), cancels=self.keys.cancels(model)
                ),
                scripts.RequeueArgs(
                    now=now,
                    expired_by=repr(expired_by),
                    ttl_ms=self.table.ttl_ms,
                    cancelled=self.table.cancelled_event,
                ),
                items,
            )

        codes = [0] * len(moved)
        models = [lease.spec.model for lease, _ in moved]
        for batch, reply in await self.table.per_model(models, call):
            for i, code in zip(batch, reply, strict=True):
                codes[i] = int(code)
        await self.table.settle(
            [
                (lease.spec, cancelled_result())
                for (lease, _), code in zip(moved, codes, strict=True)
                if code == 2
            ]
        )
        return codes

    async def _republish(self, leases: Sequence[Lease]) -> list[tuple[Lease, str]]:
        """A new message on each lease's lane (confirmed), for a requeue to point the record at."""
        moved = [(lease, _new_msg()) for lease in leases]
        await asyncio.gather(
            *(
                self.amqp.publish(
                    self.names.lane(lease.spec.model, lease.spec.priority, lease.spec.pool),
                    lease.spec.id.encode(),
                    msg,
                )
                for lease, msg in moved
            )
        )
        return moved

    async def release(self, leases: Sequence[Lease]) -> int:
        """Hand jobs back (drain): a new message each, then the records point at it, uncharged."""
        if not leases:
            return 0
        codes = await self._requeue(await self._republish(leases), uncharge=True)
        await self._let_go(leases)
        return sum(1 for code in codes if code)

    async def reap(self, model: str, expired: bool = True) -> ReapReport:
        """Leases whose holder's liveness lapsed and, with `expired`, those past their
        deadline: dead-letter those at the delivery limit, requeue the rest under new
        messages; then move what RabbitMQ dead-lettered into the stream. (A holder whose
        connection closed lost its messages already: RabbitMQ delivers them again and
        take.lua hands them on.)"""
        await self._lanes(model)
        now = self.clock()
        lanes = [
            self._lane_key(model, p, pool)
            for p in Priority
            for pool in range(self.settings.pool_count)
        ]
        call = scripts.EXPIRED.call(
            scripts.LiveKey(live=self.keys.live(model)),
            scripts.ExpiredArgs(
                now=repr(now),
                max_entries=REAP_BATCH,
                job_prefix=self.keys.job_prefix(model),
                expired="1" if expired else "0",
            ),
            [(scripts.LeasesKey(leases=self.keys.leases(lane)), Empty()) for lane in lanes],
        )
        rows = [row for lane_rows in await self.conn.run(call) for row in lane_rows]
        found = await self.records([as_text(row[0]) for row in rows])
        at_limit: list[Lease] = []
        again: list[Lease] = []
        lapsed: set[str] = set()  # job ids whose holder lapsed: their deadline need not be past
        for (_, consumer, token, deliveries, gone), rec in zip(rows, found, strict=True):
            if rec is None:
                continue
            lease = Lease(spec=rec.spec, entry_id=as_text(token), consumer=as_text(consumer))
            (at_limit if int(deliveries) >= self.settings.max_deliveries else again).append(lease)
            if int(gone):
                lapsed.add(rec.spec.id)
        dead_ids: list[str] = []
        if at_limit:
            errors = [lapsed_error(x.spec.attempt + 1) for x in at_limit]
            dying = list(zip(at_limit, errors, strict=True))
            codes = await self._bury(dying, "lease_expired", cancel_wins=True)
            dead_ids = [lease.spec.id for lease, c in zip(at_limit, codes, strict=True) if c == 1]
        requeued: list[str] = []
        for group, by in (
            ([x for x in again if x.spec.id not in lapsed], now),
            ([x for x in again if x.spec.id in lapsed], 0.0),
        ):
            if group:
                codes = await self._requeue(await self._republish(group), expired_by=by)
                requeued += [lease.spec.id for lease, c in zip(group, codes, strict=True) if c == 1]
        if expired:
            dead_ids += await self._drain_dead(model)
        return ReapReport(requeued=requeued, dead=dead_ids)

    async def _drain_dead(self, model: str) -> list[str]:
        """Messages RabbitMQ dead-lettered (returned past `x-delivery-limit`): the jobs they
        still speak for are dead letters, with RabbitMQ's reason. One records read and one
        script for the lot."""
        messages = await self.amqp.get(self.names.dead(model), REAP_BATCH)
        if not messages:
            return []
        found = await self.records([m.body.decode() for m in messages])
        items, ended = [], []
        for message, rec in zip(messages, found, strict=True):
            if rec is not None:
                why = str((message.headers or {}).get("x-first-death-reason", "delivery_limit"))
                error = f"RabbitMQ dead-lettered its message ({why})"
                end = dead_result(f"{why}: {error}")
                items.append(
                    self._bury_item(rec.spec, why, error, end, msg=message.message_id or "")
                )
                ended.append((rec.spec, end))
        flags: list[int] = []
        if items:  # buried before the acks: a crash between leaves them to drain again
            flags = await self.conn.run(
                scripts.BURY.call(self._bury_keys(model), self._times(), items)
            )
        await asyncio.gather(*(self.amqp.ack(m) for m in messages))
        buried = [(spec, end) for (spec, end), ok in zip(ended, flags, strict=True) if ok]
        await self.table.settle(buried)
        return [spec.id for spec, _ in buried]

    # -- cancellation ----------------------------------------------------------------------
    async def cancel(self, job_id: str) -> CancelOutcome:
        return await self._unwait(job_id, await self.table.cancel(job_id))

    async def leave(self, job_id: str, followers: int = 1) -> CancelOutcome:
        return await self._unwait(job_id, await self.table.leave(job_id, followers))

    async def _unwait(self, job_id: str, outcome: CancelOutcome) -> CancelOutcome:
        if outcome is CancelOutcome.CANCELLED:
            # its message stays on the lane until a claim drops it; it no longer waits
            lane = await self.conn.one(("HGET", self.keys.job(job_id), "lane"))
            if lane:
                await self.conn.one(("ZREM", self.keys.waiting(as_text(lane)), job_id))
        return outcome

    # -- introspection ---------------------------------------------------------------------
    async def _lane_counts(self, model: str) -> tuple[list[str], list[Any]]:
        """Each lane's (waiting, oldest waiting, in flight), then delayed, dead, counters: one
        round trip to the tables."""
        lanes = self.keys.lanes(model, self.settings.pool_count)
        commands: list[tuple[Any, ...]] = []
        for lane in lanes:
            commands += [
                ("ZCARD", self.keys.waiting(lane)),
                ("ZRANGE", self.keys.waiting(lane), 0, 0, "WITHSCORES"),
                ("ZCARD", self.keys.leases(lane)),
            ]
        commands += [
            ("ZCARD", self.keys.delayed(model)),
            ("XLEN", self.keys.dead_letters(model)),
            ("HGETALL", self.keys.counters(model)),
        ]
        return lanes, await self.conn.checked(commands)

    async def stats(self, model: str) -> BrokerStats:
        now = self.clock()
        pools = self.settings.pool_count
        lanes, replies = await self._lane_counts(model)
        stats = []
        for p, priority in enumerate(Priority):
            waiting = in_flight = 0
            ages: list[float] = []
            for i in range(p * pools, (p + 1) * pools):
                count, oldest, running = replies[3 * i : 3 * i + 3]
                waiting += int(count)
                in_flight += int(running)
                if oldest:
                    first = oldest[0]
                    score = first[1] if isinstance(first, (list, tuple)) else oldest[1]
                    ages.append(max(0.0, now - float(score)))
            stats.append(
                LaneStats(
                    model,
                    priority,
                    waiting=waiting,
                    in_flight=in_flight,
                    oldest_waiting_age_s=max(ages) if ages else None,
                )
            )
        delayed, dead, counters = replies[3 * len(lanes) :]
        counters = (
            {as_text(k): v for k, v in (counters or {}).items()}
            if isinstance(counters, dict)
            else dict(zip(map(as_text, counters[::2]), counters[1::2], strict=True))
        )
        return BrokerStats(
            model=model,
            lanes=stats,
            delayed=int(delayed),
            dead_letters=int(dead),
            fenced_completions=int(counters.get("fenced", 0)),
            expired=int(counters.get("expired", 0)),
        )

    async def depth(self, model: str) -> int:
        commands: list[tuple[Any, ...]] = []
        for lane in self.keys.lanes(model, self.settings.pool_count):
            commands += [("ZCARD", self.keys.waiting(lane)), ("ZCARD", self.keys.leases(lane))]
        return sum(int(n or 0) for n in await self.conn.checked(commands))

    async def backlog(self, model: str) -> list[LaneBacklog]:
        """FIFO within a lane (no fair-share staging): every waiting job is queued."""
        pools = self.settings.pool_count
        _, replies = await self._lane_counts(model)
        out = []
        for p, priority in enumerate(Priority):
            mine = range(p * pools, (p + 1) * pools)
            out.append(
                LaneBacklog(
                    priority,
                    queued=sum(int(replies[3 * i]) for i in mine),
                    in_flight=sum(int(replies[3 * i + 2]) for i in mine),
                    tenants=[],
                )
            )
        return out
