"""Redis Streams broker: one stream per lane, one consumer group, Lua for every state change."""

from __future__ import annotations

import functools
import hashlib
import logging
import random
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, NamedTuple, ParamSpec, TypeVar, cast

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

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
from tokenyard.broker.group_commit import GroupCommit
from tokenyard.broker.outcomes import cancelled_result, dead_result, expired_result
from tokenyard.broker.policy import (
    backoff_delay,
    claim_order,
    estimated_tokens,
    fair_cost,
    size_pool,
    staging_score,
)
from tokenyard.broker.redis import scripts
from tokenyard.broker.redis.channel import Channel, Command
from tokenyard.broker.redis.keys import GROUP, Keys
from tokenyard.broker.redis.scripts import Call, Empty
from tokenyard.broker.tables import Settlement, settlement
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
    WorkerInfo,
    decode,
    decode_event,
    encode,
)
from tokenyard.tenancy.limiter import Decision, Quota
from tokenyard.tenancy.records import ApiKeyRecord, TenantConfig

_SOCKET_TIMEOUT_S = 60.0
MAX_BLOCK_S = 30.0  # callers' block_s is capped so a blocking read never meets the read timeout
CLUSTER_SCHEME = "redis+cluster://"

_P = ParamSpec("_P")
_R = TypeVar("_R")

log = logging.getLogger(__name__)


def _unavailable_on_errors(
    method: Callable[_P, Coroutine[Any, Any, _R]],
) -> Callable[_P, Coroutine[Any, Any, _R]]:
    """Surface connection trouble as BrokerUnavailable (HTTP 503), never a redis-py error."""

    @functools.wraps(method)
    async def guarded(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return await method(*args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise BrokerUnavailable(str(exc) or type(exc).__name__) from exc

    return guarded


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _xread_command(cursors: Mapping[str, str], count: int, block_s: float | None) -> Command:
    block: list[str | int] = [] if block_s is None else ["BLOCK", _ms(block_s)]
    return ("XREAD", "COUNT", count, *block, "STREAMS", *cursors, *cursors.values())


def _field(fields: Any, name: bytes) -> Any:
    """A stream entry's field from its raw reply: a flat [name, value, ...] list (RESP2) or
    a map (RESP3)."""
    if isinstance(fields, dict):
        return fields[name]
    for i in range(0, len(fields), 2):
        if fields[i] == name:
            return fields[i + 1]
    raise KeyError(name)


def _client(settings: BrokerSettings) -> aioredis.Redis:
    """A client for `settings.url`; `redis+cluster://host:port` (any node) is a Redis Cluster."""
    if settings.url.startswith(CLUSTER_SCHEME):
        from redis.asyncio.cluster import RedisCluster

        cluster = RedisCluster.from_url(
            "redis://" + settings.url.removeprefix(CLUSTER_SCHEME),
            max_connections=settings.max_connections,
            decode_responses=False,
            socket_timeout=_SOCKET_TIMEOUT_S,
            socket_connect_timeout=5,
        )
        # every script's keys share one slot and cross-slot work is split per model, so the
        # broker uses only commands both clients route the same way
        return cast(aioredis.Redis, cluster)
    # callers past max_connections wait for a free connection rather than fail
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.url,
        max_connections=settings.max_connections,
        timeout=_SOCKET_TIMEOUT_S,
        decode_responses=False,
        health_check_interval=30,
        # blocking reads wait up to several seconds server-side; redis-py's 5 s default
        # read timeout would cut them off under load
        socket_timeout=_SOCKET_TIMEOUT_S,
        socket_connect_timeout=5,
    )
    return aioredis.Redis(connection_pool=pool)


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


_SWEEP_BATCH = 500  # held reservations looked at per tenant per sweep


def _decision(quota: Quota, row: list[Any]) -> Decision:
    admitted, reason, retry, rrem, rreset, trem, treset = row
    retry_s = float(_s(retry))
    return Decision(
        admitted=admitted == 1,
        reason=_s(reason),
        retry_after_s=float("inf") if retry_s < 0 else retry_s,
        requests=(quota.rpm, int(rrem), float(_s(rreset))) if quota.rpm else None,
        tokens=(quota.tpm, int(trem), float(_s(treset))) if quota.tpm else None,
    )


class RedisBroker(Broker):
    """Works on Redis >= 6.2 and Valkey >= 7.2."""

    def __init__(
        self,
        settings: BrokerSettings,
        clock: Clock = time.time,
        client: aioredis.Redis | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.redis: aioredis.Redis = client or _client(settings)
        # a cluster client routes each command by slot itself: it keeps every call
        pool = getattr(self.redis, "connection_pool", None)
        self._channel = (
            Channel(pool, settings.max_connections, _SOCKET_TIMEOUT_S)
            if isinstance(pool, aioredis.ConnectionPool)
            else None
        )
        self.keys = Keys(settings.prefix)
        self._sources = {spec.name: spec.source() for spec in scripts.SCRIPTS}
        self._shas = {
            name: hashlib.sha1(src.encode()).hexdigest() for name, src in self._sources.items()
        }
        # every claim passes the expired outcome along; encode it once, not per claim
        self._expired = encode(Finished(result=expired_result()))
        self._rounds: dict[str, int] = defaultdict(int)
        self._hints: dict[str, _WaitHint] = {}
        self._rng = rng or random.Random()
        self._known_models: set[str] = set()
        self._sweep_cursor: dict[str, int] = {}
        self._group = GroupCommit(
            self.enqueue_many,
            max_batch=settings.enqueue_batch,
            window_s=settings.enqueue_window_s,
        )

    async def _run(self, call: Call) -> Any:
        return (await self._eval_many([call]))[0]

    async def _eval_many(self, calls: Sequence[Call]) -> list[Any]:
        """Run scripts by SHA in one round trip; any the server lacks (it restarted) are loaded
        and only those calls run again, so nothing runs twice."""
        results = await self._pipelined([self._evalsha(call) for call in calls])
        return await self._retry_missing(calls, results)

    async def _eval_audited(
        self, calls: Sequence[Call], entries: Sequence[AuditEntry]
    ) -> tuple[list[Any], list[str | None]]:
        """`_eval_many` with the audit entries' XADDs in the same round trip (the stream has
        its own hash tag, so it cannot be in the scripts). Returns the scripts' results and
        each entry's stream id (None where the XADD failed: logged, the state change stands)."""
        bound = self.settings.audit_max_len
        if bound <= 0 or not entries:
            return await self._eval_many(calls), [None] * len(entries)
        key = self.keys.audit()
        replies = await self._pipelined(
            [self._evalsha(call) for call in calls]
            + [("XADD", key, "MAXLEN", "~", bound, "*", "e", encode(e)) for e in entries]
        )
        ids: list[str | None] = []
        for entry, reply in zip(entries, replies[len(calls) :], strict=True):
            if isinstance(reply, Exception):
                log.error("audit entry of job %s not written: %s", entry.job_id, reply)
                ids.append(None)
            else:
                ids.append(_s(reply))
        return await self._retry_missing(calls, replies[: len(calls)]), ids

    async def _unaudit(self, ids: Sequence[str | None]) -> None:
        """Take back entries whose state change did not happen (a fenced completion, a job
        that was not created): rare paths, so the extra round trip stays off the hot one."""
        found = [i for i in ids if i is not None]
        if found:
            await self.redis.xdel(self.keys.audit(), *found)

    async def _pipelined(self, commands: Sequence[Command], timeout_s: float = 0.0) -> list[Any]:
        """Raw commands in one round trip, error replies in their places; on the channel
        unless this is a cluster client."""
        if self._channel is not None:
            return await self._channel.execute(commands, timeout_s or None)
        pipe = self.redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        results: list[Any] = await pipe.execute(raise_on_error=False)
        return results

    async def _checked(self, commands: Sequence[Command], timeout_s: float = 0.0) -> list[Any]:
        """`_pipelined`, raising the first error reply (the gateway's polled reads and the
        worker's heartbeat are frequent enough that redis-py's per-command cost shows)."""
        replies = await self._pipelined(commands, timeout_s)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    async def _one(self, command: Command) -> Any:
        (reply,) = await self._checked([command])
        return reply

    def _evalsha(self, call: Call) -> Command:
        # plain EVALSHA: redis-py's Script objects send SCRIPT EXISTS before every pipeline;
        # as a raw command, as a cluster pipeline refuses .evalsha() (it routes the raw one by
        # its first key, and all of a script's keys share that slot)
        name, keys, args = call
        return ("EVALSHA", self._shas[name], len(keys), *keys, *args)

    async def _retry_missing(self, calls: Sequence[Call], results: list[Any]) -> list[Any]:
        missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if missing:
            for name in {calls[i][0] for i in missing}:
                await self.redis.script_load(self._sources[name])
            again = await self._pipelined([self._evalsha(calls[i]) for i in missing])
            for i, result in zip(missing, again, strict=True):
                results[i] = result
        for result in results:
            if isinstance(result, Exception):
                raise result
        return results

    @property
    def _ttl_ms(self) -> int:
        return _ms(self.settings.record_ttl_s)

    # -- producing -------------------------------------------------------------------------
    async def enqueue(self, spec: JobSpec) -> EnqueueResult:
        """One job; concurrent callers of this broker share script calls (group commit)."""
        return await self._group.enqueue(spec)

    @_unavailable_on_errors
    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[EnqueueResult]:
        """All-or-nothing per model: one script call admits a model's whole batch."""
        now = self.clock()
        bounds = self.settings.pool_bounds
        by_model: dict[str, list[int]] = defaultdict(list)
        for index, spec in enumerate(specs):
            if not spec.created_at:
                spec.created_at = now
            spec.pool = size_pool(estimated_tokens(spec), bounds)
            by_model[spec.model].append(index)
        calls = [
            self._enqueue_call([specs[i] for i in indexes], now) for indexes in by_model.values()
        ]
        receipts = [audit.received(spec, now) for spec in specs]
        replies, ids = await self._eval_audited(calls, receipts)
        new_models = set(by_model) - self._known_models
        if new_models:
            await self.redis.sadd(self.keys.models(), *new_models)
            self._known_models |= new_models
        results: list[EnqueueResult | None] = [None] * len(specs)
        for indexes, (code, payload) in zip(by_model.values(), replies, strict=False):
            if code == -1:
                # the other models' batches stand; none of this model's jobs was added
                await self._unaudit([ids[i] for i in indexes])
                item, depth = payload
                full = specs[indexes[int(item) - 1]]
                lane = f"{full.model}/{full.priority.name.lower()}"
                raise QueueFull(lane, int(depth), self.settings.max_queue_depth)
            for i, (created, job_id, joined) in zip(indexes, payload, strict=True):
                results[i] = EnqueueResult(
                    job_id=_s(job_id), created=created == 1, collapsed=joined == 1
                )
        await self._unaudit([ids[i] for i, r in enumerate(results) if r and not r.created])
        return [r for r in results if r is not None]

    def _enqueue_call(self, specs: Sequence[JobSpec], now: float) -> Call:
        items = []
        for spec in specs:
            job = self.keys.job(spec.id)
            idem = inflight = job
            if spec.idempotency_key:
                idem = self.keys.idempotency(spec.model, spec.tenant, spec.idempotency_key)
            if spec.collapse_key:
                inflight = self.keys.inflight(spec.model, spec.collapse_key)
            lane = self.keys.lane(spec.model, spec.priority, spec.pool)
            items.append(
                (
                    scripts.EnqueueItemKeys(
                        lane=lane,
                        job=job,
                        idem=idem,
                        fair=self.keys.fair(lane),
                        active=self.keys.fair_active(lane),
                        inflight=inflight,
                        held=self.keys.affinity_held(lane),
                    ),
                    scripts.EnqueueItemArgs(
                        job_id=spec.id,
                        spec=encode(spec),
                        deadline="" if spec.deadline is None else repr(spec.deadline),
                        use_idem="1" if spec.idempotency_key else "0",
                        tq_prefix=self.keys.tenant_queue_prefix(lane),
                        tenant=spec.tenant,
                        weight=repr(spec.weight),
                        cost=fair_cost(spec),
                        score=repr(staging_score(spec)),
                        use_inflight="1" if spec.collapse_key else "0",
                        prefix=spec.prefix_key,
                        affw_prefix=self.keys.affinity_worker_prefix(lane),
                    ),
                )
            )
        return scripts.ENQUEUE.call(
            scripts.EnqueueKeys(workers=self.keys.workers(specs[0].model)),
            scripts.EnqueueArgs(
                now=repr(now),
                max_depth=self.settings.max_queue_depth,
                idem_ttl_ms=_ms(self.settings.idempotency_ttl_s),
                window=max(1, self.settings.fair_window),
                job_prefix=self.keys.job_prefix(specs[0].model),
                pfx_prefix=self.keys.prefix_owner_prefix(specs[0].model),
                wake_prefix=self.keys.wake_prefix(specs[0].model),
                max_held=self.settings.affinity_max_held,
            ),
            items,
        )

    # -- consuming -------------------------------------------------------------------------
    @_unavailable_on_errors
    async def claim(
        self,
        model: str,
        consumer: str,
        slots: int,
        block_s: float = 0.0,
        pools: Sequence[int] = (0,),
        batch_room: int | None = None,
    ) -> list[Lease]:
        """One round trip in the common case: while the lanes have more than `slots` jobs, the
        claim script alone; once a claim drains them, the next one blocks on XREAD after the
        lanes' newest ids and runs the claim script in the same pipeline, so the server claims
        the moment the wake-up arrives."""
        if slots <= 0:
            return []
        # per priority, the pools in the caller's order: strict priority holds across pools
        lanes = [[self.keys.lane(model, p, pool) for pool in pools] for p in Priority]
        capped = {self.keys.lane(model, Priority.BATCH, pool) for pool in pools}
        give_up_at = time.monotonic() + block_s
        # an empty claim of the last call left the lanes' newest ids: wait on them right away
        hint = self._hints.pop(model, None) if block_s > 0 else None
        if hint is not None and hint.batch_room != batch_room:
            hint = None  # taken under another cap: the batch lane may hold work it may now take
        while True:
            order = claim_order(len(lanes), self._rounds[model], self.settings.starvation_every)
            self._rounds[model] += 1
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
                    expired_event=self._expired,
                    ttl_ms=self._ttl_ms,
                    wait_hints="1" if block_s > 0 else "0",
                    window=max(1, self.settings.fair_window),
                    capped_room=-1 if batch_room is None else max(0, batch_room),
                    pfx_prefix=self.keys.prefix_owner_prefix(model),
                    pfx_ttl_ms=_ms(self.settings.affinity_ttl_s),
                    aff_wait=repr(self.settings.affinity_wait_s),
                    wake_after=after.get(wake, ""),
                ),
                [
                    (
                        scripts.ClaimLaneKeys(
                            lane=lane,
                            fair=self.keys.fair(lane),
                            active=self.keys.fair_active(lane),
                            held=self.keys.affinity_held(lane),
                            mine=self.keys.affinity_worker(lane, consumer),
                            aff=self.keys.affinity_stream(lane),
                        ),
                        scripts.ClaimLaneArgs(
                            tq_prefix=self.keys.tenant_queue_prefix(lane),
                            capped="1" if lane in capped else "0",
                            affw_prefix=self.keys.affinity_worker_prefix(lane),
                            after=after.get(lane, ""),
                        ),
                    )
                    for lane in ordered
                ],
            )
            if hint is None:
                reply = await self._run(call)
            else:
                wait = give_up_at - time.monotonic()
                if hint.next_due:
                    wait = min(wait, max(0.001, hint.next_due - now))
                reply = await self._wake_then_claim(hint, max(wait, 0.001), call)
            claimed, last_ids, next_due, wake_id, expired, drained = reply
            if expired:  # rare: their end goes to the audit trail (and settles any quota)
                ended = expired_result()
                await self._settle_specs([(decode(spec, JobSpec), ended) for spec in expired])
            hint = None
            if last_ids:  # the lanes are drained: the next wait can start from here
                due = float(next_due) if next_due else 0.0
                # this worker's wake stream too: a job held for it (prefix affinity) lands there
                ids = [*(_s(i) for i in last_ids), _s(wake_id)]
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
        xread = _xread_command(dict(zip(hint.lanes, hint.last_ids, strict=True)), 1, block_s)
        woke, reply = await self._pipelined(
            [xread, self._evalsha(call)], timeout_s=block_s + _SOCKET_TIMEOUT_S
        )
        if isinstance(woke, Exception):
            raise woke
        return (await self._retry_missing([call], [reply]))[0]

    def _lease(self, consumer: str, row: list[Any]) -> Lease:
        entry_id, spec_bytes, attempt, resumable, affinity = row
        spec = decode(spec_bytes, JobSpec)
        spec.attempt = int(attempt)
        return Lease(
            spec=spec,
            entry_id=_s(entry_id),
            consumer=consumer,
            resumable=resumable == 1,
            affinity=affinity == 1,
        )

    def _home(self, lease: Lease) -> str:
        return self.keys.lane(lease.spec.model, lease.spec.priority, lease.spec.pool)

    def _lane(self, lease: Lease) -> str:
        """The stream holding the lease's entry: its lane, or that lane's affinity stream."""
        home = self._home(lease)
        return self.keys.affinity_stream(home) if lease.affinity else home

    @_unavailable_on_errors
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

        return await self._flags_per_model([lease.spec.model for lease in leases], call)

    async def _per_model(
        self, models: Sequence[str], call: Callable[[list[int]], Call]
    ) -> list[tuple[list[int], Any]]:
        """One script call per model, pipelined: a script's keys must share one hash slot."""
        batches: dict[str, list[int]] = defaultdict(list)
        for index, model in enumerate(models):
            batches[model].append(index)
        replies = await self._eval_many([call(batch) for batch in batches.values()])
        return list(zip(batches.values(), replies, strict=True))

    async def _flags_per_model(
        self, models: Sequence[str], call: Callable[[list[int]], Call]
    ) -> list[bool]:
        flags = [False] * len(models)
        for batch, reply in await self._per_model(models, call):
            for i, flag in zip(batch, reply, strict=True):
                flags[i] = bool(flag)
        return flags

    async def _execute(self, pipe: Any) -> list[Any]:
        result: list[Any] = await pipe.execute()
        return result

    @_unavailable_on_errors
    async def complete_many(
        self,
        items: Sequence[tuple[Lease, JobResult]],
        tails: Sequence[TokenChunk | None] | None = None,
    ) -> list[bool]:
        if not items:
            return []
        now = repr(self.clock())
        by_model: dict[str, list[int]] = defaultdict(list)
        for index, (lease, _) in enumerate(items):
            by_model[lease.spec.model].append(index)
        calls: list[Call] = []
        for model, indexes in by_model.items():
            batch = []
            for i in indexes:
                lease, result = items[i]
                job_id = lease.spec.id
                tail = None if tails is None else tails[i]
                batch.append(
                    (
                        scripts.CompleteItemKeys(
                            lane=self._lane(lease),
                            job=self.keys.job(job_id),
                            events=self.keys.events(job_id),
                        ),
                        scripts.CompleteItemArgs(
                            consumer=lease.consumer,
                            entry_id=lease.entry_id,
                            job_id=job_id,
                            status=result.status.value,
                            finished=encode(Finished(result=result)),
                            tail=b"" if tail is None else encode(tail),
                        ),
                    )
                )
            calls.append(
                scripts.COMPLETE.call(
                    scripts.CompleteKeys(
                        cancels=self.keys.cancels(model), counters=self.keys.counters(model)
                    ),
                    scripts.CompleteArgs(group=GROUP, now=now, ttl_ms=self._ttl_ms),
                    batch,
                )
            )
        accepted = [False] * len(items)
        when = self.clock()
        entries = [audit.terminal(lease.spec, result, when) for lease, result in items]
        replies, ids = await self._eval_audited(calls, entries)
        for indexes, flags in zip(by_model.values(), replies, strict=True):
            for i, flag in zip(indexes, flags, strict=True):
                accepted[i] = bool(flag)
        await self._unaudit([ids[i] for i in range(len(items)) if not accepted[i]])
        await self._settle_specs(
            [(items[i][0].spec, items[i][1]) for i in range(len(items)) if accepted[i]],
            audited=False,
        )
        return accepted

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
                ttl_ms=self._ttl_ms,
                reason=reason,
                force_dead="1" if force_dead else "0",
                priority=lease.spec.priority.name,
            ),
        )
        outcome = int(await self._run(call))
        if outcome == 0:  # dead: its reservation is refunded, its end audited
            await self._settle_specs([(lease.spec, dead)])
        return outcome

    @_unavailable_on_errors
    async def retry(self, lease: Lease, error: str) -> bool:
        return await self._fail(lease, error, "failed", force_dead=False) == 1

    @_unavailable_on_errors
    async def dead_letter(self, lease: Lease, reason: str, error: str | None = None) -> bool:
        return await self._fail(lease, error or reason, reason, force_dead=True) == 0

    @_unavailable_on_errors
    async def release(self, leases: Sequence[Lease]) -> int:
        def call(batch: list[int]) -> Call:
            return scripts.RELEASE.call(
                Empty(),
                scripts.GroupArg(group=GROUP),
                [
                    (
                        scripts.ReleaseItemKeys(
                            lane=self._lane(leases[i]),
                            job=self.keys.job(leases[i].spec.id),
                            home=self._home(leases[i]),
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

        replies = await self._per_model([lease.spec.model for lease in leases], call)
        return sum(int(reply) for _, reply in replies)

    @_unavailable_on_errors
    async def reap(self, model: str) -> ReapReport:
        result = dead_result(f"lease expired on each of {self.settings.max_deliveries} deliveries")
        call = scripts.REAP.call(
            scripts.ReapKeys(dlq=self.keys.dead_letters(model), counters=self.keys.counters(model)),
            scripts.ReapArgs(
                group=GROUP,
                reaper="reaper",
                min_idle_ms=_ms(self.settings.lease_s),
                max_entries=1000,
                max_deliveries=self.settings.max_deliveries,
                now=repr(self.clock()),
                job_prefix=self.keys.job_prefix(model),
                event_prefix=self.keys.events_prefix(model),
                finished=encode(Finished(result=result)),
                ttl_ms=self._ttl_ms,
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
        requeued, dead = await self._run(call)
        report = ReapReport(requeued=[_s(j) for j in requeued], dead=[_s(j) for j in dead])
        await self._settle_ids(report.dead)
        return report

    async def _settle_ids(self, job_ids: Sequence[str]) -> None:
        """Settle jobs that just ended where only their ids are at hand (rare paths)."""
        records = [await self.record(job_id) for job_id in job_ids]
        await self._settle_specs([(r.spec, r.result) for r in records if r is not None])

    # -- cancellation ----------------------------------------------------------------------
    @_unavailable_on_errors
    async def cancel(self, job_id: str) -> CancelOutcome:
        return await self._cancel(job_id, 0)

    @_unavailable_on_errors
    async def leave(self, job_id: str, followers: int = 1) -> CancelOutcome:
        return await self._cancel(job_id, max(1, followers))

    async def _cancel(self, job_id: str, leaving: int) -> CancelOutcome:
        keys = self.keys
        call = scripts.CANCEL.call(
            scripts.CancelKeys(
                job=keys.job(job_id),
                events=keys.events(job_id),
                cancels=keys.cancels_of_job(job_id),
                delayed=keys.delayed_of_job(job_id),
            ),
            scripts.CancelArgs(
                job_id=job_id,
                now=repr(self.clock()),
                finished=encode(Finished(result=cancelled_result())),
                ttl_ms=self._ttl_ms,
                leaving=leaving,
            ),
        )
        outcome = CancelOutcome(_s(await self._run(call)))
        if outcome is CancelOutcome.CANCELLED:
            await self._settle_ids([job_id])
        return outcome

    # -- response cache --------------------------------------------------------------------
    @_unavailable_on_errors
    async def cache_get(self, model: str, digest: str) -> bytes | None:
        value: Any = await self.redis.get(self.keys.cache(model, digest))
        return None if value is None else bytes(value)

    @_unavailable_on_errors
    async def cache_put(
        self, model: str, digest: str, value: bytes, ttl_s: float, max_bytes: int
    ) -> None:
        call = scripts.CACHE_PUT.call(
            scripts.CachePutKeys(
                entry=self.keys.cache(model, digest),
                by_expiry=self.keys.cache_index(model),
                sizes=self.keys.cache_sizes(model),
                counters=self.keys.counters(model),
            ),
            scripts.CachePutArgs(
                digest=digest,
                value=value,
                ttl_ms=_ms(ttl_s),
                now_ms=int(self.clock() * 1000),
                max_bytes=max_bytes,
                entry_prefix=self.keys.cache_prefix(model),
            ),
        )
        await self._run(call)

    @_unavailable_on_errors
    async def cancelled(self, model: str, job_ids: Sequence[str]) -> set[str]:
        if not job_ids:
            return set()
        # the set holds only jobs someone asked to cancel, so it is small; fetching it costs less
        # than sending every running id
        members: Any = await self.redis.smembers(self.keys.cancels(model))
        return {_s(m) for m in members} & set(job_ids)

    # -- events and records ----------------------------------------------------------------
    @_unavailable_on_errors
    async def append_events(self, events: Sequence[tuple[Lease, JobEvent]]) -> list[bool]:
        def call(batch: list[int]) -> Call:
            items = []
            for i in batch:
                lease, event = events[i]
                items.append(
                    (
                        scripts.EmitItemKeys(
                            lane=self._lane(lease), events=self.keys.events(lease.spec.id)
                        ),
                        scripts.EmitItemArgs(
                            consumer=lease.consumer, entry_id=lease.entry_id, event=encode(event)
                        ),
                    )
                )
            return scripts.EMIT.call(Empty(), scripts.GroupArg(group=GROUP), items)

        return await self._flags_per_model([lease.spec.model for lease, _ in events], call)

    @_unavailable_on_errors
    async def read_events(
        self, job_id: str, after: str = "0", block_s: float = 0.0, count: int = 1000
    ) -> list[tuple[str, JobEvent]]:
        found = await self._read_streams({self.keys.events(job_id): after}, count, block_s)
        return [(eid, event) for _, eid, event in found]

    @_unavailable_on_errors
    async def read_events_many(
        self,
        cursors: Mapping[str, str],
        block_s: float = 0.0,
        count: int = 1000,
    ) -> list[tuple[str, str, JobEvent]]:
        if not cursors:
            return []
        job_of = {self.keys.events(job_id): job_id for job_id in cursors}
        found = await self._read_streams(
            {key: cursors[job_id] for key, job_id in job_of.items()}, count, block_s
        )
        return [(job_of[key], eid, event) for key, eid, event in found]

    async def _read_streams(
        self, cursors: Mapping[str, str], count: int, block_s: float
    ) -> list[tuple[str, str, JobEvent]]:
        """XREAD of event streams as (stream key, event id, event), parsed from the raw reply."""
        block = min(block_s, MAX_BLOCK_S) if block_s > 0 else None
        command = _xread_command(
            {key: after or "0" for key, after in cursors.items()}, count, block
        )
        (reply,) = await self._checked([command], timeout_s=(block or 0) + _SOCKET_TIMEOUT_S)
        # RESP2 answers a list of [key, entries], RESP3 a map of key -> entries
        streams = reply.items() if isinstance(reply, dict) else (reply or ())
        out: list[tuple[str, str, JobEvent]] = []
        for key, entries in streams:
            name = _s(key)
            for eid, fields in entries:
                out.append((name, _s(eid), decode_event(_field(fields, b"e"))))
        return out

    @_unavailable_on_errors
    async def record(self, job_id: str) -> JobRecord | None:
        h: Any = await self.redis.hgetall(self.keys.job(job_id))
        return _record_of_hash(h)

    @_unavailable_on_errors
    async def records(self, job_ids: Sequence[str]) -> list[JobRecord | None]:
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(self.keys.job(job_id))
        return [_record_of_hash(h) for h in await pipe.execute()] if job_ids else []

    # -- introspection ---------------------------------------------------------------------
    @_unavailable_on_errors
    async def stats(self, model: str) -> BrokerStats:
        """Two round trips: lane sizes, groups and counters; then each lane's oldest waiting."""
        now = self.clock()
        pools = self.settings.pool_count
        lanes = self.keys.lanes(model, pools)
        pipe = self.redis.pipeline(transaction=False)
        for lane in lanes:
            pipe.xlen(lane)
            pipe.xinfo_groups(lane)  # an error for a lane that does not exist yet
        for lane in lanes:
            pipe.hget(self.keys.fair(lane), "staged")  # waiting for their turn (fair share)
        for lane in lanes:
            # prefix affinity: held for a worker (waiting); the affinity stream's are in flight
            pipe.zcard(self.keys.affinity_held(lane))
            pipe.xlen(self.keys.affinity_stream(lane))
        pipe.zcard(self.keys.delayed(model))
        pipe.xlen(self.keys.dead_letters(model))
        pipe.hgetall(self.keys.counters(model))
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        delayed, dead, counters = replies[-3:]
        staged = [int(n or 0) for n in replies[2 * len(lanes) : 3 * len(lanes)]]
        held = [int(n or 0) for n in replies[3 * len(lanes) : 5 * len(lanes) : 2]]
        aff_running = [int(n or 0) for n in replies[3 * len(lanes) + 1 : 5 * len(lanes) : 2]]
        for reply in (delayed, dead, counters):
            if isinstance(reply, Exception):
                raise reply
        sizes: list[tuple[int, int, str]] = []  # total, pending, last delivered id
        for i in range(len(lanes)):
            total, groups = replies[2 * i], replies[2 * i + 1]
            group = None
            if not isinstance(groups, Exception):
                group = next((g for g in groups if _s(g["name"]) == GROUP), None)
            # no group yet: no claim has read the lane, so all of it waits
            pending, last = (
                (0, "0-0")
                if group is None
                else (
                    int(group["pending"]),
                    _s(group["last-delivered-id"]),
                )
            )
            sizes.append((int(total) if not isinstance(total, Exception) else 0, pending, last))
        pipe = self.redis.pipeline(transaction=False)
        for lane, (_, _, last) in zip(lanes, sizes, strict=True):
            pipe.xrange(lane, min=f"({last}", max="+", count=1)
        oldest: list[Any] = await self._execute(pipe)
        stats = []
        for p, priority in enumerate(Priority):
            # a priority's size pools are reported together
            mine = range(p * pools, (p + 1) * pools)
            ages = [
                max(0.0, now - int(_s(oldest[i][0][0]).split("-")[0]) / 1000)
                for i in mine
                if oldest[i]
            ]
            stats.append(
                LaneStats(
                    model,
                    priority,
                    waiting=sum(
                        max(0, sizes[i][0] - sizes[i][1]) + staged[i] + held[i] for i in mine
                    ),
                    in_flight=sum(sizes[i][1] + aff_running[i] for i in mine),
                    oldest_waiting_age_s=max(ages) if ages else None,
                )
            )
        return BrokerStats(
            model=model,
            lanes=stats,
            delayed=int(delayed),
            dead_letters=int(dead),
            fenced_completions=int(counters.get(b"fenced", 0)),
            expired=int(counters.get(b"expired", 0)),
        )

    @_unavailable_on_errors
    async def depth(self, model: str) -> int:
        # completion and every skip XDEL the lane entry with the terminal write: what is left in
        # a lane is waiting or in flight
        commands: list[Command] = []
        for lane in self.keys.lanes(model, self.settings.pool_count):
            commands += [
                ("XLEN", lane),
                ("HGET", self.keys.fair(lane), "staged"),
                ("ZCARD", self.keys.affinity_held(lane)),  # prefix affinity: held, and running
                ("XLEN", self.keys.affinity_stream(lane)),
            ]
        return sum(int(n or 0) for n in await self._checked(commands))

    @_unavailable_on_errors
    async def backlog(self, model: str) -> list[LaneBacklog]:
        # 1: each lane's length, its group (delivered and pending) and its active tenants;
        # 2: each active tenant's staged count and weight
        pools = self.settings.pool_count
        lanes = self.keys.lanes(model, pools)
        pipe = self.redis.pipeline(transaction=False)
        for lane in lanes:
            pipe.xlen(lane)
            pipe.xinfo_groups(lane)  # an error for a lane that does not exist yet
            pipe.zrange(self.keys.fair_active(lane), 0, -1)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        sizes: list[tuple[int, int]] = []
        actives: list[list[str]] = []
        for i in range(len(lanes)):
            total, groups, active = replies[3 * i : 3 * i + 3]
            if isinstance(total, Exception) or isinstance(active, Exception):
                raise total if isinstance(total, Exception) else active
            pending = 0
            if not isinstance(groups, Exception):
                group = next((g for g in groups if _s(g["name"]) == GROUP), None)
                pending = 0 if group is None else int(group["pending"])
            sizes.append((int(total), pending))
            actives.append([_s(t) for t in active])
        pipe = self.redis.pipeline(transaction=False)
        for lane, tenants in zip(lanes, actives, strict=True):
            for tenant in tenants:
                pipe.zcard(self.keys.tenant_queue_prefix(lane) + tenant)
                pipe.hget(self.keys.fair(lane), f"w:{tenant}")
        counts: list[Any] = await self._execute(pipe) if any(actives) else []
        out, at = [], 0
        for p, priority in enumerate(Priority):
            staged: dict[str, TenantBacklog] = {}
            queued = in_flight = 0
            for i in range(p * pools, (p + 1) * pools):  # a priority's size pools together
                queued += max(0, sizes[i][0] - sizes[i][1])
                in_flight += sizes[i][1]
                for tenant in actives[i]:
                    n, w = int(counts[at] or 0), float(counts[at + 1] or 1.0)
                    at += 2
                    was = staged.get(tenant)
                    staged[tenant] = TenantBacklog(tenant, n + (was.staged if was else 0), w)
            waiting = [t for t in staged.values() if t.staged > 0]
            out.append(LaneBacklog(priority, queued, in_flight, waiting))
        return out

    @_unavailable_on_errors
    async def dead_letters(self, model: str, count: int = 100) -> list[DeadLetter]:
        rows: Any = await self.redis.xrange(self.keys.dead_letters(model), count=count)
        out = []
        for _, f in rows:
            out.append(
                DeadLetter(
                    job_id=_s(f[b"job"]),
                    model=model,
                    priority=Priority[_s(f[b"priority"])],
                    reason=_s(f[b"reason"]),
                    error=_s(f[b"error"]) if f.get(b"error") else None,
                    deliveries=int(f[b"deliveries"]),
                    at=float(f[b"at"]),
                )
            )
        return out

    @_unavailable_on_errors
    async def models(self) -> list[str]:
        members: Any = await self.redis.smembers(self.keys.models())
        return sorted(_s(m) for m in members)

    @_unavailable_on_errors
    async def audit_entries(
        self,
        since: float,
        tenant: str | None = None,
        model: str | None = None,
        cursor: str | None = None,
        count: int = 1000,
    ) -> tuple[str | None, list[AuditEntry]]:
        # stream ids are the server's ms: `since` starts the range, later filtered exactly
        start = f"({cursor}" if cursor else f"{max(0, int(since * 1000) - 1000)}-0"
        rows: Any = await self.redis.xrange(self.keys.audit(), min=start, count=count)
        found = [decode(fields[b"e"], AuditEntry) for _, fields in rows]
        found = [e for e in found if audit.matches(e, since, tenant, model)]
        return (_s(rows[-1][0]) if len(rows) == count else None), found

    # -- quotas ----------------------------------------------------------------------------
    @_unavailable_on_errors
    async def reserve(
        self, tenant: str, quota: Quota, items: Sequence[tuple[str, int]]
    ) -> list[Decision]:
        if not items:
            return []
        call = scripts.RESERVE.call(
            scripts.QuotaKeys(quota=self.keys.quota(tenant), held=self.keys.quota_held(tenant)),
            scripts.ReserveArgs(
                # an injected clock (tests) is used as given; otherwise the server's TIME
                now="" if self.clock is time.time else repr(self.clock()),
                rpm=quota.rpm,
                tpm=quota.tpm,
                max_concurrent=quota.max_concurrent,
                budget=quota.token_budget,
                budget_period=quota.budget_period,
            ),
            [(Empty(), scripts.ReserveItemArgs(job_id, tokens)) for job_id, tokens in items],
        )
        _, reply = await self._pipelined(
            [("SADD", self.keys.quota_tenants(), tenant), self._evalsha(call)]
        )
        rows = (await self._retry_missing([call], [reply]))[0]
        return [_decision(quota, row) for row in rows]

    @_unavailable_on_errors
    async def settle(self, items: Sequence[Settlement]) -> int:
        if not items:
            return 0
        return sum(int(n) for n in await self._eval_many(self._settle_calls(items)))

    def _settle_calls(self, items: Sequence[Settlement]) -> list[Call]:
        by_tenant: dict[str, list[Settlement]] = defaultdict(list)
        for item in items:
            by_tenant[item.tenant].append(item)
        return [
            scripts.SETTLE.call(
                scripts.QuotaKeys(quota=self.keys.quota(t), held=self.keys.quota_held(t)),
                Empty(),
                [(Empty(), scripts.SettleItemArgs(s.job_id, s.actual)) for s in group],
            )
            for t, group in by_tenant.items()
        ]

    @_unavailable_on_errors
    async def settle_finished(self, grace_s: float = 30.0) -> int:
        now = self.clock()
        released = 0
        tenants: Any = await self.redis.smembers(self.keys.quota_tenants())
        for raw_tenant in tenants:
            tenant = _s(raw_tenant)
            reply: Any = await self.redis.hscan(
                self.keys.quota_held(tenant), self._sweep_cursor.get(tenant, 0), count=_SWEEP_BATCH
            )
            cursor, held = reply
            self._sweep_cursor[tenant] = int(cursor)
            if not held:
                continue
            ids = [_s(j) for j in held]
            pipe = self.redis.pipeline(transaction=False)
            for job_id in ids:
                pipe.hmget(self.keys.job(job_id), "status", "result", "spec")
            rows: list[Any] = await self._execute(pipe)
            done: list[Settlement] = []
            for job_id, (status, result, spec) in zip(ids, rows, strict=True):
                reserved_at = float(_s(held[job_id.encode()]).split("|")[2])
                if status is None:
                    if now - reserved_at > grace_s:  # its enqueue never landed
                        done.append(Settlement(tenant, job_id, 0))
                elif JobStatus(_s(status)).terminal:
                    finished = decode(result, Finished).result if result else None
                    done.append(settlement(decode(spec, JobSpec), finished))
            released += await self.settle(done)
        return released

    async def _settle_specs(
        self, specs: Sequence[tuple[JobSpec, JobResult | None]], audited: bool = True
    ) -> None:
        """Settle jobs that just ended and, unless their path wrote it already, audit their
        end: one round trip for both (the terminal entry rides with the settlement)."""
        held = [settlement(spec, result) for spec, result in specs if spec.quota]
        now = self.clock()
        entries = (
            [audit.terminal(spec, result, now) for spec, result in specs if result is not None]
            if audited
            else []
        )
        if held or entries:
            await self._eval_audited(self._settle_calls(held) if held else [], entries)

    # -- directory -------------------------------------------------------------------------
    @_unavailable_on_errors
    async def put_tenant(self, tenant: TenantConfig) -> None:
        await self.redis.hset(self.keys.tenants(), tenant.name, encode(tenant))

    @_unavailable_on_errors
    async def tenant(self, name: str) -> TenantConfig | None:
        raw = await self._one(("HGET", self.keys.tenants(), name))
        return None if raw is None else decode(raw, TenantConfig)

    @_unavailable_on_errors
    async def tenants(self) -> list[TenantConfig]:
        rows: Any = await self.redis.hgetall(self.keys.tenants())
        return sorted((decode(raw, TenantConfig) for raw in rows.values()), key=lambda t: t.name)

    @_unavailable_on_errors
    async def put_api_key(self, record: ApiKeyRecord) -> None:
        await self.redis.hset(self.keys.api_keys(), record.digest, encode(record))

    @_unavailable_on_errors
    async def api_key(self, digest: str) -> ApiKeyRecord | None:
        raw = await self._one(("HGET", self.keys.api_keys(), digest))
        return None if raw is None else decode(raw, ApiKeyRecord)

    @_unavailable_on_errors
    async def api_keys(self) -> list[ApiKeyRecord]:
        rows: Any = await self.redis.hgetall(self.keys.api_keys())
        records = (decode(raw, ApiKeyRecord) for raw in rows.values())
        return sorted(records, key=lambda r: (r.created_at, r.digest))

    @_unavailable_on_errors
    async def has_api_keys(self) -> bool:
        return bool(await self._one(("EXISTS", self.keys.api_keys())))

    @_unavailable_on_errors
    async def heartbeat(self, info: WorkerInfo, ttl_s: float) -> None:
        now = self.clock()
        workers = self.keys.workers(info.model)
        me = self.keys.worker(info.model, info.consumer)
        await self._checked(
            [
                ("SET", me, encode(info), "PX", _ms(ttl_s)),
                ("ZADD", workers, repr(now + ttl_s), info.consumer),
                ("ZREMRANGEBYSCORE", workers, "-inf", repr(now)),
                ("SADD", self.keys.models(), info.model),
            ]
        )

    @_unavailable_on_errors
    async def deregister(self, model: str, consumer: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.worker(model, consumer))
        pipe.zrem(self.keys.workers(model), consumer)
        await self._execute(pipe)

    @_unavailable_on_errors
    async def workers(self, model: str) -> list[WorkerInfo]:
        live = await self._one(
            ("ZRANGEBYSCORE", self.keys.workers(model), repr(self.clock()), "+inf")
        )
        if not live:
            return []
        blobs = await self._one(("MGET", *(self.keys.worker(model, _s(c)) for c in live)))
        return [decode(b, WorkerInfo) for b in blobs if b]

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except (RedisConnectionError, RedisTimeoutError, OSError):
            return False

    async def close(self) -> None:
        await self._group.close()
        if self._channel is not None:
            await self._channel.close()
        await self.redis.aclose()


def _record_of_hash(h: Any) -> JobRecord | None:
    """A job record from its hash (HGETALL's reply); None when the job is unknown."""
    if not h or b"spec" not in h:
        return None
    spec = decode(h[b"spec"], JobSpec)
    deliveries = int(h.get(b"deliveries", b"0"))
    spec.attempt = max(0, deliveries - 1)

    def opt_float(field: bytes) -> float | None:
        raw = h.get(field)
        return float(raw) if raw else None

    return JobRecord(
        spec=spec,
        status=JobStatus(_s(h[b"status"])),
        deliveries=deliveries,
        enqueued_at=float(h.get(b"enq_at", b"0")),
        started_at=opt_float(b"start_at"),
        finished_at=opt_float(b"end_at"),
        worker=_s(h[b"worker"]) if b"worker" in h else None,
        last_error=_s(h[b"last_error"]) if b"last_error" in h else None,
        cancel_requested=h.get(b"cancel") == b"1",
        # the stored result is the job's Finished event (see complete.lua)
        result=decode(h[b"result"], Finished).result if b"result" in h else None,
    )
