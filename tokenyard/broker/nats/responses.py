"""The response cache's shared tier and stored responses of the NATS backend: entries in
the tables' KV bucket (tables.Bucket), each with a server-side TTL."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import msgspec
import nats.js.errors

from tokenyard.broker.core import Clock
from tokenyard.broker.nats.connection import NatsConnection, sent
from tokenyard.broker.nats.names import Names
from tokenyard.broker.nats.tables import Bucket
from tokenyard.broker.tables import ResponseStore, StoredResponses
from tokenyard.messages import decode, encode

# One KV value indexes a model's cache entries: at most this many, whatever the byte bound.
MAX_CACHED = 10_000


class Cached(msgspec.Struct, array_like=True):
    digest: str  # the entry's key is a digest of it: the value says whose it is
    value: bytes
    until: float


class CacheIndex(msgspec.Struct):
    """A model's cache entries by slot: (when it expires, its size)."""

    entries: dict[str, tuple[float, int]] = msgspec.field(default_factory=dict)


class NatsResponses(ResponseStore):
    """The response cache's shared tier: an entry per digest (its expiry in the value, and
    the server's TTL to drop it), and a per-model index by CAS that keeps the byte bound."""

    def __init__(self, conn: NatsConnection, names: Names, clock: Clock) -> None:
        self.bucket = Bucket(conn, names)
        self.clock = clock

    async def cache_get(self, model: str, digest: str) -> bytes | None:
        raw = await self.bucket.get(Names.cache_entry(model, Names.cache_slot(digest)))
        if raw is None:
            return None
        cached = decode(raw, Cached)
        if cached.digest != digest or cached.until <= self.clock():
            return None
        return cached.value

    async def cache_put(
        self, model: str, digest: str, value: bytes, ttl_s: float, max_bytes: int
    ) -> None:
        size = len(value)
        if size > max_bytes:
            return  # too big for the bound: not stored, nothing evicted for it
        now = self.clock()
        until = now + ttl_s
        slot = Names.cache_slot(digest)
        # the entry first: an index naming it can then always evict it
        await self.bucket.put_expiring(
            Names.cache_entry(model, slot), encode(Cached(digest, value, until)), ttl_s + 1
        )

        def bound(raw: bytes | None) -> tuple[bytes | None, list[str]]:
            index = CacheIndex() if raw is None else decode(raw, CacheIndex)
            # lapsed entries leave the index (the server drops the entries themselves)
            entries = {s: e for s, e in index.entries.items() if e[0] > now and s != slot}
            entries[slot] = (until, size)
            total = sum(e[1] for e in entries.values())
            evicted: list[str] = []
            for victim in sorted(entries, key=lambda s: entries[s][0]):
                if total <= max_bytes and len(entries) <= MAX_CACHED:
                    break
                total -= entries.pop(victim)[1]
                evicted.append(victim)
            return encode(CacheIndex(entries)), evicted

        evicted = await self.bucket.change(Names.cache_index(model), bound)
        await asyncio.gather(*(self.bucket.purge(Names.cache_entry(model, s)) for s in evicted))


class PendingMark(msgspec.Struct, array_like=True):
    """A pending stored response's mark: its id, when it is next due for a look and when its
    record lapses (a rewritten mark lapses with it)."""

    id: str
    due_at: float
    until: float


def _mark(raw: bytes) -> PendingMark:
    try:
        return msgspec.json.decode(raw, type=PendingMark)
    except msgspec.DecodeError:  # a mark written before marks said when: the bare id, due now
        return PendingMark(raw.decode(), 0.0, 0.0)


class NatsStoredResponses(StoredResponses):
    """Stored responses: one KV entry per response, its retention as the entry's server TTL.

    A pending one has a mark, rewritten each time it is deferred. The bucket's stream keeps
    the marks in the order they were last written, and every mark is written due a fixed delay
    after its write (the service's), so that order is the order they fall due: `due` reads from
    the oldest and stops at the first not yet due. A mark out of that order (another gateway's
    clock, another delay) is read late, never lost: those before it fall due first."""

    def __init__(self, conn: NatsConnection, names: Names, clock: Clock) -> None:
        self.bucket = Bucket(conn, names)
        self.conn = conn
        self.clock = clock
        # the revision each mark had when `due` read it: a defer writes over that one only, so
        # a settle (its purge) in between stays
        self._read: dict[str, tuple[int, PendingMark]] = {}

    async def put(self, response_id: str, value: bytes, ttl_s: float, due_at: float) -> None:
        # the record first: a sweep settles a pending id it finds no record for; the mark
        # lapses with the record at the latest
        await self.bucket.put_expiring(Names.stored_response(response_id), value, ttl_s)
        mark = PendingMark(response_id, due_at, self.clock() + ttl_s)
        key = Names.pending_response(response_id)
        await self.bucket.put_expiring(key, msgspec.json.encode(mark), ttl_s)

    async def replace(self, response_id: str, value: bytes, ttl_s: float) -> bool:
        return await self._publish_over(Names.stored_response(response_id), value, ttl_s, None)

    async def _publish_over(
        self, key: str, value: bytes, ttl_s: float, revision: int | None
    ) -> bool:
        """Write over `revision` of `key` (None: over whatever is there, if anything is)."""
        if revision is None:
            raw, revision = await self.bucket.entry(key)
            if raw is None:
                return False
        js = await self.conn.js()
        subject = Names.kv_subject(self.bucket.name, key)
        # over the revision read: a delete in between wins, as Redis's SET XX lets it
        headers = {"Nats-Expected-Last-Subject-Sequence": str(revision)}
        try:
            await sent(
                js.publish(subject, value, headers=headers, msg_ttl=max(1, math.ceil(ttl_s)))
            )
        except nats.js.errors.APIError as exc:
            if exc.err_code not in (10071, 10164):  # wrong last sequence
                raise
            return False
        return True

    async def get(self, response_id: str) -> bytes | None:
        return await self.bucket.get(Names.stored_response(response_id))

    async def delete(self, response_id: str) -> bool:
        await self.settle([response_id])
        key = Names.stored_response(response_id)
        if await self.bucket.get(key) is None:
            return False
        await self.bucket.purge(key)
        return True

    async def due(self, now: float, limit: int) -> list[str]:
        rows = await self.bucket.scan(
            Names.PENDING_RESPONSES, lambda raw: _mark(raw).due_at <= now, limit
        )
        found: list[str] = []
        for revision, raw in rows:
            mark = _mark(raw)
            self._read[mark.id] = (revision, mark)
            found.append(mark.id)
        return found

    async def defer(self, response_ids: Sequence[str], due_at: float) -> None:
        async def one(response_id: str) -> None:
            key = Names.pending_response(response_id)
            read = self._read.pop(response_id, None)
            if read is None:
                raw, revision = await self.bucket.entry(key)
                if raw is None:
                    return  # settled
                read = (revision, _mark(raw))
            revision, mark = read
            # an old mark does not say when its record lapses: it is looked at again in an hour
            until = mark.until or self.clock() + 3600.0
            left = until - self.clock()
            if left <= 0:
                return  # its record lapsed too: the mark's own TTL takes it
            moved = PendingMark(mark.id, due_at, until)
            await self._publish_over(key, msgspec.json.encode(moved), max(left, 1.0), revision)

        await asyncio.gather(*(one(r) for r in response_ids))

    async def settle(self, response_ids: Sequence[str]) -> None:
        for r in response_ids:
            self._read.pop(r, None)
        keys = [Names.pending_response(r) for r in response_ids]
        await asyncio.gather(*(self.bucket.purge(k) for k in keys))

    async def put_part(self, response_id: str, value: bytes, ttl_s: float) -> None:
        await self.bucket.put_expiring(Names.response_part(response_id), value, ttl_s)

    async def part(self, response_id: str) -> bytes | None:
        return await self.bucket.get(Names.response_part(response_id))

    async def delete_part(self, response_id: str) -> None:
        await self.bucket.purge(Names.response_part(response_id))
