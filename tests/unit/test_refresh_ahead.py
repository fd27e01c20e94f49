"""The gateway's cached broker reads (injected clock, a fetch the test releases): refreshed in
the background from half their TTL, never answered past it, one read however many callers."""

from __future__ import annotations

import asyncio

import pytest

from tokenyard.errors import BrokerUnavailable
from tokenyard.gateway.refresh import RefreshAhead


class Source:
    """Answers `value` to each read once the test opens `gate`; counts reads."""

    def __init__(self) -> None:
        self.value = "v1"
        self.reads = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail = False

    async def fetch(self, key: str) -> str:
        self.reads += 1
        await self.gate.wait()
        if self.fail:
            raise BrokerUnavailable("down")
        return f"{key}:{self.value}"


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_fresh_then_refreshed_in_the_background_then_waited_for() -> None:
    now = [0.0]
    source = Source()
    cache = RefreshAhead(source.fetch, ttl_s=1.0, clock=lambda: now[0])
    assert await cache.get("k") == "k:v1" and source.reads == 1

    now[0] = 0.4  # fresh: no read
    assert await cache.get("k") == "k:v1" and source.reads == 1

    now[0] = 0.6  # half the TTL: answered at once, one read starts for every caller
    source.value, source.gate = "v2", asyncio.Event()
    answers = await asyncio.gather(*(cache.get("k") for _ in range(10)))
    assert answers == ["k:v1"] * 10 and source.reads == 2
    source.gate.set()
    await settle()
    assert await cache.get("k") == "k:v2" and source.reads == 2  # aged from 0.6

    now[0] = 1.7  # past the TTL: callers wait, and share one read
    source.value, source.gate = "v3", asyncio.Event()
    waiting = [asyncio.ensure_future(cache.get("k")) for _ in range(5)]
    await settle()
    assert not any(w.done() for w in waiting) and source.reads == 3
    source.gate.set()
    assert await asyncio.gather(*waiting) == ["k:v3"] * 5


async def test_a_value_ages_from_before_its_read() -> None:
    now = [0.0]
    source = Source()
    source.gate = asyncio.Event()
    cache = RefreshAhead(source.fetch, ttl_s=1.0, clock=lambda: now[0])
    first = asyncio.ensure_future(cache.get("k"))
    await settle()
    now[0] = 0.8  # the read took 0.8 s: the value is 0.8 s old when it lands
    source.gate.set()
    assert await first == "k:v1"
    now[0] = 1.05
    source.value = "v2"
    assert await cache.get("k") == "k:v2"  # not answered past 1 s after its read began


async def test_keep_on_serves_the_last_value_while_the_broker_is_down() -> None:
    now = [0.0]
    source = Source()
    kept = RefreshAhead(source.fetch, 1.0, lambda: now[0], keep_on=(BrokerUnavailable,))
    strict = RefreshAhead(source.fetch, 1.0, lambda: now[0])
    assert await kept.get("k") == "k:v1" and await strict.get("k") == "k:v1"
    source.fail = True
    now[0] = 0.7  # a background refresh fails quietly: the value stands
    assert await kept.get("k") == "k:v1" and await strict.get("k") == "k:v1"
    await settle()
    now[0] = 5.0
    assert await kept.get("k") == "k:v1"
    with pytest.raises(BrokerUnavailable):
        await strict.get("k")
    with pytest.raises(BrokerUnavailable):
        await kept.get("never-seen")


async def test_distinct_keys_are_bounded() -> None:
    source = Source()
    cache = RefreshAhead(source.fetch, 1.0, lambda: 0.0, max_entries=3)
    for key in "abcd":
        await cache.get(key)
    assert source.reads == 4
    await cache.get("d")  # kept after the cache started over
    await cache.get("a")  # forgotten
    assert source.reads == 5
