"""Redis Streams broker: one stream per lane, one consumer group, Lua for every state change."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import random
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine, Mapping, Sequence
from importlib import resources
from typing import Any, ParamSpec, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenyard.broker.base import (
    Broker,
    BrokerStats,
    CancelOutcome,
    Clock,
    EnqueueResult,
    LaneStats,
    Lease,
    ReapReport,
)
from tokenyard.broker.keys import GROUP, Keys
from tokenyard.broker.outcomes import cancelled_result, dead_result, expired_result
from tokenyard.broker.policy import backoff_delay, claim_order
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
    TokenChunk,
    WorkerInfo,
    decode,
    decode_event,
    encode,
)

_SCRIPTS = ("enqueue", "claim", "renew", "complete", "fail", "release", "reap", "cancel", "emit")


_SOCKET_TIMEOUT_S = 60.0
MAX_BLOCK_S = 30.0  # callers' block_s is capped so a blocking read never meets the read timeout


_Call = tuple[str, list[str], list[Any]]  # script name, keys, arguments
_P = ParamSpec("_P")
_R = TypeVar("_R")


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


def _load_script(name: str) -> str:
    return resources.files("tokenyard.broker").joinpath(f"lua/{name}.lua").read_text()


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class RedisBroker(Broker):
    """Works on Redis >= 6.2 and Valkey >= 7.2."""

    def __init__(
        self,
        settings: BrokerSettings,
        clock: Clock = time.time,
        client: aioredis.Redis | None = None,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(settings, clock)
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
        self.redis: aioredis.Redis = client or aioredis.Redis(connection_pool=pool)
        self.keys = Keys(settings.prefix)
        self._sources = {name: _load_script(name) for name in _SCRIPTS}
        self._shas = {
            name: hashlib.sha1(src.encode()).hexdigest() for name, src in self._sources.items()
        }
        # every claim passes the expired outcome along; encode it once, not per claim
        expired = expired_result()
        self._expired = (encode(expired), encode(Finished(result=expired)))
        self._rounds: dict[str, int] = defaultdict(int)
        self._rng = rng or random.Random()
        self._known_models: set[str] = set()

    async def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return (await self._eval_many([(name, keys, args)]))[0]

    async def _eval_many(self, calls: Sequence[_Call]) -> list[Any]:
        """Run scripts by SHA in one round trip; any the server lacks (it restarted) are loaded
        and only those calls run again, so nothing runs twice."""
        results = await self._evalsha_pipeline(calls)
        missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if missing:
            for name in {calls[i][0] for i in missing}:
                await self.redis.script_load(self._sources[name])
            again = await self._evalsha_pipeline([calls[i] for i in missing])
            for i, result in zip(missing, again, strict=True):
                results[i] = result
        for result in results:
            if isinstance(result, Exception):
                raise result
        return results

    async def _evalsha_pipeline(self, calls: Sequence[_Call]) -> list[Any]:
        # plain EVALSHA: redis-py's Script objects send SCRIPT EXISTS before every pipeline
        pipe = self.redis.pipeline(transaction=False)
        for name, keys, args in calls:
            pipe.evalsha(self._shas[name], len(keys), *keys, *args)
        results: list[Any] = await pipe.execute(raise_on_error=False)
        return results

    @property
    def _ttl_ms(self) -> int:
        return _ms(self.settings.record_ttl_s)

    # -- producing -------------------------------------------------------------------------
    @_unavailable_on_errors
    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[EnqueueResult]:
        """All-or-nothing per model: one script call admits a model's whole batch."""
        now = self.clock()
        by_model: dict[str, list[int]] = defaultdict(list)
        for index, spec in enumerate(specs):
            if not spec.created_at:
                spec.created_at = now
            by_model[spec.model].append(index)
        calls = [
            self._enqueue_call(model, [specs[i] for i in indexes], now)
            for model, indexes in by_model.items()
        ]
        replies = await self._eval_many(calls)
        new_models = set(by_model) - self._known_models
        if new_models:
            await self.redis.sadd(self.keys.models(), *new_models)
            self._known_models |= new_models
        results: list[EnqueueResult | None] = [None] * len(specs)
        for (model, indexes), (code, payload) in zip(by_model.items(), replies, strict=False):
            if code == -1:
                lane_index, depth = payload
                lane = self.keys.lanes(model)[int(lane_index) - 1]
                raise QueueFull(lane, int(depth), self.settings.max_queue_depth)
            for i, (created, job_id) in zip(indexes, payload, strict=True):
                results[i] = EnqueueResult(job_id=_s(job_id), created=created == 1)
        return [r for r in results if r is not None]

    def _enqueue_call(self, model: str, specs: Sequence[JobSpec], now: float) -> _Call:
        lanes = self.keys.lanes(model)
        keys: list[str] = list(lanes)
        args: list[Any] = [
            GROUP,
            repr(now),
            self.settings.max_queue_depth,
            _ms(self.settings.idempotency_ttl_s),
            len(specs),
            len(lanes),
        ]
        for spec in specs:
            job = self.keys.job(spec.id)
            idem = job
            if spec.idempotency_key:
                idem = self.keys.idempotency(spec.model, spec.tenant, spec.idempotency_key)
            keys += [job, idem]
            args += [
                int(spec.priority) + 1,  # Lua arrays count from 1
                spec.id,
                encode(spec),
                "" if spec.deadline is None else repr(spec.deadline),
                "1" if spec.idempotency_key else "0",
            ]
        return "enqueue", keys, args

    # -- consuming -------------------------------------------------------------------------
    @_unavailable_on_errors
    async def claim(
        self, model: str, consumer: str, slots: int, block_s: float = 0.0
    ) -> list[Lease]:
        if slots <= 0:
            return []
        lanes = self.keys.lanes(model)
        give_up_at = time.monotonic() + block_s
        while True:
            order = claim_order(len(lanes), self._rounds[model], self.settings.starvation_every)
            self._rounds[model] += 1
            ordered = [lanes[i] for i in order]
            now = self.clock()
            claimed, last_ids, next_due = await self._run(
                "claim",
                [*ordered, self.keys.delayed(model), self.keys.counters(model)],
                [
                    GROUP,
                    consumer,
                    slots,
                    repr(now),
                    self.keys.job_prefix(model),
                    self.keys.events_prefix(model),
                    *self._expired,
                    self._ttl_ms,
                    len(ordered),
                ],
            )
            if claimed:
                return [self._lease(model, consumer, row) for row in claimed]
            wait = give_up_at - time.monotonic()
            if wait <= 0:
                return []
            if next_due:
                wait = min(wait, max(0.001, float(next_due) - now))
            streams = {lane: _s(i) for lane, i in zip(ordered, last_ids, strict=True)}
            await self.redis.xread(streams, count=1, block=_ms(min(wait, MAX_BLOCK_S)))  # type: ignore[arg-type]

    def _lease(self, model: str, consumer: str, row: list[Any]) -> Lease:
        lane, entry_id, spec_bytes, attempt, resumable = row
        spec = decode(spec_bytes, JobSpec)
        spec.attempt = int(attempt)
        return Lease(
            spec=spec,
            lane=_s(lane),
            entry_id=_s(entry_id),
            consumer=consumer,
            resumable=resumable == 1,
        )

    @_unavailable_on_errors
    async def renew(self, leases: Sequence[Lease]) -> list[bool]:
        if not leases:
            return []
        calls = [
            ("renew", [lease.lane], [GROUP, lease.consumer, lease.entry_id]) for lease in leases
        ]
        return [bool(r) for r in await self._eval_many(calls)]

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
        calls: list[_Call] = []
        for model, indexes in by_model.items():
            keys: list[str] = []
            args: list[Any] = [GROUP, now, self._ttl_ms, len(indexes)]
            for i in indexes:
                lease, result = items[i]
                job_id = lease.spec.id
                keys += [lease.lane, self.keys.job(job_id), self.keys.events(job_id)]
                args += [
                    lease.consumer,
                    lease.entry_id,
                    job_id,
                    result.status.value,
                    encode(result),
                    encode(Finished(result=result)),
                    b"" if tails is None or tails[i] is None else encode(tails[i]),
                ]
            keys += [self.keys.cancels(model), self.keys.counters(model)]
            calls.append(("complete", keys, args))
        accepted = [False] * len(items)
        for indexes, flags in zip(by_model.values(), await self._eval_many(calls), strict=True):
            for i, flag in zip(indexes, flags, strict=True):
                accepted[i] = bool(flag)
        return accepted

    async def _fail(self, lease: Lease, error: str, reason: str, force_dead: bool) -> int:
        now = self.clock()
        model = lease.spec.model
        delay = backoff_delay(
            lease.spec.attempt, self.settings.backoff_base_s, self.settings.backoff_max_s, self._rng
        )
        dead = dead_result(f"{reason}: {error}")
        code: int = await self._run(
            "fail",
            [
                lease.lane,
                self.keys.job(lease.spec.id),
                self.keys.events(lease.spec.id),
                self.keys.cancels(model),
                self.keys.counters(model),
                self.keys.delayed(model),
                self.keys.dead_letters(model),
            ],
            [
                GROUP,
                lease.consumer,
                lease.entry_id,
                lease.spec.id,
                error,
                repr(now),
                repr(now + delay),
                self.settings.max_deliveries,
                encode(dead),
                encode(Finished(result=dead)),
                self._ttl_ms,
                reason,
                "1" if force_dead else "0",
            ],
        )
        return int(code)

    @_unavailable_on_errors
    async def retry(self, lease: Lease, error: str) -> bool:
        return await self._fail(lease, error, "failed", force_dead=False) == 1

    @_unavailable_on_errors
    async def dead_letter(self, lease: Lease, reason: str, error: str | None = None) -> bool:
        return await self._fail(lease, error or reason, reason, force_dead=True) == 0

    @_unavailable_on_errors
    async def release(self, leases: Sequence[Lease]) -> int:
        if not leases:
            return 0
        calls: list[_Call] = [
            (
                "release",
                [lease.lane, self.keys.job(lease.spec.id)],
                [GROUP, lease.consumer, lease.entry_id, lease.spec.id],
            )
            for lease in leases
        ]
        return sum(int(r) for r in await self._eval_many(calls))

    @_unavailable_on_errors
    async def reap(self, model: str) -> ReapReport:
        requeued: list[str] = []
        dead: list[str] = []
        result = dead_result(f"lease expired on each of {self.settings.max_deliveries} deliveries")
        for lane in self.keys.lanes(model):
            if not await self.redis.exists(lane):
                continue
            again, gone = await self._run(
                "reap",
                [lane, self.keys.dead_letters(model), self.keys.counters(model)],
                [
                    GROUP,
                    "reaper",
                    _ms(self.settings.lease_s),
                    1000,
                    self.settings.max_deliveries,
                    repr(self.clock()),
                    self.keys.job_prefix(model),
                    self.keys.events_prefix(model),
                    encode(result),
                    encode(Finished(result=result)),
                    self._ttl_ms,
                ],
            )
            requeued += [_s(j) for j in again]
            dead += [_s(j) for j in gone]
        return ReapReport(requeued=requeued, dead=dead)

    # -- cancellation ----------------------------------------------------------------------
    @_unavailable_on_errors
    async def cancel(self, job_id: str) -> CancelOutcome:
        result = cancelled_result()
        keys = self.keys
        outcome = await self._run(
            "cancel",
            [
                keys.job(job_id),
                keys.events(job_id),
                keys.cancels_of_job(job_id),
                keys.delayed_of_job(job_id),
            ],
            [
                job_id,
                repr(self.clock()),
                encode(result),
                encode(Finished(result=result)),
                self._ttl_ms,
            ],
        )
        return CancelOutcome(_s(outcome))

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
        if not events:
            return []
        calls: list[_Call] = [
            (
                "emit",
                [lease.lane, self.keys.events(lease.spec.id)],
                [GROUP, lease.consumer, lease.entry_id, encode(event)],
            )
            for lease, event in events
        ]
        return [bool(r) for r in await self._eval_many(calls)]

    @_unavailable_on_errors
    async def read_events(
        self, job_id: str, after: str = "0", block_s: float = 0.0, count: int = 1000
    ) -> list[tuple[str, JobEvent]]:
        key = self.keys.events(job_id)
        reply: Any = await self.redis.xread(
            {key: after or "0"},
            count=count,
            block=_ms(min(block_s, MAX_BLOCK_S)) if block_s > 0 else None,
        )
        if not reply:
            return []
        return [(_s(eid), decode_event(fields[b"e"])) for eid, fields in reply[0][1]]

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
        reply: Any = await self.redis.xread(
            {key: cursors[job_id] or "0" for key, job_id in job_of.items()},
            count=count,
            block=_ms(min(block_s, MAX_BLOCK_S)) if block_s > 0 else None,
        )
        out: list[tuple[str, str, JobEvent]] = []
        for key, entries in reply or ():
            job_id = job_of[_s(key)]
            out += [(job_id, _s(eid), decode_event(fields[b"e"])) for eid, fields in entries]
        return out

    @_unavailable_on_errors
    async def record(self, job_id: str) -> JobRecord | None:
        h: Any = await self.redis.hgetall(self.keys.job(job_id))
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
            lane=_s(h[b"lane"]),
            deliveries=deliveries,
            enqueued_at=float(h.get(b"enq_at", b"0")),
            started_at=opt_float(b"start_at"),
            finished_at=opt_float(b"end_at"),
            worker=_s(h[b"worker"]) if b"worker" in h else None,
            last_error=_s(h[b"last_error"]) if b"last_error" in h else None,
            cancel_requested=h.get(b"cancel") == b"1",
            result=decode(h[b"result"], JobResult) if b"result" in h else None,
        )

    # -- introspection ---------------------------------------------------------------------
    @_unavailable_on_errors
    async def stats(self, model: str) -> BrokerStats:
        lanes: list[LaneStats] = []
        now = self.clock()
        for lane in self.keys.lanes(model):
            lanes.append(await self._lane_stats(lane, now))
        pipe = self.redis.pipeline(transaction=False)
        pipe.zcard(self.keys.delayed(model))
        pipe.xlen(self.keys.dead_letters(model))
        pipe.hgetall(self.keys.counters(model))
        delayed, dead, counters = await self._execute(pipe)
        return BrokerStats(
            model=model,
            lanes=lanes,
            delayed=int(delayed),
            dead_letters=int(dead),
            fenced_completions=int(counters.get(b"fenced", 0)),
            expired=int(counters.get(b"expired", 0)),
        )

    async def _lane_stats(self, lane: str, now: float) -> LaneStats:
        if not await self.redis.exists(lane):
            return LaneStats(lane=lane, waiting=0, in_flight=0, oldest_waiting_age_s=None)
        groups: Any = await self.redis.xinfo_groups(lane)
        group = next((g for g in groups if _s(g["name"]) == GROUP), None)
        total = int(await self.redis.xlen(lane))
        if group is None:
            return LaneStats(lane=lane, waiting=total, in_flight=0, oldest_waiting_age_s=None)
        pending = int(group["pending"])
        last = _s(group["last-delivered-id"])
        oldest: Any = await self.redis.xrange(lane, min=f"({last}", max="+", count=1)
        age = None
        if oldest:
            age = max(0.0, now - int(_s(oldest[0][0]).split("-")[0]) / 1000)
        return LaneStats(
            lane=lane, waiting=max(0, total - pending), in_flight=pending, oldest_waiting_age_s=age
        )

    @_unavailable_on_errors
    async def dead_letters(self, model: str, count: int = 100) -> list[DeadLetter]:
        rows: Any = await self.redis.xrange(self.keys.dead_letters(model), count=count)
        out = []
        for _, f in rows:
            out.append(
                DeadLetter(
                    job_id=_s(f[b"job"]),
                    lane=_s(f[b"lane"]),
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
    async def heartbeat(self, info: WorkerInfo, ttl_s: float) -> None:
        now = self.clock()
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.worker(info.model, info.consumer), encode(info), px=_ms(ttl_s))
        pipe.zadd(self.keys.workers(info.model), {info.consumer: now + ttl_s})
        pipe.zremrangebyscore(self.keys.workers(info.model), "-inf", now)
        pipe.sadd(self.keys.models(), info.model)
        await self._execute(pipe)

    @_unavailable_on_errors
    async def deregister(self, model: str, consumer: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.worker(model, consumer))
        pipe.zrem(self.keys.workers(model), consumer)
        await self._execute(pipe)

    @_unavailable_on_errors
    async def workers(self, model: str) -> list[WorkerInfo]:
        live: Any = await self.redis.zrangebyscore(self.keys.workers(model), self.clock(), "+inf")
        if not live:
            return []
        blobs: Any = await self.redis.mget([self.keys.worker(model, _s(c)) for c in live])
        return [decode(b, WorkerInfo) for b in blobs if b]

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except (RedisConnectionError, RedisTimeoutError, OSError):
            return False

    async def close(self) -> None:
        await self.redis.aclose()


async def wait_until_ready(broker: RedisBroker, timeout_s: float = 10.0) -> None:
    """Poll PING until the server answers, for processes started alongside their Redis."""
    give_up = time.monotonic() + timeout_s
    while not await broker.ping():
        if time.monotonic() > give_up:
            raise BrokerUnavailable(f"no answer from {broker.settings.url}")
        await asyncio.sleep(0.05)
