"""The RabbitMQ side of the backend: one lazily (re)opened connection, a confirming channel for
publishes, consumers on channels of their own, channels for basic.get, and the one mapping of
its failures onto tokenyard's errors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage
from aio_pika.exceptions import ChannelPreconditionFailed, DeliveryError

from tokenyard.broker import redacted
from tokenyard.errors import BrokerUnavailable

log = logging.getLogger(__name__)
# aiormq logs a lost or refused connection itself, a traceback each time; the backend reports
# every such failure as BrokerUnavailable, which its callers log once
logging.getLogger("aiormq.connection").setLevel(logging.CRITICAL)

# what a lost or broken connection raises (RuntimeError: aiormq's "closed" state errors)
_TROUBLE = (aiormq.exceptions.AMQPError, OSError, TimeoutError, RuntimeError)
GETTERS = 8  # basic.get channels: how many messages one claim takes at once
TIMEOUT_S = 5.0  # one operation's bound: a broker that answers nothing within it is unavailable
Arguments = Mapping[str, Any]


class Refused(Exception):
    """RabbitMQ refused a publish (nack): the queue is at its length bound (reject-publish)."""

    def __init__(self, queue: str) -> None:
        super().__init__(queue)
        self.queue = queue


class _Clash(Exception):
    """A queue exists with other arguments than a declare asked for (PRECONDITION_FAILED)."""


class AmqpConnection:
    """Every AMQP operation the backend sends. A lost connection is opened again on next use;
    the deliveries the old one held are RabbitMQ's to redeliver."""

    def __init__(self, url: str, heartbeat_s: float = 60.0) -> None:
        self.url = url
        # RabbitMQ closes a connection silent for about two heartbeats and redelivers what it
        # held: a stopped or hung worker gives its deliveries back within about its lease
        query = url.partition("?")[2]
        if any(part.startswith("heartbeat=") for part in query.split("&")):
            self._open_url = url
        else:
            beat = f"heartbeat={max(1, round(heartbeat_s))}"
            self._open_url = f"{url}{'&' if query else '?'}{beat}"
        self._conn: AbstractConnection | None = None
        self._publisher: AbstractChannel | None = None
        # basic.get is synchronous per channel: several let one claim take messages at once
        self._getters: list[AbstractChannel] = []
        self._opening = asyncio.Lock()
        self._declared: set[str] = set()
        self._closing: set[asyncio.Future[None]] = set()
        # which connection this is: a consumer made on an earlier one is gone with it
        self.generation = 0

    async def _channels(self, getters: int = 1) -> tuple[AbstractChannel, list[AbstractChannel]]:
        """The publishing channel and at least `getters` channels for basic.get."""
        async with self._opening:
            conn = self._conn
            if conn is None or not _open(conn):
                self._drop()
                conn = self._conn = await aio_pika.connect(self._open_url, timeout=TIMEOUT_S)
                self.generation += 1
            if self._publisher is None or self._publisher.is_closed:
                self._publisher = await conn.channel(publisher_confirms=True)
            self._getters = [g for g in self._getters if not g.is_closed]
            while len(self._getters) < getters:
                self._getters.append(await conn.channel(publisher_confirms=False))
            return self._publisher, self._getters

    @contextlib.asynccontextmanager
    async def _sent(self, what: str) -> AsyncIterator[None]:
        """Map RabbitMQ's failures: a refused publish to Refused, an argument clash to _Clash,
        anything else of the connection to BrokerUnavailable."""
        try:
            async with asyncio.timeout(TIMEOUT_S):
                yield
        except DeliveryError as exc:
            raise Refused(what) from exc
        except ChannelPreconditionFailed as exc:
            raise _Clash(str(exc)) from exc
        except _TROUBLE as exc:
            # a connection that failed is not trusted again (it may not know it is dead): the
            # next call opens a new one
            self._drop()
            raise BrokerUnavailable(f"RabbitMQ {redacted(self.url)}: {what}: {exc!r}") from exc

    async def declare(self, name: str, arguments: Arguments, again: bool = False) -> None:
        """Declare a durable queue, once per process (`again`: each call, which also tells
        RabbitMQ it is in use, for its `x-expires`). One that exists with other arguments
        (made under other settings) is used as it is, with a warning: the lane bound and the
        delivery limit that count are the tables' (queue.py); RabbitMQ's are a backstop."""
        if name in self._declared and not again:
            return
        try:
            async with self._sent(name):
                _, (channel, *_) = await self._channels()
                await channel.declare_queue(name, durable=True, arguments=dict(arguments))
        except _Clash as clash:
            log.warning(
                "RabbitMQ queue %s exists with other arguments; using it as it is: %s", name, clash
            )
            async with self._sent(name):
                _, (channel, *_) = await self._channels()  # the refusal closed the channel
                await channel.declare_queue(name, passive=True)
        self._declared.add(name)

    def declared(self, name: str) -> bool:
        return name in self._declared

    async def publish(
        self, queue: str, body: bytes, message_id: str, expires_s: float | None = None
    ) -> None:
        """Publish persistently to `queue` and wait for RabbitMQ's confirm; Refused on a nack.
        `expires_s`: the message's TTL (the queue dead-letters it once it is past)."""
        async with self._sent(queue):
            channel, _ = await self._channels()
            message = aio_pika.Message(
                body,
                message_id=message_id,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                expiration=None if expires_s is None else max(1, round(expires_s * 1000)) / 1000,
            )
            await channel.default_exchange.publish(message, routing_key=queue, mandatory=True)

    async def get(
        self, queue: str, most: int = 1, missing_ok: bool = False
    ) -> list[AbstractIncomingMessage]:
        """basic.get up to `most` ready messages, held unacked on this connection: one, then
        as many more as its get-ok said were ready (at most GETTERS at a time, one channel
        each). Empty when the queue had none, or with `missing_ok` when it is not there (its
        refusal closes that getter's channel only, made again on next use)."""
        async with self._sent(queue):
            _, getters = await self._channels()
            try:
                first = await self._get_on(getters[0], queue)
            except aiormq.exceptions.ChannelNotFoundEntity:
                if not missing_ok:
                    raise
                return []
            if first is None:
                return []
            got = [first]
            ready = int(first.message_count or 0)
            while len(got) < most and ready > 0:
                wave = min(most - len(got), ready, GETTERS)
                _, getters = await self._channels(wave)
                more = await asyncio.gather(*(self._get_on(g, queue) for g in getters[:wave]))
                found = [m for m in more if m is not None]
                got += found
                if len(found) < wave:
                    break  # another consumer took the rest
                ready = min(int(m.message_count or 0) for m in found)
            return got

    async def consume(
        self, queue: str, prefetch: int, deliver: Callable[[AbstractIncomingMessage], None]
    ) -> int:
        """A consumer of `queue` on a channel of its own whose prefetch is `prefetch`: RabbitMQ
        pushes it messages while fewer than that are unacked. Returns the connection's
        generation (the consumer lives as long as that connection)."""
        async with self._sent(queue):
            await self._channels()
            assert self._conn is not None
            channel = await self._conn.channel(publisher_confirms=False)
            await channel.set_qos(prefetch_count=prefetch)
            q = await channel.get_queue(queue, ensure=False)

            async def on_message(message: AbstractIncomingMessage) -> None:
                deliver(message)

            await q.consume(on_message, no_ack=False)
            return self.generation

    def alive(self, generation: int) -> bool:
        """Whether the connection of that generation is still the one in use and open."""
        return generation == self.generation and _open(self._conn)

    @staticmethod
    async def _get_on(channel: AbstractChannel, queue: str) -> AbstractIncomingMessage | None:
        q = await channel.get_queue(queue, ensure=False)
        return await q.get(no_ack=False, fail=False, timeout=TIMEOUT_S)

    async def ack(self, message: AbstractIncomingMessage, multiple: bool = False) -> bool:
        """Ack a delivery (`multiple`: and every delivery before it on its channel not acked
        yet); False where it could not be sent (RabbitMQ requeues the delivery with its
        channel): the connection it came on, if still in use, is dropped."""
        try:
            # bounded like every other call: aiormq hands the frame to its writer through a
            # queue of 10 and waits for it to be written, and on a connection whose peer died
            # before aiormq saw it the writer is gone: an ack past those 10 would wait for ever
            async with asyncio.timeout(TIMEOUT_S):
                await message.ack(multiple=multiple)
        except _TROUBLE:  # ChannelInvalidStateError is a RuntimeError
            if self._carries(message):
                # an ack not sent on an open channel holds a place of its consumer's prefetch
                # until the connection goes: let it go now, consumers are made on a new one
                self._drop()
            return False
        return True

    def _carries(self, message: AbstractIncomingMessage) -> bool:
        """Whether `message` came on an open channel of the connection in use."""
        transport = None if self._conn is None else self._conn.transport
        try:
            channel = message.channel
        except RuntimeError:  # its channel is closed: RabbitMQ has the delivery back
            return False
        return transport is not None and channel.connection is transport.connection

    async def ping(self) -> bool:
        try:
            await self._channels()
        except _TROUBLE:
            return False
        return True

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        self._publisher = None
        self._getters = []
        if conn is not None and not conn.is_closed:
            # closed in the background: a dead peer may never answer
            task = asyncio.ensure_future(_quietly_close(conn))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        self._publisher = None
        self._getters = []
        if conn is not None and not conn.is_closed:
            await _quietly_close(conn)


def _open(conn: AbstractConnection | None) -> bool:
    """Whether `conn` is still open: aio_pika marks a connection closed only when it is closed
    from this side, so one that RabbitMQ dropped is told by its aiormq connection."""
    transport = None if conn is None else conn.transport
    return transport is not None and not transport.connection.is_closed


async def _quietly_close(conn: AbstractConnection) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(TIMEOUT_S):
            await conn.close()
