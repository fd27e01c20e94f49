"""Batch state in NATS KV: the record, a cancel flag, each request's job id and outcome, a
runner lease, the tenant's list and the active set, each an entry of the tables bucket.

Outcomes are two bitmaps (ok, failed) of line numbers, merged by compare-and-set: adding is
idempotent, so a runner that restarts, or two that briefly overlap, never count a request
twice, and counts are population counts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence

import msgspec
import nats.js.errors

from tokenyard.broker.core import Clock
from tokenyard.broker.nats.connection import NatsConnection
from tokenyard.broker.nats.names import Names
from tokenyard.broker.nats.tables import Bucket
from tokenyard.broker.tables import BatchState, BatchStore
from tokenyard.messages import BatchRecord, decode, encode


class Lease(msgspec.Struct, array_like=True):
    owner: str
    until: float


class Outcomes(msgspec.Struct):
    ok: bytes = b""  # bit i set: line i succeeded
    failed: bytes = b""


class Listed(msgspec.Struct, array_like=True):
    at: float  # the precise creation time, not created_at's seconds: the list is newest first
    id: str


def _with(bits: bytes, lines: Iterable[int]) -> bytes:
    out = bytearray(bits)
    for line in lines:
        byte = line >> 3
        if byte >= len(out):
            out.extend(bytes(byte + 1 - len(out)))
        out[byte] |= 1 << (line & 7)
    return bytes(out)


def _lines(bits: bytes) -> set[int]:
    return {i * 8 + b for i, byte in enumerate(bits) if byte for b in range(8) if byte >> b & 1}


def _count(bits: bytes) -> int:
    return int.from_bytes(bits, "little").bit_count()


class NatsBatches(BatchStore):
    def __init__(self, conn: NatsConnection, names: Names, clock: Clock) -> None:
        self.bucket = Bucket(conn, names)
        self.clock = clock

    async def create(self, record: BatchRecord) -> None:
        at = self.clock()

        def listed(raw: bytes | None) -> tuple[bytes | None, None]:
            ids = [] if raw is None else decode(raw, list[Listed])
            if any(item.id == record.id for item in ids):
                return None, None
            return encode([*ids, Listed(at, record.id)]), None

        await asyncio.gather(
            self.bucket.put(Names.batch(record.id), encode(record)),
            self.bucket.change(Names.tenant_batches(record.tenant), listed),
            self._active(record.id, True),
        )

    async def _active(self, batch_id: str, member: bool) -> None:
        def change(raw: bytes | None) -> tuple[bytes | None, None]:
            ids = set() if raw is None else decode(raw, set[str])
            if (batch_id in ids) == member:
                return None, None
            ids = ids | {batch_id} if member else ids - {batch_id}
            return encode(sorted(ids)), None

        await self.bucket.change(Names.ACTIVE_BATCHES, change)

    async def get(self, batch_id: str) -> BatchState | None:
        raw, cancel, outcomes = await asyncio.gather(
            self.bucket.get(Names.batch(batch_id)),
            self.bucket.get(Names.batch(batch_id, "x")),
            self.bucket.get(Names.batch(batch_id, "o")),
        )
        if raw is None:
            return None
        done = Outcomes() if outcomes is None else decode(outcomes, Outcomes)
        record = decode(raw, BatchRecord)
        return BatchState(record, cancel is not None, _count(done.ok), _count(done.failed))

    async def save(self, record: BatchRecord) -> None:
        await self.bucket.put(Names.batch(record.id), encode(record))
        if record.status.terminal:
            await self._active(record.id, False)

    async def request_cancel(self, batch_id: str) -> None:
        await self.bucket.put(Names.batch(batch_id, "x"), encode(self.clock()))

    async def active(self) -> list[str]:
        raw = await self.bucket.get(Names.ACTIVE_BATCHES)
        return [] if raw is None else sorted(decode(raw, list[str]))

    async def list_ids(self, tenant: str) -> list[str]:
        raw = await self.bucket.get(Names.tenant_batches(tenant))
        ids = [] if raw is None else decode(raw, list[Listed])
        return [item.id for item in sorted(ids, key=lambda i: (i.at, i.id), reverse=True)]

    async def acquire(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        key = Names.batch(batch_id, "l")
        while True:
            raw, revision = await self.bucket.entry(key)
            now = self.clock()
            if raw is not None:
                held = decode(raw, Lease)
                if held.owner != owner and held.until > now:
                    return False
            # taken, lapsed or ours: written only over what was read, so two takers of a
            # lapsed lease cannot both win
            try:
                await self.bucket.write(key, encode(Lease(owner, now + ttl_s)), revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
            return True

    async def release(self, batch_id: str, owner: str) -> None:
        key = Names.batch(batch_id, "l")
        raw, revision = await self.bucket.entry(key)
        if raw is not None and decode(raw, Lease).owner == owner:
            await self.bucket.delete(key, revision)

    async def set_jobs(self, batch_id: str, jobs: Mapping[int, str]) -> None:
        if not jobs:
            return

        def merge(raw: bytes | None) -> tuple[bytes | None, None]:
            known = {} if raw is None else decode(raw, dict[int, str])
            return encode(known | dict(jobs)), None

        await self.bucket.change(Names.batch_jobs(batch_id, min(jobs)), merge)

    async def jobs(self, batch_id: str) -> dict[int, str]:
        out: dict[int, str] = {}
        # oldest change first: a line set again later keeps its later job id
        for _, raw in await self.bucket.listing(Names.batch_jobs(batch_id)):
            out |= decode(raw, dict[int, str])
        return out

    async def add_outcomes(self, batch_id: str, ok: Sequence[int], failed: Sequence[int]) -> None:
        if not ok and not failed:
            return

        def add(raw: bytes | None) -> tuple[bytes | None, None]:
            done = Outcomes() if raw is None else decode(raw, Outcomes)
            merged = Outcomes(_with(done.ok, ok), _with(done.failed, failed))
            return (None if merged == done else encode(merged)), None

        await self.bucket.change(Names.batch(batch_id, "o"), add)

    async def outcomes(self, batch_id: str) -> tuple[set[int], set[int]]:
        raw = await self.bucket.get(Names.batch(batch_id, "o"))
        done = Outcomes() if raw is None else decode(raw, Outcomes)
        return _lines(done.ok), _lines(done.failed)
