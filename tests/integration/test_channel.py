"""The broker's own connections: an exchange cut short never leaves its replies to the next one,
and a server restart costs the calls in flight, not the broker."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tests.servers import running_server
from tokenyard.broker import Backend, connect, new_job_id
from tokenyard.broker.redis import connection_of
from tokenyard.broker.redis.channel import Channel
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings
from tokenyard.errors import BrokerUnavailable


@pytest.fixture
async def broker(valkey: EmbeddedServer) -> AsyncIterator[Backend]:
    opened = connect(BrokerSettings(url=valkey.url, prefix=f"ch{uuid.uuid4().hex[:6]}"))
    yield opened
    await opened.close()


def channel_of(broker: Backend) -> Channel:
    channel = connection_of(broker).channel
    assert isinstance(channel, Channel)
    return channel


async def test_a_cancelled_blocking_read_does_not_leak_its_reply(broker: Backend) -> None:
    channel = channel_of(broker)
    stream = f"{broker.settings.prefix}:s"
    read = asyncio.create_task(channel.execute([("XREAD", "BLOCK", 2000, "STREAMS", stream, "$")]))
    await asyncio.sleep(0.1)
    read.cancel()
    with pytest.raises(asyncio.CancelledError):
        await read
    # the entry that would have woken the cancelled read arrives now
    await channel.execute([("XADD", stream, "*", "f", "v")])
    for n in range(20):
        assert await channel.execute([("ECHO", f"m{n}")]) == [f"m{n}".encode()]


async def test_error_replies_come_back_in_place(broker: Backend) -> None:
    ok, bad, missing, after = await channel_of(broker).execute(
        [("ECHO", "a"), ("NOSUCHCOMMAND",), ("EVALSHA", "0" * 40, 0), ("ECHO", "b")]
    )
    assert ok == b"a" and after == b"b"
    assert type(bad) is ResponseError and "NOSUCHCOMMAND" in str(bad).upper()
    assert isinstance(missing, NoScriptError)  # what makes the broker load its scripts


async def test_a_restarted_server_fails_calls_in_flight_then_serves_again() -> None:
    with running_server() as server:
        broker = connect(BrokerSettings(url=server.url))
        job, other = new_job_id("m"), new_job_id("m")
        try:
            assert await broker.queue.read_events_many({job: "0"}) == []
            waiting = asyncio.create_task(broker.queue.read_events_many({job: "$"}, block_s=10.0))
            await asyncio.sleep(0.1)
            await asyncio.to_thread(server.restart)
            with pytest.raises(BrokerUnavailable):
                await asyncio.wait_for(waiting, 10.0)
            # the broken connections were dropped, not pooled: the next calls reconnect
            assert await broker.queue.read_events_many({job: "0"}) == []
            assert await broker.queue.read_events(other) == []
        finally:
            await broker.close()


async def test_an_idle_connection_the_server_closed_is_not_reused(broker: Backend) -> None:
    channel = channel_of(broker)
    [own_id] = await channel.execute([("CLIENT", "ID")])
    await connection_of(broker).client.execute_command("CLIENT", "KILL", "ID", own_id)
    await asyncio.sleep(0.1)  # the close reaches the idle connection
    replies = await asyncio.wait_for(channel.execute([("ECHO", "again")]), 5.0)
    assert replies == [b"again"]


async def test_an_exchange_past_its_deadline_fails_and_the_channel_goes_on(
    broker: Backend,
) -> None:
    channel = channel_of(broker)
    stream = f"{broker.settings.prefix}:s"
    # blocks far longer than its deadline: the watch fails it within a tick or two
    read = channel.execute([("XREAD", "BLOCK", 20_000, "STREAMS", stream, "$")], 0.2)
    with pytest.raises(RedisTimeoutError):
        await asyncio.wait_for(read, 5.0)
    assert await channel.execute([("ECHO", "on")]) == [b"on"]


async def test_no_commands_is_no_exchange(broker: Backend) -> None:
    channel = channel_of(broker)
    assert await asyncio.wait_for(channel.execute([]), 2.0) == []
    assert await channel.execute([("ECHO", "x")]) == [b"x"]


def test_deadlines_hold_on_a_second_event_loop(valkey: EmbeddedServer) -> None:
    broker = connect(BrokerSettings(url=valkey.url, prefix=f"ch{uuid.uuid4().hex[:6]}"))
    channel = connection_of(broker).channel
    assert channel is not None
    stream = f"{broker.settings.prefix}:s"

    async def overdue() -> None:
        read = channel.execute([("XREAD", "BLOCK", 20_000, "STREAMS", stream, "$")], 0.2)
        with pytest.raises(RedisTimeoutError):
            await asyncio.wait_for(read, 5.0)

    asyncio.run(overdue())  # leaves its watch behind on a closed loop
    # an idle connection is left behind too: the next loop opens its own
    assert asyncio.run(channel.execute([("ECHO", "x")])) == [b"x"]
    assert asyncio.run(channel.execute([("ECHO", "y")])) == [b"y"]
    asyncio.run(overdue())
    asyncio.run(broker.close())
