"""The stored responses table (/v1/responses) on every backend: put, get, replace only what is
there, delete, the TTL the server enforces, the pending ones read by when they fall due, and the
conversation parts."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.conftest import BackendFactory

pytestmark = pytest.mark.parametrize(
    "make_backend", ["valkey", "valkey-cluster", "nats", "rabbitmq"], indirect=True
)


async def test_put_get_replace_delete(make_backend: BackendFactory) -> None:
    table = make_backend().stored_responses
    assert await table.get("resp_a") is None
    assert not await table.replace("resp_a", b"never", 60)  # nothing to replace
    assert await table.get("resp_a") is None
    await table.put("resp_a", b"one", 60, time.time())
    assert await table.get("resp_a") == b"one"
    assert await table.replace("resp_a", b"two", 60)
    assert await table.get("resp_a") == b"two"
    assert await table.delete("resp_a")
    assert not await table.delete("resp_a")
    assert not await table.replace("resp_a", b"three", 60)  # a deleted one stays deleted
    assert await table.get("resp_a") is None


async def test_entries_lapse_after_their_ttl(make_backend: BackendFactory) -> None:
    table = make_backend().stored_responses
    await table.put("resp_short", b"x", 1, time.time())
    await table.put("resp_long", b"y", 60, time.time())
    for _ in range(60):
        if await table.get("resp_short") is None:
            break
        await asyncio.sleep(0.1)
    assert await table.get("resp_short") is None
    assert await table.get("resp_long") == b"y"


async def test_new_records_are_pending_until_settled(make_backend: BackendFactory) -> None:
    table = make_backend().stored_responses
    now = time.time()
    assert await table.due(now, 10) == []
    for i, name in enumerate(("resp_a", "resp_b", "resp_c")):
        await table.put(name, b"x", 60, now - 3 + i)  # due in the order they are stored
    assert await table.due(now, 10) == ["resp_a", "resp_b", "resp_c"]  # the earliest first
    assert await table.due(now, 2) == ["resp_a", "resp_b"]
    assert await table.due(now - 2.5, 10) == ["resp_a"]  # the others are not due yet
    await table.settle(["resp_a"])
    await table.settle([])
    assert await table.replace("resp_b", b"y", 60)  # a rewrite alone settles nothing
    assert await table.delete("resp_c")  # a delete settles
    assert await table.due(now, 10) == ["resp_b"]
    await table.defer(["resp_b"], now + 30)
    await table.defer([], now + 30)
    assert await table.due(now, 10) == []
    assert await table.due(now + 31, 10) == ["resp_b"]
    await table.settle(["resp_b"])
    await table.defer(["resp_b"], now + 40)  # a settled one stays settled
    assert await table.due(now + 60, 10) == []


async def test_the_due_ones_are_read_from_the_front_of_thousands(
    make_backend: BackendFactory,
) -> None:
    """2,000 pending, the first 300 due: a read of 256 due ones finds the earliest, and the
    next read (after those are deferred) the other 44, never one that is not due."""
    table = make_backend().stored_responses
    now = time.time()
    names = [f"resp_{i:04d}" for i in range(2000)]
    for i, name in enumerate(names):
        await table.put(name, b"x", 60, now - 1000 + i)
    at = now - 1000 + 299.5
    first = await table.due(at, 256)
    assert sorted(first) == names[:256]
    await table.defer(first, now + 60)
    assert sorted(await table.due(at, 256)) == names[256:300]


async def test_conversation_parts_outlive_their_record(make_backend: BackendFactory) -> None:
    table = make_backend().stored_responses
    assert await table.part("resp_p") is None
    await table.put("resp_p", b"record", 60, time.time() + 60)
    await table.put_part("resp_p", b"part", 60)
    assert await table.part("resp_p") == b"part"
    assert await table.delete("resp_p")
    assert await table.part("resp_p") == b"part"  # a later response's conversation needs it
    await table.put_part("resp_q", b"other", 60)
    await table.delete_part("resp_q")
    assert await table.part("resp_q") is None
    await table.put_part("resp_p", b"kept", 1)
    for _ in range(60):
        if await table.part("resp_p") is None:
            break
        await asyncio.sleep(0.1)
    assert await table.part("resp_p") is None
