"""Batch state in Redis: the record, each request's job id and outcome, a runner lease.

Outcomes are two sets (ok, failed) of line numbers: adding is idempotent, so a runner that
restarts, or two that briefly overlap, never count a request twice, and counts are SCARDs.
A batch's keys share its own `{tag}`; the tenant's list and the active set live beside them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenyard.broker.core import Clock
from tokenyard.broker.redis.channel import Command
from tokenyard.broker.redis.connection import RedisConnection, ms, text
from tokenyard.broker.redis.keys import Keys
from tokenyard.broker.tables import BatchState, BatchStore
from tokenyard.messages import BatchRecord, decode, encode


class RedisBatches(BatchStore):
    def __init__(self, conn: RedisConnection, keys: Keys, clock: Clock) -> None:
        self.conn = conn
        self.keys = keys
        self.clock = clock

    async def create(self, record: BatchRecord) -> None:
        k = self.keys
        await self.conn.checked(
            [
                ("HSET", k.batch(record.id, "rec"), "rec", encode(record)),
                # scored by the precise time, not created_at's seconds: the list is newest first
                ("ZADD", k.tenant_batches(record.tenant), repr(self.clock()), record.id),
                ("SADD", k.active_batches(), record.id),
            ]
        )

    async def get(self, batch_id: str) -> BatchState | None:
        k = self.keys
        (raw, cancel), ok, failed = await self.conn.checked(
            [
                ("HMGET", k.batch(batch_id, "rec"), "rec", "cancel"),
                ("SCARD", k.batch(batch_id, "ok")),
                ("SCARD", k.batch(batch_id, "failed")),
            ]
        )
        if raw is None:
            return None
        return BatchState(decode(raw, BatchRecord), cancel is not None, int(ok), int(failed))

    async def save(self, record: BatchRecord) -> None:
        commands: list[Command] = [
            ("HSET", self.keys.batch(record.id, "rec"), "rec", encode(record))
        ]
        if record.status.terminal:
            commands.append(("SREM", self.keys.active_batches(), record.id))
        await self.conn.checked(commands)

    async def request_cancel(self, batch_id: str) -> None:
        await self.conn.one(("HSET", self.keys.batch(batch_id, "rec"), "cancel", str(self.clock())))

    async def active(self) -> list[str]:
        members = await self.conn.one(("SMEMBERS", self.keys.active_batches()))
        return sorted(text(m) for m in members)

    async def list_ids(self, tenant: str) -> list[str]:
        ids = await self.conn.one(("ZREVRANGE", self.keys.tenant_batches(tenant), 0, -1))
        return [text(i) for i in ids]

    async def acquire(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        key = self.keys.batch(batch_id, "lease")
        if await self.conn.one(("SET", key, owner, "NX", "PX", ms(ttl_s))):
            return True
        # Renewal is check-then-extend, not atomic: a lease that lapses in between may be
        # briefly held twice. That is safe: jobs are enqueued by idempotency key and outcomes
        # are set members, so two runners produce one job and one count per request.
        current = await self.conn.one(("GET", key))
        if current is not None and text(current) == owner:
            await self.conn.one(("PEXPIRE", key, ms(ttl_s)))
            return True
        return False

    async def release(self, batch_id: str, owner: str) -> None:
        key = self.keys.batch(batch_id, "lease")
        current = await self.conn.one(("GET", key))
        if current is not None and text(current) == owner:
            await self.conn.one(("DEL", key))

    async def set_jobs(self, batch_id: str, jobs: Mapping[int, str]) -> None:
        if jobs:
            pairs = [part for i, j in jobs.items() for part in (str(i), j)]
            await self.conn.one(("HSET", self.keys.batch(batch_id, "jobs"), *pairs))

    async def jobs(self, batch_id: str) -> dict[int, str]:
        raw: dict[bytes, bytes] = await self.conn.parsed(
            "HGETALL", self.keys.batch(batch_id, "jobs")
        )
        return {int(i): text(j) for i, j in raw.items()}

    async def add_outcomes(self, batch_id: str, ok: Sequence[int], failed: Sequence[int]) -> None:
        commands: list[Command] = []
        if ok:
            commands.append(("SADD", self.keys.batch(batch_id, "ok"), *ok))
        if failed:
            commands.append(("SADD", self.keys.batch(batch_id, "failed"), *failed))
        if commands:
            await self.conn.checked(commands)

    async def outcomes(self, batch_id: str) -> tuple[set[int], set[int]]:
        ok, failed = await self.conn.checked(
            [
                ("SMEMBERS", self.keys.batch(batch_id, "ok")),
                ("SMEMBERS", self.keys.batch(batch_id, "failed")),
            ]
        )
        return {int(i) for i in ok}, {int(i) for i in failed}
