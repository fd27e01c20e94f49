"""The stored responses table (/v1/responses) on every backend: put, get, replace only what is
there, delete, and the TTL the server enforces."""

from __future__ import annotations

import asyncio

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
    await table.put("resp_a", b"one", 60)
    assert await table.get("resp_a") == b"one"
    assert await table.replace("resp_a", b"two", 60)
    assert await table.get("resp_a") == b"two"
    assert await table.delete("resp_a")
    assert not await table.delete("resp_a")
    assert not await table.replace("resp_a", b"three", 60)  # a deleted one stays deleted
    assert await table.get("resp_a") is None


async def test_entries_lapse_after_their_ttl(make_backend: BackendFactory) -> None:
    table = make_backend().stored_responses
    await table.put("resp_short", b"x", 1)
    await table.put("resp_long", b"y", 60)
    for _ in range(60):
        if await table.get("resp_short") is None:
            break
        await asyncio.sleep(0.1)
    assert await table.get("resp_short") is None
    assert await table.get("resp_long") == b"y"


async def test_new_records_are_pending_until_settled(make_backend: BackendFactory) -> None:
    table = make_backend().stored_responses
    assert await table.pending(10) == []
    for name in ("resp_a", "resp_b", "resp_c"):
        await table.put(name, b"x", 60)
    assert sorted(await table.pending(10)) == ["resp_a", "resp_b", "resp_c"]
    assert len(await table.pending(2)) == 2
    await table.settle(["resp_a"])
    await table.settle([])
    assert await table.replace("resp_b", b"y", 60)  # a rewrite alone settles nothing
    assert await table.delete("resp_c")  # a delete settles
    assert await table.pending(10) == ["resp_b"]
