"""Plain aio-pika on RabbitMQ: the loop a user would write instead of tokenyard's amqp lanes.

One durable quorum queue. The producer publishes each job persistently on a channel with
publisher confirms and awaits the confirm; the consumer (prefetch --slots) acks each delivery
by hand (`message.ack()`) and says it is done with one unconfirmed publish of the job id to a
queue the producer consumes (no_ack), as the Valkey peers RPUSH theirs. Not in PEERS: those run
on Valkey; bench/rabbitmq_vs_valkey.py runs this one beside tokenyard on the same node.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Sequence
from typing import Any

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractExchange,
    AbstractIncomingMessage,
)

QUEUE = "qo.jobs"
DONE_QUEUE = "qo.done"

SETTINGS: dict[str, Any] = {
    "consumer": "aio-pika queue.consume, prefetch slots, message.ack() each, one process",
    "slots": 256,
    "producer": "await default_exchange.publish (persistent) on a confirming channel, to a "
    "durable quorum queue",
    "done": "unconfirmed publish of the job id to qo.done after the ack",
}
ARGUMENTS: dict[str, Any] = {"x-queue-type": "quorum"}


async def declare(channel: AbstractChannel) -> None:
    await channel.declare_queue(QUEUE, durable=True, arguments=ARGUMENTS)


class AioPikaProducer:
    """A confirmed publish per job; done ids arrive on a queue consumed without acks."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.done: set[str] = set()
        self.waiters: dict[str, asyncio.Future[None]] = {}
        self._conn: AbstractConnection | None = None
        self._exchange: AbstractExchange | None = None

    @property
    def exchange(self) -> AbstractExchange:
        assert self._exchange is not None, "open() first"
        return self._exchange

    async def open(self) -> None:
        self._conn = conn = await aio_pika.connect(self.url)
        channel = await conn.channel(publisher_confirms=True)
        await declare(channel)
        self._exchange = channel.default_exchange
        listen = await conn.channel(publisher_confirms=False)
        done = await listen.declare_queue(DONE_QUEUE, durable=False, auto_delete=True)
        await done.consume(self._on_done, no_ack=True)

    async def _on_done(self, message: AbstractIncomingMessage) -> None:
        job_id = message.body.decode()
        self.done.add(job_id)
        waiter = self.waiters.pop(job_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def enqueue(self, job_id: str) -> None:
        message = aio_pika.Message(job_id.encode(), delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
        await self.exchange.publish(message, routing_key=QUEUE)

    async def wait_done(self, job_id: str, timeout_s: float) -> None:
        if job_id in self.done:
            return
        waiter = self.waiters[job_id] = asyncio.get_running_loop().create_future()
        await asyncio.wait_for(waiter, timeout_s)

    async def done_count(self) -> int:
        return len(self.done)

    async def verify(self, ids: Sequence[str]) -> int:
        return len(self.done & set(ids))

    async def reset(self) -> None:
        self.done.clear()

    def messages_sent(self) -> int | None:
        return None

    def poll_messages(self) -> tuple[int, int]:
        return 0, 0  # done ids are pushed to it

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()


def serve(url: str, settings: dict[str, Any]) -> None:
    """The consumer process: take deliveries, ack, say done; SIGTERM stops it."""

    async def main() -> None:
        conn = await aio_pika.connect(url)
        channel = await conn.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=settings["slots"])
        await declare(channel)
        queue = await channel.get_queue(QUEUE)
        exchange = channel.default_exchange

        async def on_message(message: AbstractIncomingMessage) -> None:
            await message.ack()
            await exchange.publish(aio_pika.Message(message.body), routing_key=DONE_QUEUE)

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await queue.consume(on_message)
        await stop.wait()
        await conn.close()

    asyncio.run(main())
