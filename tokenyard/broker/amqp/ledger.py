"""What RabbitMQ lanes keep in the Valkey job table beside each record, and the scripts that
change it under their fences.

Per lane a waiting set and a lease set; a job's record names its one live message (`msg`) and,
while it runs, its lease token. Each change is one script of lua/ (declared in scripts.py)
fenced by those: `Ledger` builds each script's call from a job's keys, runs the ones that stand
alone, settles the jobs they end, and reads the lanes' counts from the sets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from tokenyard.broker import machine
from tokenyard.broker.amqp import scripts
from tokenyard.broker.core import (
    BrokerStats,
    EnqueueResult,
    LaneBacklog,
    LaneStats,
    LaneWaiting,
    Lease,
)
from tokenyard.broker.outcomes import cancelled_result, dead_result
from tokenyard.broker.redis.connection import ms, text
from tokenyard.broker.redis.scripts import Call, Empty
from tokenyard.broker.redis.table import OnTable, completion_args
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

E = TypeVar("E", machine.Bury, machine.Finish)


class Ledger(OnTable):
    """RabbitMQ lanes' bookkeeping in the Valkey job table."""

    # -- keys ------------------------------------------------------------------------------
    def lane_key(self, model: str, priority: Priority, pool: int) -> str:
        """The Redis key the lane's bookkeeping hangs off (waiting and lease sets)."""
        return self.keys.lane(model, priority, pool)

    def sets(self, spec: JobSpec) -> tuple[str, str]:
        """(waiting set, lease set) of the job's lane."""
        lane = self.lane_key(spec.model, spec.priority, spec.pool)
        return self.keys.waiting(lane), self.keys.leases(lane)

    def _item_keys(self, job_id: str, lane: str) -> scripts.LaneItemKeys:
        """An item's keys in take.lua, requeue.lua and bury.lua: the job's, and the sets of its
        lane (a `lane_key`)."""
        k = self.keys
        return scripts.LaneItemKeys(
            k.job(job_id), k.events(job_id), k.waiting(lane), k.leases(lane)
        )

    def _spec_item_keys(self, spec: JobSpec) -> scripts.LaneItemKeys:
        return self._item_keys(spec.id, self.lane_key(spec.model, spec.priority, spec.pool))

    def _lease_keys(self, lease: Lease) -> tuple[str, str]:
        """(job key, the lane's lease set) of a lease."""
        return self.keys.job(lease.spec.id), self.sets(lease.spec)[1]

    def _end_keys(self, model: str) -> scripts.EndKeys:
        k = self.keys
        return scripts.EndKeys(
            k.dead_letters(model), k.counters(model), k.cancels(model), k.delayed(model)
        )

    def _job_keys(self, spec: JobSpec) -> scripts.JobKeys:
        job, idem, inflight = self.table.admission_keys(spec)
        lane = self.lane_key(spec.model, spec.priority, spec.pool)
        return scripts.JobKeys(
            job=job,
            idem=idem,
            inflight=inflight,
            waiting=self.keys.waiting(lane),
            unpub=self.keys.unpublished(lane),
        )

    # -- admission -------------------------------------------------------------------------
    def admit(
        self,
        model: str,
        jobs: Sequence[tuple[JobSpec, str, str, bool]],
        now: float,
    ) -> Call:
        """One model's jobs, each with its message id, the worker it is held for ('' none:
        prefix affinity) and whether it is published after its record (admit.lua)."""
        items = []
        for spec, msg, pref, late in jobs:
            lane = self.lane_key(spec.model, spec.priority, spec.pool)
            items.append(
                (
                    self._job_keys(spec),
                    scripts.AdmitItemArgs(
                        *self.table.admission(spec),
                        msg=msg,
                        lane=lane,
                        prefix=spec.prefix_key or "",
                        pref=pref,
                        affw=self.keys.affinity_worker(lane, pref) if pref else "",
                        late="1" if late else "0",
                    ),
                )
            )
        return scripts.ADMIT.call(
            Empty(),
            scripts.AdmitArgs(
                now=repr(now),
                idem_ttl_ms=ms(self.settings.idempotency_ttl_s),
                job_prefix=self.keys.job_prefix(model),
                max_depth=self.settings.max_queue_depth,
                collapse_grace_s=repr(self.settings.collapse_grace_s),
            ),
            items,
        )

    async def withdraw(
        self,
        specs: Sequence[JobSpec],
        results: Sequence[EnqueueResult | None],
        by_model: dict[str, list[int]],
        msgs: Sequence[str],
        made_at: str = "",
    ) -> None:
        """Take back what an enqueue admitted of these models' jobs (withdraw.lua; a result
        None: the job was not admitted). `made_at`: the admit's `now`, where its answer was lost
        and `results` are guesses (withdraw.lua takes back only a record that admit made)."""
        calls = []
        for model, indexes in by_model.items():
            items = []
            for i in indexes:
                result = results[i]
                if result is None:
                    continue
                args = scripts.WithdrawItemArgs(
                    job_id=specs[i].id,
                    created="1" if result.created else "0",
                    joined=result.job_id if result.collapsed else "",
                    msg=msgs[i],
                    made_at=made_at,
                )
                items.append((self._job_keys(specs[i]), args))
            if items:
                head = scripts.WithdrawArgs(self.keys.job_prefix(model), self.table.ttl_ms)
                calls.append(scripts.WITHDRAW.call(Empty(), head, items))
        await self.conn.eval_many(calls)

    async def published(self, specs: Sequence[JobSpec], job_ids: Sequence[str]) -> None:
        """Mark jobs published after their records as confirmed (a resend or the reaper
        then leaves them be); `specs[i]` names job `job_ids[i]`'s lane."""
        commands: list[tuple[Any, ...]] = []
        for spec, job_id in zip(specs, job_ids, strict=True):
            lane = self.lane_key(spec.model, spec.priority, spec.pool)
            commands += [
                ("HSET", self.keys.job(job_id), "pub", 1),
                ("ZREM", self.keys.unpublished(lane), job_id),
            ]
        await self.conn.checked(commands)

    async def unpublished(
        self, model: str, before: float, most: int, msg_prefix: str
    ) -> list[tuple[str, JobSpec, str]]:
        """Jobs admitted before `before` to be published after their records and never
        confirmed (their producers died between the two), each pointed at a fresh message
        for the caller to publish (unpublished.lua): (job id, spec, message id)."""
        call = scripts.UNPUBLISHED.call(
            Empty(),
            scripts.UnpublishedArgs(
                before=repr(before),
                max_entries=most,
                job_prefix=self.keys.job_prefix(model),
                msg_prefix=msg_prefix,
            ),
            [
                (scripts.UnpublishedKey(unpub=self.keys.unpublished(lane)), Empty())
                for lane in self.keys.lanes(model, self.settings.pool_count)
            ],
        )
        rows = [row for lane_rows in await self.conn.run(call) for row in lane_rows]
        return [(text(job_id), decode(spec, JobSpec), text(msg)) for job_id, spec, msg in rows]

    async def gone(self, job_ids: Sequence[str]) -> None:
        """Tombstones for jobs an enqueue published but whose admission was refused: their
        messages are stale at once (take.lua), not held as met before their records."""
        ttl = self.table.ttl_ms
        await self.conn.checked([("SET", self.gone_key(i), 1, "PX", ttl) for i in job_ids])

    def gone_key(self, job_id: str) -> str:
        """A withdrawn job's tombstone (take.lua and withdraw.lua spell it `<job>:gone`)."""
        return self.keys.job(job_id) + ":gone"

    # -- leases ----------------------------------------------------------------------------
    def take_item(
        self, job_id: str, msg: str, token: str, lane: tuple[str, Priority, int]
    ) -> tuple[scripts.LaneItemKeys, scripts.TakeItemArgs]:
        """take.lua's item: job `job_id` by its message `msg` from `lane` (model, priority,
        pool), leased under `token`."""
        model, priority, pool = lane
        key = self.lane_key(model, priority, pool)
        return (
            self._item_keys(job_id, key),
            scripts.TakeItemArgs(
                job_id=job_id,
                msg=msg,
                token=token,
                priority=priority.name,
                affw_prefix=self.keys.affinity_worker_prefix(key),
            ),
        )

    def take(
        self,
        model: str,
        consumer: str,
        items: Sequence[tuple[scripts.LaneItemKeys, scripts.TakeItemArgs]],
        now: float,
        dead_error: str,
    ) -> Call:
        return scripts.TAKE.call(
            scripts.TakeKeys(*self._end_keys(model), workers=self.keys.workers(model)),
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
                pfx_prefix=self.keys.prefix_owner_prefix(model),
                pfx_ttl_ms=ms(self.settings.affinity_ttl_s),
            ),
            items,
        )

    async def renew(self, leases: Sequence[Lease], deadline: float) -> list[bool]:
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
            return scripts.RENEW.call(Empty(), scripts.DeadlineArg(deadline=repr(deadline)), items)

        return await self.table.flags_per_model([lease.spec.model for lease in leases], call)

    async def emit(self, events: Sequence[tuple[Lease, JobEvent]]) -> list[bool]:
        def call(batch: list[tuple[Lease, JobEvent]]) -> Call:
            keys = self.keys
            return scripts.EMIT.call(
                Empty(),
                Empty(),
                [
                    (
                        scripts.EventKeys(job=keys.job(x.spec.id), events=keys.events(x.spec.id)),
                        scripts.EmitItemArgs(
                            consumer=x.consumer, token=x.entry_id, event=encode(event)
                        ),
                    )
                    for x, event in batch
                ],
            )

        return await self.table.emit_per_model(events, call)

    # -- endings ---------------------------------------------------------------------------
    def complete(
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
                    completion_args(lease, result, tail),
                )
            )
        return scripts.COMPLETE.call(
            self.table.completion_keys(model),
            scripts.CompleteArgs(now=now, ttl_ms=self.table.ttl_ms),
            items,
        )

    async def bury(
        self, dying: Sequence[tuple[Lease, machine.Step]], cancel_wins: bool = False
    ) -> list[int]:
        """Dead-letter jobs whose lease the caller holds, each as the machine's step says (its
        `Bury` and `Finish`; with `cancel_wins`, one a client asked to cancel ends cancelled
        instead); settles those that ended. Per job 1 dead, 2 cancelled, 0 fenced."""
        if not dying:
            return []
        letters = [_effect(step, machine.Bury) for _, step in dying]
        ends = [_effect(step, machine.Finish).result for _, step in dying]

        def call(batch: list[int]) -> Call:
            items = []
            for i in batch:
                lease, letter = dying[i][0], letters[i]
                items.append(
                    self._bury_item(
                        lease.spec,
                        letter.reason,
                        letter.error,
                        ends[i],
                        lease=lease,
                        cancel_wins=cancel_wins,
                    )
                )
            return self._bury_call(dying[batch[0]][0].spec.model, items)

        codes = await self.table.codes_per_model([lease.spec.model for lease, _ in dying], call)
        await self.table.settle(
            [
                (lease.spec, end if code == 1 else cancelled_result())
                for (lease, _), end, code in zip(dying, ends, codes, strict=True)
                if code
            ]
        )
        return codes

    async def bury_messages(
        self, model: str, dying: Sequence[tuple[JobSpec, str, str, str]]
    ) -> list[tuple[JobSpec, JobResult]]:
        """Dead-letter jobs by their live message (spec, message id, reason, error), whoever
        holds them; the jobs it buried, with their ends, for the caller to settle."""
        if not dying:
            return []
        ends = [dead_result(f"{why}: {error}") for _, _, why, error in dying]
        items = [
            self._bury_item(spec, why, error, end, msg=msg)
            for (spec, msg, why, error), end in zip(dying, ends, strict=True)
        ]
        flags = await self.conn.run(self._bury_call(model, items))
        return [(spec, end) for (spec, *_), end, ok in zip(dying, ends, flags, strict=True) if ok]

    def _bury_item(
        self,
        spec: JobSpec,
        reason: str,
        error: str,
        end: JobResult,
        lease: Lease | None = None,
        msg: str = "",
        cancel_wins: bool = False,
    ) -> tuple[scripts.LaneItemKeys, scripts.BuryItemArgs]:
        """bury.lua's item for a job, fenced by the `lease` held or else by its message `msg`."""
        return (
            self._spec_item_keys(spec),
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

    def _bury_call(
        self, model: str, items: Sequence[tuple[scripts.LaneItemKeys, scripts.BuryItemArgs]]
    ) -> Call:
        return scripts.BURY.call(
            self._end_keys(model),
            scripts.CompleteArgs(now=repr(self.table.clock()), ttl_ms=self.table.ttl_ms),
            items,
        )

    async def requeue(
        self,
        moved: Sequence[tuple[Lease, str]],
        error: str = "",
        due_at: float = 0.0,
        uncharge: bool = False,
        expired_by: float = 0.0,
        max_preemptions: int = -1,
    ) -> list[int]:
        """Point held jobs' records at the new messages already published (see requeue.lua):
        per job 1 requeued, 2 ended cancelled (a client asked; settled here), 3 preempted
        too often (`max_preemptions` >= 0: a preemption; the lease stands), 0 fenced."""
        if not moved:
            return []
        now = repr(self.table.clock())

        def call(batch: list[int]) -> Call:
            model = moved[batch[0]][0].spec.model
            items = []
            for i in batch:
                lease, msg = moved[i]
                spec = lease.spec
                items.append(
                    (
                        self._spec_item_keys(spec),
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
                    max_preemptions=max_preemptions,
                ),
                items,
            )

        codes = await self.table.codes_per_model([lease.spec.model for lease, _ in moved], call)
        await self.table.settle(
            [
                (lease.spec, cancelled_result())
                for (lease, _), code in zip(moved, codes, strict=True)
                if code == 2
            ]
        )
        return codes

    async def expired(self, model: str, expired: bool, now: float, most: int) -> list[Any]:
        """The leases of workers whose liveness lapsed and, with `expired`, those past their
        deadline (at most `most` per lane): (job id, consumer, token, deliveries, lapsed)."""
        call = scripts.EXPIRED.call(
            scripts.LiveKey(live=self.keys.live(model)),
            scripts.ExpiredArgs(
                now=repr(now),
                max_entries=most,
                job_prefix=self.keys.job_prefix(model),
                expired="1" if expired else "0",
            ),
            [
                (scripts.LeasesKey(leases=self.keys.leases(lane)), Empty())
                for lane in self.keys.lanes(model, self.settings.pool_count)
            ],
        )
        return [row for lane_rows in await self.conn.run(call) for row in lane_rows]

    async def unwait(self, job_id: str) -> None:
        """A cancelled job no longer waits (its message stays on the lane until a claim
        drops it)."""
        lane = await self.conn.one(("HGET", self.keys.job(job_id), "lane"))
        if lane:
            await self.conn.one(("ZREM", self.keys.waiting(text(lane)), job_id))

    # -- counts ----------------------------------------------------------------------------
    async def waiting(self, model: str, above: Priority, pools: Sequence[int]) -> list[LaneWaiting]:
        places = [(p, pool) for p in Priority if p < above for pool in pools]
        if not places:
            return []
        now = self.table.clock()
        lanes = [self.lane_key(model, p, pool) for p, pool in places]
        replies = await self._lane_counts(lanes)
        return LaneWaiting.by_priority(
            (p, int(replies[3 * i]), _age(replies[3 * i + 1], now))
            for i, (p, _) in enumerate(places)
        )

    async def _lane_counts(self, lanes: Sequence[str], extra: Sequence[Any] = ()) -> list[Any]:
        """Each lane's (waiting, oldest waiting, in flight), then the replies to `extra`:
        one round trip."""
        commands: list[tuple[Any, ...]] = []
        for lane in lanes:
            commands += [
                ("ZCARD", self.keys.waiting(lane)),
                ("ZRANGE", self.keys.waiting(lane), 0, 0, "WITHSCORES"),
                ("ZCARD", self.keys.leases(lane)),
            ]
        return await self.conn.checked([*commands, *extra])

    async def stats(self, model: str) -> BrokerStats:
        now = self.table.clock()
        pools = self.settings.pool_count
        lanes = self.keys.lanes(model, pools)
        replies = await self._lane_counts(lanes, self.table.tally_commands(model))
        stats = []
        for p, priority in enumerate(Priority):
            waiting = in_flight = 0
            ages: list[float] = []
            for i in range(p * pools, (p + 1) * pools):
                count, oldest, running = replies[3 * i : 3 * i + 3]
                waiting += int(count)
                in_flight += int(running)
                age = _age(oldest, now)
                if age is not None:
                    ages.append(age)
            stats.append(
                LaneStats(
                    model,
                    priority,
                    waiting=waiting,
                    in_flight=in_flight,
                    oldest_waiting_age_s=max(ages) if ages else None,
                )
            )
        return self.table.stats_of(model, stats, replies[3 * len(lanes) :])

    async def depth(self, model: str) -> int:
        commands: list[tuple[Any, ...]] = []
        for lane in self.keys.lanes(model, self.settings.pool_count):
            commands += [("ZCARD", self.keys.waiting(lane)), ("ZCARD", self.keys.leases(lane))]
        return sum(int(n or 0) for n in await self.conn.checked(commands))

    async def backlog(self, model: str) -> list[LaneBacklog]:
        """FIFO within a lane (no fair-share staging): every waiting job is queued."""
        pools = self.settings.pool_count
        replies = await self._lane_counts(self.keys.lanes(model, pools))
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


def _age(oldest: Any, now: float) -> float | None:
    """How long the first member of a ZRANGE .. WITHSCORES reply (a waiting set's oldest)
    has waited; None for an empty set."""
    if not oldest:
        return None
    first = oldest[0]
    score = first[1] if isinstance(first, (list, tuple)) else oldest[1]
    return max(0.0, now - float(score))


def _effect(step: machine.Step, kind: type[E]) -> E:
    """The step's effect of `kind` (a dead-lettering step has one `Bury` and one `Finish`)."""
    return next(e for e in step.effects if isinstance(e, kind))
