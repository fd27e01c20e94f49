"""The Redis queue core: one stream per lane, one consumer group, a Lua script per state change.

Its terminal paths (complete, dead letter, reap, cancel, expired at claim) settle the job's
quota and write its audit entry in the round trip of the state change, with the calls and
commands the quota and audit tables hand it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from tokenyard.broker import audit
from tokenyard.broker.core import (
    Claim,
    EnqueueResult,
    Lease,
    Preempted,
    ReapReport,
    admitted,
)
from tokenyard.broker.lanes import LanesOnTable
from tokenyard.broker.machine import lapsed_error
from tokenyard.broker.outcomes import cancelled_result, dead_result, expired_result
from tokenyard.broker.policy import (
    backoff_delay,
    fair_cost,
    staging_score,
    stamp_by_model,
)
from tokenyard.broker.redis import scripts
from tokenyard.broker.redis.connection import (
    MAX_BLOCK_S,
    SOCKET_TIMEOUT_S,
    ms,
    text,
    xread_command,
)
from tokenyard.broker.redis.counts import StreamCounts
from tokenyard.broker.redis.keys import GROUP
from tokenyard.broker.redis.scripts import Call, Empty
from tokenyard.broker.redis.table import ValkeyJobTable, completion_args
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


class _WaitHint(NamedTuple):
    """What an empty claim left for the next blocking wait: the lanes' newest ids, in claim
    order, and when the first retry is due (0.0 if none)."""

    lanes: list[str]
    last_ids: list[str]
    next_due: float
    batch_room: int | None  # the cap it was taken under: a wider one reads the backlog first
    # the ids of the streams that claim read to their end (the wake stream's too): the next
    # claim skips those with nothing after them (claim.lua's `after`)
    after: dict[str, str]


def _claim_reply(
    reply: list[Any],
) -> tuple[list[Any], list[Any], Any, Any, list[Any], list[Any]]:
    """claim.lua's flat reply as (claimed rows, last_ids, next_due, wake_id, expired specs,
    drained flags): the three counts, then six values per claimed job, the ids, as many flags,
    next_due, wake_id, the specs."""
    n_claimed, n_ids, n_expired = (int(n) for n in reply[:3])
    at = 3 + 6 * n_claimed
    claimed = [reply[i : i + 6] for i in range(3, at, 6)]
    last_ids, drained = reply[at : at + n_ids], reply[at + n_ids : at + 2 * n_ids]
    at += 2 * n_ids
    next_due, wake_id = reply[at], reply[at + 1]
    return claimed, last_ids, next_due, wake_id, reply[at + 2 : at + 2 + n_expired], drained


class RedisQueue(LanesOnTable):
    """Lanes on Redis Streams over the Valkey job table; Redis >= 6.2 and Valkey >= 7.2."""

    table: ValkeyJobTable

    def __init__(self, table: ValkeyJobTable, rng: random.Random | None = None) -> None:
        super().__init__(table, rng)
        self.conn = table.conn
        self.keys = table.keys
        self._hints: dict[str, _WaitHint] = {}
        self.counts = StreamCounts(table)

    # -- producing -------------------------------------------------------------------------
    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[EnqueueResult]:
        """All-or-nothing per model (core.Producer.enqueue_many): one script call admits a
        model's whole batch."""
        now = self.clock()
        by_model = stamp_by_model(specs, now, self.settings.pool_bounds)
        calls = [
            self._enqueue_call([specs[i] for i in indexes], now) for indexes in by_model.values()
        ]
        receipts = [audit.received(spec, now) for spec in specs]
        replies, ids = await self.table.eval_audited(calls, receipts)
        await self.table.note_models(by_model)
        results: list[EnqueueResult | None] = [None] * len(specs)
        full: QueueFull | None = None
        for indexes, reply in zip(by_model.values(), replies, strict=True):
            if reply[0] == -1:  # none of this model's jobs was added; the other models' stand
                full = full or self.table.lane_full(specs, indexes, reply[1:])
                continue
            # enqueue.lua's reply is flat: three values per item after the code
            for k, i in enumerate(indexes):
                created, job_id, joined = reply[1 + 3 * k : 4 + 3 * k]
                results[i] = EnqueueResult(
                    job_id=text(job_id), created=created == 1, collapsed=joined == 1
                )
        await self.table.audit.take_back(
            [ids[i] for i, r in enumerate(results) if r is None or not r.created]
        )
        return admitted(results, full)

    def _enqueue_call(self, specs: Sequence[JobSpec], now: float) -> Call:
        items = []
        for spec in specs:
            job, idem, inflight = self.table.admission_keys(spec)
            lane = self.keys.lane(spec.model, spec.priority, spec.pool)
            items.append(
                (
                    scripts.EnqueueItemKeys(
                        lane=lane,
                        job=job,
                        idem=idem,
                        inflight=inflight,
                    ),
                    scripts.EnqueueItemArgs(
                        *self.table.admission(spec),
                        tenant=spec.tenant,
                        weight=repr(spec.weight),
                        cost=fair_cost(spec),
                        score=repr(staging_score(spec)),
                        prefix=spec.prefix_key,
                    ),
                )
            )
        return scripts.ENQUEUE.call(
            scripts.EnqueueKeys(workers=self.keys.workers(specs[0].model)),
            scripts.EnqueueArgs(
                now=repr(now),
                max_depth=self.settings.max_queue_depth,
                idem_ttl_ms=ms(self.settings.idempotency_ttl_s),
                window=max(1, self.settings.fair_window),
                job_prefix=self.keys.job_prefix(specs[0].model),
                pfx_prefix=self.keys.prefix_owner_prefix(specs[0].model),
                wake_prefix=self.keys.wake_prefix(specs[0].model),
                max_held=self.settings.affinity_max_held,
                collapse_grace_s=repr(self.settings.collapse_grace_s),
            ),
            items,
        )

    # -- consuming -------------------------------------------------------------------------
    async def _claim(self, ask: Claim) -> list[Lease]:
        """One round trip in the common case: while the lanes have more than `slots` jobs, the
        claim script alone; once a claim drains them, the next one blocks on XREAD after the
        lanes' newest ids and runs the claim script in the same pipeline, so the server claims
        the moment the wake-up arrives."""
        model, consumer, slots, block_s, pools, batch_room = ask
        # per priority, the pools in the caller's order: strict priority holds across pools
        lanes = [[self.keys.lane(model, p, pool) for pool in pools] for p in Priority]
        capped = {self.keys.lane(model, Priority.BATCH, pool) for pool in pools}
        give_up_at = time.monotonic() + block_s
        # an empty claim of the last call left the lanes' newest ids: wait on them right away
        hint = self._hints.pop(model, None) if block_s > 0 else None
        if hint is not None and hint.batch_room != batch_room:
            hint = None  # taken under another cap: the batch lane may hold work it may now take
        while True:
            order = self._next_order(model, len(lanes))
            ordered = [lane for i in order for lane in lanes[i]]
            now = self.clock()
            wake = self.keys.wake(model, consumer)
            # only behind the blocking read: the hint is this worker's own last claim's
            after = {} if hint is None else hint.after
            call = scripts.CLAIM.call(
                scripts.ClaimKeys(
                    delayed=self.keys.delayed(model),
                    counters=self.keys.counters(model),
                    wake=wake,
                    workers=self.keys.workers(model),
                ),
                scripts.ClaimArgs(
                    group=GROUP,
                    consumer=consumer,
                    slots=slots,
                    now=repr(now),
                    # behind a blocking read our clock is stale by the wait: the server's stands
                    # in (brokers and workers are expected to keep NTP time, as deadlines are
                    # compared across hosts anyway)
                    server_now="0" if hint is None else "1",
                    job_prefix=self.keys.job_prefix(model),
                    event_prefix=self.keys.events_prefix(model),
                    expired_event=self.table.expired,
                    ttl_ms=self.table.ttl_ms,
                    wait_hints="1" if block_s > 0 else "0",
                    window=max(1, self.settings.fair_window),
                    capped_room=-1 if batch_room is None else max(0, batch_room),
                    pfx_prefix=self.keys.prefix_owner_prefix(model),
                    pfx_ttl_ms=ms(self.settings.affinity_ttl_s),
                    aff_wait=repr(self.settings.affinity_wait_s),
                    wake_after=after.get(wake, ""),
                ),
                [
                    (
                        scripts.LaneKey(lane=lane),
                        scripts.ClaimLaneArgs(
                            capped="1" if lane in capped else "0", after=after.get(lane, "")
                        ),
                    )
                    for lane in ordered
                ],
            )
            if hint is None:
                reply = await self.conn.run(call)
            else:
                wait = give_up_at - time.monotonic()
                if hint.next_due:
                    wait = min(wait, max(0.001, hint.next_due - now))
                reply = await self._wake_then_claim(hint, max(wait, 0.001), call)
            claimed, last_ids, next_due, wake_id, expired, drained = _claim_reply(reply)
            if expired:  # rare: their end goes to the audit trail (and settles any quota)
                ended = expired_result()
                await self.table.settle([(decode(spec, JobSpec), ended) for spec in expired])
            hint = None
            if last_ids:  # the lanes are drained: the next wait can start from here
                due = float(next_due) if next_due else 0.0
                # this worker's wake stream too: a job held for it (prefix affinity) lands there
                ids = [*(text(i) for i in last_ids), text(wake_id)]
                streams = [*ordered, wake]
                read_out = [*(flag == 1 for flag in drained), True]
                hint = _WaitHint(
                    streams,
                    ids,
                    due,
                    batch_room,
                    {s: i for s, i, out in zip(streams, ids, read_out, strict=True) if out},
                )
            if claimed or time.monotonic() >= give_up_at:
                if hint is not None:
                    self._hints[model] = hint
                return [self._lease(consumer, row) for row in claimed]

    async def _wake_then_claim(self, hint: _WaitHint, wait_s: float, call: Call) -> Any:
        """XREAD BLOCK on the lanes, then the claim script, pipelined: the server runs the
        script as soon as the read returns (new work, or the wait is over)."""
        block_s = min(wait_s, MAX_BLOCK_S)
        xread = xread_command(dict(zip(hint.lanes, hint.last_ids, strict=True)), 1, block_s)
        woke, reply = await self.conn.pipelined(
            [xread, self.conn.evalsha(call)], timeout_s=block_s + SOCKET_TIMEOUT_S
        )
        if isinstance(woke, Exception):
            raise woke
        return (await self.conn.results_of([call], [reply]))[0]

    def _lease(self, consumer: str, row: list[Any]) -> Lease:
        entry_id, spec_bytes, attempt, resumable, affinity, preemptions = row
        spec = decode(spec_bytes, JobSpec)
        spec.attempt = int(attempt)
        return Lease(
            spec=spec,
            entry_id=text(entry_id),
            consumer=consumer,
            resumable=resumable == 1,
            affinity=affinity == 1,
            preemptions=int(preemptions),
        )

    def _home(self, lease: Lease) -> str:
        return self.keys.lane(lease.spec.model, lease.spec.priority, lease.spec.pool)

    def _lane(self, lease: Lease) -> str:
        """The stream holding the lease's entry: its lane, or that lane's affinity stream."""
        home = self._home(lease)
        return self.keys.affinity_stream(home) if lease.affinity else home

    async def renew(self, leases: Sequence[Lease]) -> list[bool]:
        def call(batch: list[int]) -> Call:
            return scripts.RENEW.call(
                Empty(),
                scripts.GroupArg(group=GROUP),
                [
                    (
                        scripts.LaneKey(lane=self._lane(leases[i])),
                        scripts.HolderArgs(
                            consumer=leases[i].consumer, entry_id=leases[i].entry_id
                        ),
                    )
                    for i in batch
                ],
            )

        return await self.table.flags_per_model([lease.spec.model for lease in leases], call)

    async def complete_many(
        self,
        items: Sequence[tuple[Lease, JobResult]],
        tails: Sequence[TokenChunk | None] | None = None,
    ) -> list[bool]:
        return await self.table.complete_many(items, tails, self._complete_call)

    def _complete_call(
        self, model: str, batch: Sequence[tuple[Lease, JobResult, TokenChunk | None]], now: str
    ) -> Call:
        """The fenced completion of one model's jobs (complete.lua)."""
        return scripts.COMPLETE.call(
            self.table.completion_keys(model),
            scripts.CompleteArgs(group=GROUP, now=now, ttl_ms=self.table.ttl_ms),
            [
                (
                    scripts.CompleteItemKeys(
                        lane=self._lane(lease),
                        job=self.keys.job(lease.spec.id),
                        events=self.keys.events(lease.spec.id),
                    ),
                    completion_args(lease, result, tail),
                )
                for lease, result, tail in batch
            ],
        )

    async def _fail(self, lease: Lease, error: str, reason: str, force_dead: bool) -> int:
        now = self.clock()
        model = lease.spec.model
        delay = backoff_delay(
            lease.spec.attempt, self.settings.backoff_base_s, self.settings.backoff_max_s, self._rng
        )
        dead = dead_result(f"{reason}: {error}")
        call = scripts.FAIL.call(
            scripts.FailKeys(
                lane=self._lane(lease),
                job=self.keys.job(lease.spec.id),
                events=self.keys.events(lease.spec.id),
                cancels=self.keys.cancels(model),
                counters=self.keys.counters(model),
                delayed=self.keys.delayed(model),
                dlq=self.keys.dead_letters(model),
            ),
            scripts.FailArgs(
                group=GROUP,
                consumer=lease.consumer,
                entry_id=lease.entry_id,
                job_id=lease.spec.id,
                error=error,
                now=repr(now),
                due_at=repr(now + delay),
                max_deliveries=self.settings.max_deliveries,
                finished=encode(Finished(result=dead)),
                ttl_ms=self.table.ttl_ms,
                reason=reason,
                force_dead="1" if force_dead else "0",
                priority=lease.spec.priority.name,
                cancelled=self.table.cancelled_event,
            ),
        )
        outcome = int(await self.conn.run(call))
        if outcome in (0, 2):  # dead or cancelled: its reservation is refunded, its end audited
            ended = dead if outcome == 0 else cancelled_result()
            await self.table.settle([(lease.spec, ended)])
        return outcome

    async def release(self, leases: Sequence[Lease]) -> int:
        codes = await self._release(leases, -1)
        return sum(1 for code in codes if code)

    async def preempt(self, leases: Sequence[Lease]) -> list[Preempted]:
        codes = await self._release(leases, self.settings.max_preemptions)
        return await self.table.preempted(leases, codes)

    async def _release(self, leases: Sequence[Lease], max_preemptions: int) -> list[int]:
        """release.lua's codes: 1 released, 2 cancelled, 3 preempted too often, 0 lost."""
        now = repr(self.clock())

        def call(batch: list[int]) -> Call:
            return scripts.RELEASE.call(
                scripts.ReleaseKeys(cancels=self.keys.cancels(leases[batch[0]].spec.model)),
                scripts.ReleaseArgs(
                    group=GROUP,
                    now=now,
                    ttl_ms=self.table.ttl_ms,
                    cancelled=self.table.cancelled_event,
                    max_preemptions=max_preemptions,
                ),
                [
                    (
                        scripts.ReleaseItemKeys(
                            lane=self._lane(leases[i]),
                            job=self.keys.job(leases[i].spec.id),
                            home=self._home(leases[i]),
                            events=self.keys.events(leases[i].spec.id),
                        ),
                        scripts.ReleaseItemArgs(
                            consumer=leases[i].consumer,
                            entry_id=leases[i].entry_id,
                            job_id=leases[i].spec.id,
                        ),
                    )
                    for i in batch
                ],
            )

        codes = await self.table.codes_per_model([lease.spec.model for lease in leases], call)
        # a job a client asked to cancel ended instead: refunded, its end audited
        ended = zip(leases, codes, strict=True)
        await self.table.settle([(lease.spec, cancelled_result()) for lease, c in ended if c == 2])
        return codes

    async def reap(self, model: str, expired: bool = True) -> ReapReport:
        error = lapsed_error(self.settings.max_deliveries)
        call = scripts.REAP.call(
            scripts.ReapKeys(
                dlq=self.keys.dead_letters(model),
                counters=self.keys.counters(model),
                live=self.keys.live(model),
                cancels=self.keys.cancels(model),
            ),
            scripts.ReapArgs(
                group=GROUP,
                reaper="reaper",
                min_idle_ms=ms(self.settings.lease_s),
                max_entries=1000,
                max_deliveries=self.settings.max_deliveries,
                now=repr(self.clock()),
                job_prefix=self.keys.job_prefix(model),
                event_prefix=self.keys.events_prefix(model),
                finished=encode(Finished(result=dead_result(error))),
                dead_error=error,
                cancelled=self.table.cancelled_event,
                ttl_ms=self.table.ttl_ms,
                expired="1" if expired else "0",
            ),
            [
                (scripts.ReapItemKeys(lane=stream, home=lane), scripts.ReapItemArgs(p.name))
                for p in Priority
                for pool in range(self.settings.pool_count)
                for lane in [self.keys.lane(model, p, pool)]
                # a lane's affinity stream holds leases too (prefix affinity)
                for stream in (lane, self.keys.affinity_stream(lane))
            ],
        )
        requeued, dead, cancelled = await self.conn.run(call)
        report = ReapReport(requeued=[text(j) for j in requeued], dead=[text(j) for j in dead])
        await self.table.settle_ids([*report.dead, *(text(j) for j in cancelled)])
        return report

    # -- events and records ----------------------------------------------------------------
    async def append_events(self, events: Sequence[tuple[Lease, JobEvent]]) -> list[bool]:
        def call(batch: list[tuple[Lease, JobEvent]]) -> Call:
            return scripts.EMIT.call(
                Empty(),
                scripts.GroupArg(group=GROUP),
                [
                    (
                        scripts.EmitItemKeys(
                            lane=self._lane(x), events=self.keys.events(x.spec.id)
                        ),
                        scripts.EmitItemArgs(
                            consumer=x.consumer, entry_id=x.entry_id, event=encode(event)
                        ),
                    )
                    for x, event in batch
                ],
            )

        return await self.table.emit_per_model(events, call)
