"""The RabbitMQ side of the lanes' backend (tokenyard/broker/amqp/connection.py) when its
connection breaks under it."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aio_pika.abc import AbstractIncomingMessage

from tests.netfault import Relay
from tests.rabbitmq_server import RabbitServer
from tokenyard.broker.amqp.connection import TIMEOUT_S, AmqpConnection

pytestmark = pytest.mark.rabbitmq

HELD = 40  # deliveries held at the break: more than aiormq's 10-frame write queue


async def test_acks_on_a_connection_that_died_unseen_come_back(rabbitmq: RabbitServer) -> None:
    """A worker that completes jobs just as its connection dies acks their deliveries before
    aiormq has seen the loss: each ack must come back (False: RabbitMQ requeues them), not wait
    for a writer that is gone and hold the worker's slots for good."""
    assert rabbitmq.port is not None
    with Relay(rabbitmq.port) as relay:
        amqp = AmqpConnection(f"amqp://guest:guest@127.0.0.1:{relay.port}/")
        name = f"acks-{uuid.uuid4().hex[:8]}"
        try:
            await amqp.declare(name, {"x-queue-type": "quorum"})
            for i in range(HELD):
                await amqp.publish(name, b"job", str(i))
            held: list[AbstractIncomingMessage] = []
            generation = await amqp.consume(name, HELD, held.append)
            deadline = time.monotonic() + 10
            while len(held) < HELD and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert len(held) == HELD

            relay.sever(0.0)
            # the loop stays blocked while the relay cuts the sockets: the acks are written to a
            # connection that is gone before its reader saw the end
            time.sleep(0.2)
            acks = await asyncio.wait_for(
                asyncio.gather(*(amqp.ack(message) for message in held)), 2 * TIMEOUT_S + 1
            )
            # the writer may take a first frame or so before it fails; the rest are not sent
            assert acks.count(False) >= HELD - 10
            # the lanes' consumers are made again: their connection is known to be gone
            assert not amqp.alive(generation)
            # none reached RabbitMQ: a new connection finds every delivery back on the queue
            back: list[AbstractIncomingMessage] = []
            deadline = time.monotonic() + 10
            while len(back) < HELD and time.monotonic() < deadline:
                back += await amqp.get(name, HELD - len(back))
            assert sorted(int(m.message_id or "") for m in back) == list(range(HELD))
        finally:
            await amqp.close()
