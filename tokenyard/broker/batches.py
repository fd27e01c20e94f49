"""Batch state in the broker: the record, each request's job id and outcome, a runner lease.

Outcomes are two sets (ok, failed) of line numbers: adding is idempotent, so a runner that
restarts, or two that briefly overlap, never count a request twice, and counts are SCARDs.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenyard.broker.base import Broker
from tokenyard.broker.core import Clock
from tokenyard.broker.tables import BatchState, BatchStore
from tokenyard.messages import BatchRecord, decode, encode


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


@dataclass
class _MemBatch:
    record: bytes
    cancel: bool = False
    jobs: dict[int, str] = field(default_factory=dict)
    ok: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    lease: tuple[str, float] | None = None


class MemoryBatchStore:
    """The in-process twin of RedisBatchStore (records kept encoded, as Redis would)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.batches: dict[str, _MemBatch] = {}
        self.by_tenant: dict[str, dict[str, float]] = {}
        self.active_ids: set[str] = set()

    async def create(self, record: BatchRecord) -> None:
        self.batches[record.id] = _MemBatch(encode(record))
        self.by_tenant.setdefault(record.tenant, {})[record.id] = self.clock()
        self.active_ids.add(record.id)

    async def get(self, batch_id: str) -> BatchState | None:
        b = self.batches.get(batch_id)
        if b is None:
            return None
        return BatchState(decode(b.record, BatchRecord), b.cancel, len(b.ok), len(b.failed))

    async def save(self, record: BatchRecord) -> None:
        self.batches[record.id].record = encode(record)
        if record.status.terminal:
            self.active_ids.discard(record.id)

    async def request_cancel(self, batch_id: str) -> None:
        self.batches[batch_id].cancel = True

    async def active(self) -> list[str]:
        return sorted(self.active_ids)

    async def list_ids(self, tenant: str) -> list[str]:
        ids = self.by_tenant.get(tenant, {})
        return sorted(ids, key=lambda i: (ids[i], i), reverse=True)

    async def acquire(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        b = self.batches[batch_id]
        now = self.clock()
        if b.lease is None or b.lease[1] <= now or b.lease[0] == owner:
            b.lease = (owner, now + ttl_s)
            return True
        return False

    async def release(self, batch_id: str, owner: str) -> None:
        b = self.batches[batch_id]
        if b.lease is not None and b.lease[0] == owner:
            b.lease = None

    async def set_jobs(self, batch_id: str, jobs: Mapping[int, str]) -> None:
        self.batches[batch_id].jobs.update(jobs)

    async def jobs(self, batch_id: str) -> dict[int, str]:
        return dict(self.batches[batch_id].jobs)

    async def add_outcomes(self, batch_id: str, ok: Sequence[int], failed: Sequence[int]) -> None:
        b = self.batches[batch_id]
        b.ok.update(ok)
        b.failed.update(failed)

    async def outcomes(self, batch_id: str) -> tuple[set[int], set[int]]:
        b = self.batches[batch_id]
        return set(b.ok), set(b.failed)


_memory_stores: weakref.WeakKeyDictionary[Any, MemoryBatchStore] = weakref.WeakKeyDictionary()


def batch_store(broker: Broker) -> BatchStore:
    """The batch store living in `broker`: its Redis, or beside a memory broker's store."""
    from tokenyard.broker.memory import MemoryBroker

    if isinstance(broker, MemoryBroker):
        store = _memory_stores.get(broker.store)
        if store is None:
            store = _memory_stores[broker.store] = MemoryBatchStore(broker.clock)
        return store
    raise TypeError(f"no batch store for {type(broker).__name__}")
