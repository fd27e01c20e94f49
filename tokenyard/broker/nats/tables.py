"""The tables of the NATS backend: directory, quotas, worker registry (the response cache
and stored responses are in responses.py, the audit trail in audit.py, the batch store in
batches.py).

Every table but the audit trail lives in one KV bucket (`Names.tables_bucket`), each entry
changed by compare-and-set on its revision, so a read-modify-write is as exact across
gateways as a Redis script. The audit trail is a bounded stream.
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TypeVar

import msgspec
import nats.js.errors
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from tokenyard.broker.core import Clock
from tokenyard.broker.nats.connection import (
    NatsConnection,
    kv_change,
    kv_entry,
    kv_write,
    sent,
)
from tokenyard.broker.nats.names import Names
from tokenyard.broker.nats.records import StoredJob, decode_job
from tokenyard.broker.nats.waiting import waiting_job
from tokenyard.broker.tables import (
    Directory,
    Quotas,
    Settlement,
    WorkerRegistry,
    settlement,
)
from tokenyard.messages import AdapterRecord, WorkerInfo, decode, encode
from tokenyard.tenancy.limiter import PERIOD_S, Decision, Quota, QuotaState, admit, settle
from tokenyard.tenancy.records import ApiKeyRecord, TenantConfig

_R = TypeVar("_R")
_PAGE = 256  # entries per batched direct get when listing keys
_SWEEP_BATCH = 500  # job records read at once when sweeping held reservations
# One KV value holds a tenant's held jobs (<= 1 MB, a server's default max payload), so a
# tenant holds at most this many reservations at once; more wait as over a concurrency cap.
MAX_HELD = 10_000
_DELETED = ("DEL", "PURGE")


class Bucket:
    """The tables' KV bucket: reads, writes by compare-and-set, listing by key pattern."""

    def __init__(self, conn: NatsConnection, names: Names) -> None:
        self.conn = conn
        self.names = names
        self.name = names.tables_bucket
        self._kv: KeyValue | None = None

    async def kv(self) -> KeyValue:
        if self._kv is None:
            self._kv = await self._open()
        return self._kv

    async def _open(self) -> KeyValue:
        # listing reads the bucket's stream with batched direct gets, which the stream must
        # allow: made here with them on (NatsConnection.kv makes buckets without)
        js = await self.conn.js()
        try:
            info = await sent(js.stream_info(Names.kv_stream(self.name)))
        except nats.js.errors.NotFoundError:
            config = KeyValueConfig(bucket=self.name, direct=True, replicas=self.conn.replicas)
            await sent(js.create_key_value(config))
        else:
            if not info.config.allow_direct:
                info.config.allow_direct = True
                await sent(js.update_stream(info.config))
        return await self.conn.kv(self.name)

    async def entry(self, key: str) -> tuple[bytes | None, int]:
        """The value (None: absent or deleted) and the revision to change it from."""
        return await kv_entry(await self.kv(), key)

    async def get(self, key: str) -> bytes | None:
        return (await self.entry(key))[0]

    async def put(self, key: str, value: bytes) -> None:
        kv = await self.kv()
        await sent(kv.put(key, value))

    async def write(self, key: str, value: bytes, revision: int) -> None:
        """Write only over `revision` (0: only where nothing is); KeyWrongLastSequenceError
        when another write came first."""
        await kv_write(await self.kv(), key, value, revision)

    async def change(self, key: str, fn: Callable[[bytes | None], tuple[bytes | None, _R]]) -> _R:
        """Read-modify-write by compare-and-set (connection.kv_change)."""
        return await kv_change(await self.kv(), key, fn)

    async def delete(self, key: str, revision: int = 0) -> None:
        """Delete (only at `revision`, when given): a conflict is left to its winner."""
        kv = await self.kv()
        try:
            await sent(kv.delete(key, last=revision or None))
        except nats.js.errors.KeyWrongLastSequenceError:
            pass
        except nats.js.errors.APIError as exc:
            if exc.err_code not in (10071, 10164):  # wrong last sequence, as a bare APIError
                raise

    async def purge(self, key: str) -> None:
        """Remove a key; its marker lapses too (the key's name is not kept)."""
        kv = await self.kv()
        await sent(kv.purge(key, msg_ttl=1))

    async def put_expiring(self, key: str, value: bytes, ttl_s: float) -> None:
        """Overwrite with a server-side TTL: the server drops the entry once it lapses."""
        await self.kv()
        js = await self.conn.js()
        subject = Names.kv_subject(self.name, key)
        await sent(js.publish(subject, value, msg_ttl=max(1, math.ceil(ttl_s))))

    async def scan(
        self, pattern: str, take: Callable[[bytes], bool], limit: int
    ) -> list[tuple[int, bytes]]:
        """(revision, value) of live keys matching `pattern`, oldest change first, up to
        `limit` or the first whose value `take` refuses: a read of what is at the front."""
        await self.kv()
        stream = Names.kv_stream(self.name)
        subject = Names.kv_subject(self.name, pattern)
        out: list[tuple[int, bytes]] = []
        after = 0
        while len(out) < limit:
            rows = await self.conn.get_batch(stream, subject, after, min(_PAGE, limit))
            for seq, data, headers in rows:
                if headers.get("KV-Operation") in _DELETED:
                    continue
                if not take(data):
                    return out
                out.append((seq, data))
                if len(out) == limit:
                    return out
            if len(rows) < min(_PAGE, limit):
                return out
            after = rows[-1][0]
        return out

    async def listing(self, pattern: str) -> list[tuple[str, bytes]]:
        """(key, value) of every live key matching `pattern`, oldest change first."""
        await self.kv()
        stream = Names.kv_stream(self.name)
        prefix = Names.kv_subject(self.name, "")
        subject = Names.kv_subject(self.name, pattern)
        out: list[tuple[str, bytes]] = []
        after = 0
        while True:
            rows = await self.conn.get_batch(stream, subject, after, _PAGE)
            for _, data, headers in rows:
                if headers.get("KV-Operation") not in _DELETED:
                    out.append((headers["Nats-Subject"].removeprefix(prefix), data))
            if len(rows) < _PAGE:
                return out
            after = rows[-1][0]


class NatsDirectory(Directory):
    """Tenants and API keys: one entry each."""

    def __init__(self, conn: NatsConnection, names: Names, clock: Clock) -> None:
        self.bucket = Bucket(conn, names)
        self.clock = clock

    async def put_tenant(self, tenant: TenantConfig) -> None:
        await self.bucket.put(Names.tenant(tenant.name), encode(tenant))

    async def _named(
        self, key: str, kind: type[_R], name_of: Callable[[_R], str], name: str
    ) -> _R | None:
        """The record under `key` if it is `name`'s: a digest names the entry (two names may
        share one), the record says whose it is."""
        raw = await self.bucket.get(key)
        found = None if raw is None else decode(raw, kind)
        return found if found is not None and name_of(found) == name else None

    async def _all(self, pattern: str, kind: type[_R]) -> list[_R]:
        return [decode(raw, kind) for _, raw in await self.bucket.listing(pattern)]

    async def tenant(self, name: str) -> TenantConfig | None:
        return await self._named(Names.tenant(name), TenantConfig, lambda t: t.name, name)

    async def tenants(self) -> list[TenantConfig]:
        return sorted(await self._all(Names.ALL_TENANTS, TenantConfig), key=lambda t: t.name)

    async def put_adapter(self, record: AdapterRecord) -> None:
        await self.bucket.put(Names.adapter(record.name), encode(record))

    async def adapters(self) -> list[AdapterRecord]:
        return sorted(await self._all(Names.ALL_ADAPTERS, AdapterRecord), key=lambda a: a.name)

    async def delete_adapter(self, name: str) -> bool:
        key = Names.adapter(name)
        if await self.bucket.get(key) is None:
            return False
        await self.bucket.delete(key)
        return True

    async def put_api_key(self, record: ApiKeyRecord) -> None:
        await self.bucket.put(Names.api_key(record.digest), encode(record))

    async def api_key(self, digest: str) -> ApiKeyRecord | None:
        return await self._named(Names.api_key(digest), ApiKeyRecord, lambda r: r.digest, digest)

    async def api_keys(self) -> list[ApiKeyRecord]:
        records = await self._all(Names.ALL_API_KEYS, ApiKeyRecord)
        return sorted(records, key=lambda r: (r.created_at, r.digest))

    async def has_api_keys(self) -> bool:
        # keys are replaced (revoked), never deleted: the first one found answers
        await self.bucket.kv()
        stream = Names.kv_stream(self.bucket.name)
        subject = Names.kv_subject(self.bucket.name, Names.ALL_API_KEYS)
        return bool(await self.bucket.conn.get_batch(stream, subject, 0, 1))


class Held(msgspec.Struct, array_like=True, frozen=True):
    """One admitted job's reservation, as reserve.lua keeps it in Redis."""

    tokens: int
    per_token: float  # the tokens limiter's seconds per token when reserved (0: no tpm)
    at: float  # when it was reserved
    budget_start: float | None  # the budget period it counts in (None: no budget)
    per_request: float = 0.0  # the requests limiter's seconds per request (0: no rpm)


class QuotaEntry(msgspec.Struct):
    """A tenant's quota state and held reservations: one KV entry, changed by CAS."""

    tenant: str
    state: QuotaState = msgspec.field(default_factory=QuotaState)
    held: dict[str, Held] = msgspec.field(default_factory=dict)


class NatsQuotas(Quotas):
    """Per-tenant quotas: tenancy/limiter.py's rules applied to one entry per tenant by CAS,
    a tenant's whole list of jobs decided in one write."""

    def __init__(self, conn: NatsConnection, names: Names, clock: Clock, pool_count: int) -> None:
        self.conn = conn
        self.names = names
        self.bucket = Bucket(conn, names)
        self.clock = clock
        self.pool_count = pool_count  # the lanes a queued job's message may wait in
        self._jobs: KeyValue | None = None

    async def reserve(
        self, tenant: str, quota: Quota, items: Sequence[tuple[str, int]]
    ) -> list[Decision]:
        if not items:
            return []
        capped = quota
        if not 0 < quota.max_concurrent <= MAX_HELD:
            capped = msgspec.structs.replace(quota, max_concurrent=MAX_HELD)
        per_token = PERIOD_S / quota.tpm if quota.tpm else 0.0
        per_request = PERIOD_S / quota.rpm if quota.rpm else 0.0

        def decide(raw: bytes | None) -> tuple[bytes | None, list[Decision]]:
            entry = QuotaEntry(tenant) if raw is None else decode(raw, QuotaEntry)
            now = self.clock()
            decisions = []
            for job_id, tokens in items:
                decision = admit(entry.state, capped, tokens, now)
                if decision.admitted:
                    start = entry.state.budget_start if quota.token_budget else None
                    entry.held[job_id] = Held(tokens, per_token, now, start, per_request)
                decisions.append(decision)
            # a refusal takes nothing: no write when nothing was admitted
            changed = any(d.admitted for d in decisions)
            return (encode(entry) if changed else None), decisions

        return await self.bucket.change(Names.quota(tenant), decide)

    async def settle(self, items: Sequence[Settlement]) -> int:
        if not items:
            return 0
        by_tenant: dict[str, list[Settlement]] = defaultdict(list)
        for item in items:
            by_tenant[item.tenant].append(item)
        counts = await asyncio.gather(*(self._settle(t, g) for t, g in by_tenant.items()))
        return sum(counts)

    async def _settle(self, tenant: str, items: list[Settlement]) -> int:
        def release(raw: bytes | None) -> tuple[bytes | None, int]:
            if raw is None:
                return None, 0
            entry = decode(raw, QuotaEntry)
            released = 0
            for item in items:
                # only the write that removes a held job changes the counters: idempotent
                held = entry.held.pop(item.job_id, None)
                if held is None:
                    continue
                released += 1
                settle(
                    entry.state,
                    held.per_token,
                    held.tokens,
                    item.actual,
                    held.budget_start,
                    held.per_request if item.request else 0.0,
                )
            return (encode(entry) if released else None), released

        return await self.bucket.change(Names.quota(tenant), release)

    async def settle_finished(self, grace_s: float = 30.0) -> int:
        now = self.clock()
        rows = await self.bucket.listing(Names.ALL_QUOTAS)
        jobs = await self._job_records()
        done: list[Settlement] = []
        for _, raw in rows:
            entry = decode(raw, QuotaEntry)
            ids = list(entry.held)
            for start in range(0, len(ids), _SWEEP_BATCH):
                chunk = ids[start : start + _SWEEP_BATCH]
                # reservations end with the job, which the queue's records say
                records = await asyncio.gather(*(self._job(jobs, j) for j in chunk))
                for job_id, record in zip(chunk, records, strict=True):
                    if record is None:
                        if now - entry.held[job_id].at > grace_s:  # its enqueue never landed
                            done.append(Settlement(entry.tenant, job_id, 0, request=True))
                    elif record.terminal:
                        done.append(settlement(record.spec, record.result))
        return await self.settle(done)

    async def usage(self, tenant: str) -> QuotaState | None:
        raw = await self.bucket.get(Names.quota(tenant))
        return None if raw is None else decode(raw, QuotaEntry).state

    async def _job(self, jobs: KeyValue | None, job_id: str) -> StoredJob | None:
        """A job's record; a queued job's lane message while it has none (waiting.py)."""
        if jobs is None:
            return None
        try:
            key = Names.job(job_id)
        except ValueError:
            return None  # not a job id: no enqueue of it can ever land
        for last in (False, True):
            try:
                found = await sent(jobs.get(key))
                return None if found.value is None else decode_job(found.value)
            except nats.js.errors.KeyNotFoundError:
                pass
            if last:
                return None
            waiting = await waiting_job(self.conn, self.names, self.pool_count, job_id)
            if waiting is not None:
                return waiting
        return None  # taken between the reads, its record written first: read again above

    async def _job_records(self) -> KeyValue | None:
        """The queue's bucket of job records, None before the queue made it: looked up, never
        made here, so the queue's own settings (its records' TTL) are the ones it gets."""
        if self._jobs is None:
            js = await self.conn.js()
            try:
                self._jobs = await sent(js.key_value(self.names.jobs_bucket))
            except nats.js.errors.BucketNotFoundError:
                return None
        return self._jobs


class Live(msgspec.Struct, array_like=True):
    info: WorkerInfo
    until: float  # when its heartbeat lapses
    drain: bool = False  # an operator asked it to drain (`request_drain`)


class LiveWorkers(msgspec.Struct):
    """A model's workers by consumer: one entry per model, changed by CAS."""

    workers: dict[str, Live] = msgspec.field(default_factory=dict)


class NatsRegistry(WorkerRegistry):
    """Live workers: one entry per model holding each worker with when it lapses; lapsed
    ones are dropped by the next write."""

    def __init__(self, conn: NatsConnection, names: Names, clock: Clock) -> None:
        self.bucket = Bucket(conn, names)
        self.clock = clock

    @staticmethod
    def _drop_lapsed(live: LiveWorkers, now: float) -> bool:
        """Drop the workers whose heartbeat lapsed; whether there were any."""
        before = len(live.workers)
        live.workers = {c: w for c, w in live.workers.items() if w.until > now}
        return len(live.workers) < before

    async def heartbeat(self, info: WorkerInfo, ttl_s: float) -> bool:
        def beat(raw: bytes | None) -> tuple[bytes | None, bool]:
            now = self.clock()
            live = LiveWorkers() if raw is None else decode(raw, LiveWorkers)
            self._drop_lapsed(live, now)
            was = live.workers.get(info.consumer)
            drain = was is not None and was.drain
            live.workers[info.consumer] = Live(info, now + ttl_s, drain)
            return encode(live), drain

        return await self.bucket.change(Names.workers(info.model), beat)

    async def request_drain(self, model: str, consumer: str) -> bool:
        def ask(raw: bytes | None) -> tuple[bytes | None, bool]:
            if raw is None:
                return None, False
            live = decode(raw, LiveWorkers)
            self._drop_lapsed(live, self.clock())
            worker = live.workers.get(consumer)
            if worker is None:
                return None, False
            worker.drain = True
            return encode(live), True

        return await self.bucket.change(Names.workers(model), ask)

    async def deregister(self, model: str, consumer: str) -> None:
        def leave(raw: bytes | None) -> tuple[bytes | None, None]:
            if raw is None:
                return None, None
            live = decode(raw, LiveWorkers)
            lapsed = self._drop_lapsed(live, self.clock())
            gone = live.workers.pop(consumer, None) is not None
            return (encode(live) if lapsed or gone else None), None

        await self.bucket.change(Names.workers(model), leave)

    async def workers(self, model: str) -> list[WorkerInfo]:
        raw = await self.bucket.get(Names.workers(model))
        if raw is None:
            return []
        live = decode(raw, LiveWorkers)
        if self._drop_lapsed(live, self.clock()):
            # lapsed ones leave now rather than at the model's next heartbeat
            def forget(raw: bytes | None) -> tuple[bytes | None, None]:
                if raw is None:
                    return None, None
                stored = decode(raw, LiveWorkers)
                return (encode(stored) if self._drop_lapsed(stored, self.clock()) else None), None

            await self.bucket.change(Names.workers(model), forget)
        return [w.info for w in sorted(live.workers.values(), key=lambda w: w.until)]
