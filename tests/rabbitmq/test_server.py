"""The test RabbitMQ node itself: AMQP with the quorum-queue features a queue backend leans on,
and a kill -9 plus restart on the same data that keeps durable messages."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aio_pika
import aio_pika.abc
import pytest
from aio_pika.exceptions import DeliveryError
from pamqp.common import FieldTable

from tests.servers import RabbitServer, alive

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq]


def _quorum(more: FieldTable | None = None) -> FieldTable:
    return {"x-queue-type": "quorum", **(more or {})}


def _listeners(pid: int) -> set[tuple[str, int]]:
    """The TCP (host, port) pairs a process listens on, read from /proc (no ss/netstat)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            addr, port = fields[1].split(":")
            raw = bytes.fromhex(addr)
            if family == socket.AF_INET:
                raw = raw[::-1]
            else:  # four little-endian 32-bit words
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
            found.add((socket.inet_ntop(family, raw), int(port, 16)))
    return found


@pytest.fixture
async def channel(rabbitmq: RabbitServer) -> AsyncIterator[aio_pika.abc.AbstractChannel]:
    connection = await aio_pika.connect(rabbitmq.url)
    async with connection:
        yield await connection.channel(publisher_confirms=True)


@pytest.fixture
def name() -> Iterator[str]:
    yield f"t-{uuid.uuid4().hex[:10]}"


def test_listens_on_loopback_only(rabbitmq: RabbitServer) -> None:
    assert rabbitmq.pid is not None and rabbitmq.epmd_pid is not None
    for pid in (rabbitmq.pid, rabbitmq.epmd_pid):
        listening = _listeners(pid)
        assert listening, pid
        assert {host for host, _ in listening} <= {"127.0.0.1", "::1"}, listening
    assert ("127.0.0.1", rabbitmq.port) in _listeners(rabbitmq.pid)
    assert "rabbit@localhost" in rabbitmq.ctl("status")


async def test_quorum_queue_confirms_refuses_and_delivers(
    channel: aio_pika.abc.AbstractChannel, name: str
) -> None:
    queue = await channel.declare_queue(
        name,
        durable=True,
        arguments=_quorum(
            {"x-delivery-limit": 3, "x-max-length": 2, "x-overflow": "reject-publish"}
        ),
    )
    # RabbitMQ 3.10's quorum queues notice the overflow after the enqueue that crosses the
    # limit: one message beyond x-max-length gets in, the next is refused (classic: exact)
    accepted: list[bytes] = []
    for body in (b"one", b"two", b"three", b"four"):
        try:
            await channel.default_exchange.publish(
                aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key=name,
            )
        except DeliveryError:  # the broker nacked the publish; aio-pika raises on the nack
            break
        accepted.append(body)
    else:
        pytest.fail("a full queue took every publish")
    assert accepted in ([b"one", b"two"], [b"one", b"two", b"three"])
    got = []
    for _ in accepted:
        message = await queue.get(timeout=5)
        assert message is not None
        assert message.headers.get("x-delivery-count", 0) == 0
        got.append(message.body)
        await message.ack()
    assert got == accepted
    assert await queue.get(fail=False) is None
    await queue.delete(if_unused=False, if_empty=False)


async def test_kill_and_restart_keeps_durable_messages(name: str) -> None:
    # a node of its own: killing the session's node would break other tests' connections
    server = RabbitServer()
    try:
        await asyncio.to_thread(server.start)
        url, port, old_pid = server.url, server.port, server.pid
        assert old_pid is not None
        async with await aio_pika.connect(url) as connection:
            channel = await connection.channel(publisher_confirms=True)
            await channel.declare_queue(name, durable=True, arguments=_quorum())
            # else a kill within a second of the declare loses the queue (see sync_metadata)
            await asyncio.to_thread(server.sync_metadata)
            await channel.default_exchange.publish(
                aio_pika.Message(b"kept", delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key=name,
            )
        server.kill()
        assert not alive(old_pid)
        await asyncio.to_thread(server.start)
        assert server.port == port and server.pid != old_pid
        async with await aio_pika.connect(url) as connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(name, durable=True, arguments=_quorum())
            message = await queue.get(timeout=5)
            assert message is not None and message.body == b"kept"
            await message.ack()
    finally:
        epmd_pid = server.epmd_pid
        data_dir = server.data_dir
        await asyncio.to_thread(server.stop)
    assert epmd_pid is not None and not alive(epmd_pid)
    assert not data_dir.exists()
