"""The dashboard's series table on every backend: each gateway's points under its own source,
read back in order after a time, and gone once past the table's retention."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.conftest import BackendFactory
from tokenyard.broker.nats.series import NatsSeries
from tokenyard.broker.redis.series import RedisSeries
from tokenyard.broker.tables import SERIES_KEEP_S, Series

pytestmark = pytest.mark.parametrize("make_backend", ["valkey", "nats", "rabbitmq"], indirect=True)


def kept_for(series: Series, keep_s: float) -> Series:
    """The same table with a shorter retention (the backends keep SERIES_KEEP_S)."""
    if isinstance(series, RedisSeries):
        return RedisSeries(series.conn, series.keys, keep_s)
    assert isinstance(series, NatsSeries)
    return NatsSeries(series.conn, series.names, keep_s)


async def test_points_of_every_source_come_back_in_order_after_a_time(
    make_backend: BackendFactory,
) -> None:
    writer, reader = make_backend().series, make_backend().series  # two gateways
    assert SERIES_KEEP_S >= 3600
    assert await reader.since(0.0) == []
    now = time.time()
    for i in range(5):
        await writer.append("gw-a", now - 10 + i, f"a{i}".encode())
        await reader.append("gw-b", now - 10 + i + 0.5, bytes([0, 255, i]))  # any bytes
    found = await reader.since(0.0)
    assert [(s, v) for s, _, v in found] == [
        (s, v)
        for i in range(5)
        for s, v in (("gw-a", f"a{i}".encode()), ("gw-b", bytes([0, 255, i])))
    ]
    assert [t for _, t, _ in found] == sorted(t for _, t, _ in found)
    assert found[0][1] == pytest.approx(now - 10)
    # after a time: by the points' own times, to the millisecond and past it
    later = await writer.since(now - 8)
    assert [t - now for _, t, _ in later] == pytest.approx([-7.5, -7, -6.5, -6, -5.5])
    assert await writer.since(now - 5.5) == []


async def test_many_points_are_read_past_a_page(make_backend: BackendFactory) -> None:
    series = make_backend().series
    now = time.time()
    await asyncio.gather(*(series.append("gw", now - 60 + i * 0.01, b"x") for i in range(1100)))
    assert len(await series.since(0.0)) == 1100


async def test_points_past_the_retention_are_gone(make_backend: BackendFactory) -> None:
    series = kept_for(make_backend().series, 1.0)
    await series.append("gw", time.time(), b"old")
    await asyncio.sleep(1.2)
    await series.append("gw", time.time(), b"new")
    for _ in range(50):  # NATS drops by age on its own timer
        values = [v for _, _, v in await series.since(0.0)]
        if values == [b"new"]:
            break
        await asyncio.sleep(0.1)
    assert values == [b"new"]
