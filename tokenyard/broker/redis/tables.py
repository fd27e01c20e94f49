"""The tables beside the Redis queue: directory, quotas, audit trail, response cache, worker
registry (the batch store is in batches.py). Each is a small class over the one connection.

Quotas and the audit trail also hand the queue what its terminal paths send in their own round
trip (`RedisQuotas.settle_calls`, `RedisAudit.appends`), so ending a job costs no extra one.
The audit trail mirrors what stood to a sink when one is set (the Kafka audit log).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, TypeVar

from tokenyard.broker import audit
from tokenyard.broker.audit import AuditEntry, AuditSink, Mirrored
from tokenyard.broker.core import Clock
from tokenyard.broker.redis import scripts
from tokenyard.broker.redis.channel import Command
from tokenyard.broker.redis.connection import RedisConnection, ms, text
from tokenyard.broker.redis.keys import Keys
from tokenyard.broker.redis.scripts import Call, Empty
from tokenyard.broker.tables import (
    Audit,
    AuditQuery,
    Directory,
    Quotas,
    ResponseStore,
    Settlement,
    StoredResponses,
    WorkerRegistry,
    settlement,
)
from tokenyard.messages import (
    AdapterRecord,
    Finished,
    JobSpec,
    JobStatus,
    WorkerInfo,
    decode,
    encode,
)
from tokenyard.tenancy.limiter import Decision, Quota, QuotaState
from tokenyard.tenancy.records import ApiKeyRecord, TenantConfig

log = logging.getLogger(__name__)

_SWEEP_BATCH = 500  # held reservations looked at per tenant per sweep
DRAIN_KEPT_S = 3600.0  # a drain request outlives its worker this long (the key's TTL)


_R = TypeVar("_R")  # a record type the directory stores


class RedisDirectory(Directory):
    """Tenants and API keys: one hash each under the `{directory}` tag."""

    def __init__(self, conn: RedisConnection, keys: Keys) -> None:
        self.conn = conn
        self.keys = keys

    async def _one(self, table: str, name: str, kind: type[_R]) -> _R | None:
        raw = await self.conn.one(("HGET", table, name))
        return None if raw is None else decode(raw, kind)

    async def _all(self, table: str, kind: type[_R]) -> list[_R]:
        rows: dict[bytes, bytes] = await self.conn.parsed("HGETALL", table)
        return [decode(raw, kind) for raw in rows.values()]

    async def put_tenant(self, tenant: TenantConfig) -> None:
        await self.conn.one(("HSET", self.keys.tenants(), tenant.name, encode(tenant)))

    async def tenant(self, name: str) -> TenantConfig | None:
        return await self._one(self.keys.tenants(), name, TenantConfig)

    async def tenants(self) -> list[TenantConfig]:
        return sorted(await self._all(self.keys.tenants(), TenantConfig), key=lambda t: t.name)

    async def put_adapter(self, record: AdapterRecord) -> None:
        await self.conn.one(("HSET", self.keys.adapters(), record.name, encode(record)))

    async def adapters(self) -> list[AdapterRecord]:
        return sorted(await self._all(self.keys.adapters(), AdapterRecord), key=lambda a: a.name)

    async def delete_adapter(self, name: str) -> bool:
        return bool(await self.conn.one(("HDEL", self.keys.adapters(), name)))

    async def put_api_key(self, record: ApiKeyRecord) -> None:
        await self.conn.one(("HSET", self.keys.api_keys(), record.digest, encode(record)))

    async def api_key(self, digest: str) -> ApiKeyRecord | None:
        return await self._one(self.keys.api_keys(), digest, ApiKeyRecord)

    async def api_keys(self) -> list[ApiKeyRecord]:
        records = await self._all(self.keys.api_keys(), ApiKeyRecord)
        return sorted(records, key=lambda r: (r.created_at, r.digest))

    async def has_api_keys(self) -> bool:
        return bool(await self.conn.one(("EXISTS", self.keys.api_keys())))


def _decision(quota: Quota, row: list[Any]) -> Decision:
    admitted, reason, retry, rrem, rreset, trem, treset = row
    retry_s = float(text(retry))
    return Decision(
        admitted=admitted == 1,
        reason=text(reason),
        retry_after_s=float("inf") if retry_s < 0 else retry_s,
        requests=(quota.rpm, int(rrem), float(text(rreset))) if quota.rpm else None,
        tokens=(quota.tpm, int(trem), float(text(treset))) if quota.tpm else None,
    )


class RedisQuotas(Quotas):
    """Per-tenant quotas (lua/reserve.lua, settle.lua), each tenant under its own hash tag."""

    def __init__(self, conn: RedisConnection, keys: Keys, clock: Clock) -> None:
        self.conn = conn
        self.keys = keys
        self.clock = clock
        self._sweep_cursor: dict[str, int] = {}

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
        _, reply = await self.conn.pipelined(
            [("SADD", self.keys.quota_tenants(), tenant), self.conn.evalsha(call)]
        )
        rows = (await self.conn.results_of([call], [reply]))[0]
        return [_decision(quota, row) for row in rows]

    async def settle(self, items: Sequence[Settlement]) -> int:
        if not items:
            return 0
        return sum(int(n) for n in await self.conn.eval_many(self.settle_calls(items)))

    def settle_calls(self, items: Sequence[Settlement]) -> list[Call]:
        """The script calls that settle `items`, one per tenant: the queue's terminal paths
        send them in their own round trip."""
        by_tenant: dict[str, list[Settlement]] = defaultdict(list)
        for item in items:
            by_tenant[item.tenant].append(item)
        return [
            scripts.SETTLE.call(
                scripts.QuotaKeys(quota=self.keys.quota(t), held=self.keys.quota_held(t)),
                Empty(),
                [
                    (Empty(), scripts.SettleItemArgs(s.job_id, s.actual, int(s.request)))
                    for s in group
                ],
            )
            for t, group in by_tenant.items()
        ]

    async def settle_finished(self, grace_s: float = 30.0) -> int:
        now = self.clock()
        released = 0
        tenants: set[bytes] = await self.conn.parsed("SMEMBERS", self.keys.quota_tenants())
        for raw_tenant in tenants:
            tenant = text(raw_tenant)
            cursor, held = await self.conn.parsed(
                "HSCAN",
                self.keys.quota_held(tenant),
                self._sweep_cursor.get(tenant, 0),
                "COUNT",
                _SWEEP_BATCH,
            )
            self._sweep_cursor[tenant] = int(cursor)
            if not held:
                continue
            ids = [text(j) for j in held]
            # the jobs' records: reservations end with the job, which the queue's records say
            pipe = self.conn.pipeline()
            for job_id in ids:
                pipe.hmget(self.keys.job(job_id), "status", "result", "spec")
            rows = await self.conn.execute(pipe)
            done: list[Settlement] = []
            for job_id, (status, result, spec) in zip(ids, rows, strict=True):
                reserved_at = float(text(held[job_id.encode()]).split("|")[2])
                if status is None:
                    if now - reserved_at > grace_s:  # its enqueue never landed
                        done.append(Settlement(tenant, job_id, 0, request=True))
                elif JobStatus(text(status)).terminal:
                    finished = decode(result, Finished).result if result else None
                    done.append(settlement(decode(spec, JobSpec), finished))
            released += await self.settle(done)
        return released

    async def usage(self, tenant: str) -> QuotaState | None:
        fields = ("rpm_tat", "tpm_tat", "active", "budget_start", "budget_used")
        row = await self.conn.one(("HMGET", self.keys.quota(tenant), *fields))
        if all(v is None for v in row):
            return None
        rpm, tpm, active, start, used = (float(v) if v is not None else 0.0 for v in row)
        return QuotaState(
            rpm_tat=rpm, tpm_tat=tpm, active=int(active), budget_start=start, budget_used=int(used)
        )


class RedisAudit(Audit, Mirrored):
    """The audit trail: one stream under its own `{audit}` tag, trimmed with MAXLEN ~.

    Its tag keeps it out of the scripts (Cluster), so the queue pipelines `appends` beside the
    scripts whose state change they record.

    With a sink (`mirror_to`), the entries a task wrote are held until that task's next
    `take_back` says which stood, or it writes again; a path that takes nothing back (a dead
    letter, an expiry) is mirrored then or at most `HOLD_S` later. So a sink never sees an
    entry the stream lost again, unless its path took it back later than that."""

    HOLD_S = 5.0

    def __init__(self, conn: RedisConnection, keys: Keys, max_len: int) -> None:
        self.conn = conn
        self.keys = keys
        self.max_len = max_len
        self.sink: AuditSink | None = None
        # per task: until when its last write is held, and that write's (stream id, entry)s
        self._held: dict[asyncio.Task[Any] | None, tuple[float, list[tuple[str, AuditEntry]]]]
        self._held = {}
        self._sweep: tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle] | None = None

    def mirror_to(self, sink: AuditSink) -> None:
        self.sink = sink

    async def flush_mirror(self) -> None:
        for task in list(self._held):
            self._release(task)

    def appends(self, entries: Sequence[AuditEntry]) -> list[Command]:
        """The XADDs that write `entries` (none while the trail is off)."""
        if self.max_len <= 0:
            return []
        key = self.keys.audit()
        return [("XADD", key, "MAXLEN", "~", self.max_len, "*", "e", encode(e)) for e in entries]

    def written(self, entries: Sequence[AuditEntry], replies: Sequence[Any]) -> list[str | None]:
        """Each entry's stream id from its XADD's reply (None where the XADD failed, or the
        trail is off: logged, the state change stands)."""
        if not replies:
            return [None] * len(entries)
        ids: list[str | None] = []
        for entry, reply in zip(entries, replies, strict=True):
            if isinstance(reply, Exception):
                log.error("audit entry of job %s not written: %s", entry.job_id, reply)
                ids.append(None)
            else:
                ids.append(text(reply))
        if self.sink is not None:
            self._hold(entries, ids)
        return ids

    async def write(self, entries: Sequence[AuditEntry]) -> list[str | None]:
        """`entries` in their own round trip, after the state change they record (one that
        needs no script: a preemption's requeue); each entry's stream id as `written`'s."""
        appends = self.appends(entries)
        if not appends:
            return [None] * len(entries)
        return self.written(entries, await self.conn.pipelined(appends))

    async def take_back(self, ids: Sequence[str | None]) -> None:
        """Delete entries whose state change did not happen (a fenced completion, a job that
        was not created): rare paths, so the extra round trip stays off the hot one."""
        found = [i for i in ids if i is not None]
        if self.sink is not None:
            # before any await: the rest of what this task wrote stood
            self._release(asyncio.current_task(), frozenset(found))
        if found:
            await self.conn.one(("XDEL", self.keys.audit(), *found))

    def _hold(self, entries: Sequence[AuditEntry], ids: Sequence[str | None]) -> None:
        task = asyncio.current_task()
        self._release(task)  # what this task wrote before stood: it took nothing back since
        batch = [(i, e) for i, e in zip(ids, entries, strict=True) if i is not None]
        if not batch:
            return
        loop = asyncio.get_running_loop()
        self._held[task] = (loop.time() + self.HOLD_S, batch)
        if self._sweep is None or self._sweep[0] is not loop:  # one timer, not one per write
            self._sweep = (loop, loop.call_later(self.HOLD_S, self._expire))

    def _expire(self) -> None:
        self._sweep = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        for task, (until, _) in list(self._held.items()):
            if until <= now:
                self._release(task)
        if self._held:
            soonest = min(until for until, _ in self._held.values())
            self._sweep = (loop, loop.call_later(max(0.0, soonest - now), self._expire))

    def _release(
        self, task: asyncio.Task[Any] | None, taken_back: frozenset[str] = frozenset()
    ) -> None:
        held = self._held.pop(task, None)
        if held is not None and self.sink is not None:
            stood = [e for i, e in held[1] if i not in taken_back]
            if stood:
                self.sink.offer(stood)

    async def read_audit(self, query: AuditQuery) -> tuple[str | None, list[AuditEntry]]:
        since, tenant, model, cursor, count = query
        # stream ids are the server's ms: `since` starts the range, later filtered exactly
        start = f"({cursor}" if cursor else f"{max(0, int(since * 1000) - 1000)}-0"
        rows: list[tuple[bytes, dict[bytes, bytes]]] = await self.conn.parsed(
            "XRANGE", self.keys.audit(), start, "+", "COUNT", count
        )
        found = [decode(fields[b"e"], AuditEntry) for _, fields in rows]
        found = [e for e in found if audit.matches(e, since, tenant, model)]
        return (text(rows[-1][0]) if len(rows) == count else None), found


class RedisResponses(ResponseStore):
    """The response cache's shared tier: one key per entry, per-model size bound
    (lua/cache_put.lua evicts the soonest to expire)."""

    def __init__(self, conn: RedisConnection, keys: Keys, clock: Clock) -> None:
        self.conn = conn
        self.keys = keys
        self.clock = clock

    async def cache_get(self, model: str, digest: str) -> bytes | None:
        value = await self.conn.parsed("GET", self.keys.cache(model, digest))
        return None if value is None else bytes(value)

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
                ttl_ms=ms(ttl_s),
                now_ms=int(self.clock() * 1000),
                max_bytes=max_bytes,
                entry_prefix=self.keys.cache_prefix(model),
            ),
        )
        await self.conn.run(call)


class RedisStoredResponses(StoredResponses):
    """Stored responses: one key per response, its retention as the key's TTL; the pending
    ones in a sorted set scored by when each is due (ms), and a key per conversation part."""

    def __init__(self, conn: RedisConnection, keys: Keys) -> None:
        self.conn = conn
        self.keys = keys

    async def put(self, response_id: str, value: bytes, ttl_s: float, due_at: float) -> None:
        # the record first: a sweep settles a pending id it finds no record for
        key = self.keys.stored_response(response_id)
        await self.conn.parsed("SET", key, value, "PX", ms(ttl_s))
        await self.conn.parsed("ZADD", self.keys.pending_responses(), ms(due_at), response_id)

    async def replace(self, response_id: str, value: bytes, ttl_s: float) -> bool:
        key = self.keys.stored_response(response_id)
        return await self.conn.parsed("SET", key, value, "PX", ms(ttl_s), "XX") is not None

    async def get(self, response_id: str) -> bytes | None:
        value = await self.conn.parsed("GET", self.keys.stored_response(response_id))
        return None if value is None else bytes(value)

    async def delete(self, response_id: str) -> bool:
        await self.settle([response_id])
        return bool(await self.conn.parsed("DEL", self.keys.stored_response(response_id)))

    async def due(self, now: float, limit: int) -> list[str]:
        found = await self.conn.parsed(
            "ZRANGEBYSCORE", self.keys.pending_responses(), "-inf", ms(now), "LIMIT", 0, limit
        )
        return [text(x) for x in found or ()]

    async def defer(self, response_ids: Sequence[str], due_at: float) -> None:
        if response_ids:
            at = ms(due_at)
            pairs = [part for r in response_ids for part in (at, r)]
            # XX: a settle in between wins
            await self.conn.parsed("ZADD", self.keys.pending_responses(), "XX", *pairs)

    async def settle(self, response_ids: Sequence[str]) -> None:
        if response_ids:
            await self.conn.parsed("ZREM", self.keys.pending_responses(), *response_ids)

    async def put_part(self, response_id: str, value: bytes, ttl_s: float) -> None:
        await self.conn.parsed("SET", self.keys.response_part(response_id), value, "PX", ms(ttl_s))

    async def part(self, response_id: str) -> bytes | None:
        value = await self.conn.parsed("GET", self.keys.response_part(response_id))
        return None if value is None else bytes(value)

    async def delete_part(self, response_id: str) -> None:
        await self.conn.parsed("DEL", self.keys.response_part(response_id))


class RedisRegistry(WorkerRegistry):
    """Live workers: a key per worker with the heartbeat's TTL, and a set per model scored by
    when each lapses."""

    def __init__(self, conn: RedisConnection, keys: Keys, clock: Clock) -> None:
        self.conn = conn
        self.keys = keys
        self.clock = clock

    async def heartbeat(self, info: WorkerInfo, ttl_s: float) -> bool:
        now = self.clock()
        workers = self.keys.workers(info.model)
        me = self.keys.worker(info.model, info.consumer)
        replies = await self.conn.checked(
            [
                ("SET", me, encode(info), "PX", ms(ttl_s)),
                ("ZADD", workers, repr(now + ttl_s), info.consumer),
                ("ZREMRANGEBYSCORE", workers, "-inf", repr(now)),
                ("SADD", self.keys.models(), info.model),
                ("EXISTS", self.keys.drain(info.model, info.consumer)),
            ]
        )
        return bool(replies[-1])

    async def request_drain(self, model: str, consumer: str) -> bool:
        lapses = await self.conn.one(("ZSCORE", self.keys.workers(model), consumer))
        if lapses is None or float(lapses) <= self.clock():
            return False
        # kept a while after the worker leaves; a consumer name is not reused
        await self.conn.one(("SET", self.keys.drain(model, consumer), b"1", "PX", ms(DRAIN_KEPT_S)))
        return True

    async def deregister(self, model: str, consumer: str) -> None:
        await self.conn.checked(
            [
                ("DEL", self.keys.worker(model, consumer)),
                ("ZREM", self.keys.workers(model), consumer),
            ]
        )

    async def workers(self, model: str) -> list[WorkerInfo]:
        live = await self.conn.one(
            ("ZRANGEBYSCORE", self.keys.workers(model), repr(self.clock()), "+inf")
        )
        if not live:
            return []
        blobs = await self.conn.one(("MGET", *(self.keys.worker(model, text(c)) for c in live)))
        return [decode(b, WorkerInfo) for b in blobs if b]
