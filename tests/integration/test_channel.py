"""The broker's own connections: an exchange cut short never leaves its replies to the next one,
and a server restart costs the calls in flight, not the broker."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from tests.servers import running_server
from tokenyard.broker import new_job_id
from tokenyard.broker.channel import Channel
from tokenyard.broker.embedded import EmbeddedServer
from tokenyard.broker.redis import RedisBroker
from tokenyard.config import BrokerSettings
from tokenyard.errors import BrokerUnavailable


async def test_a_cancelled_blocking_read_does_not_leak_its_reply(valkey: EmbeddedServer) -> None:
    broker = RedisBroker(BrokerSettings(url=valkey.url, prefix=f"ch{uuid.uuid4().hex[:6]}"))
    channel = broker._channel
    assert isinstance(channel, Channel)
    try:
        stream = f"{broker.settings.prefix}:s"
        read = asyncio.create_task(
            channel.execute([("XREAD", "BLOCK", 2000, "STREAMS", stream, "$")])
        )
        await asyncio.sleep(0.1)
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        # the entry that would have woken the cancelled read arrives now
        await channel.execute([("XADD", stream, "*", "f", "v")])
        for n in range(20):
            assert await channel.execute([("ECHO", f"m{n}")]) == [f"m{n}".encode()]
    finally:
        await broker.close()


async def test_error_replies_come_back_in_place(valkey: EmbeddedServer) -> None:
    broker = RedisBroker(BrokerSettings(url=valkey.url))
    assert broker._channel is not None
    try:
        ok, bad, after = await broker._channel.execute(
            [("ECHO", "a"), ("NOSUCHCOMMAND",), ("ECHO", "b")]
        )
        assert ok == b"a" and isinstance(bad, Exception) and after == b"b"
    finally:
        await broker.close()


async def test_a_restarted_server_fails_calls_in_flight_then_serves_again() -> None:
    with running_server() as server:
        broker = RedisBroker(BrokerSettings(url=server.url))
        job, other = new_job_id("m"), new_job_id("m")
        try:
            assert await broker.read_events_many({job: "0"}) == []
            waiting = asyncio.create_task(broker.read_events_many({job: "$"}, block_s=10.0))
            await asyncio.sleep(0.1)
            await asyncio.to_thread(server.restart)
            with pytest.raises(BrokerUnavailable):
                await asyncio.wait_for(waiting, 10.0)
            # the broken connections were dropped, not pooled: the next calls reconnect
            assert await broker.read_events_many({job: "0"}) == []
            assert await broker.read_events(other) == []
        finally:
            await broker.close()
