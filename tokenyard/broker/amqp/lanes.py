"""RabbitMQ lanes: the queues, what they pushed to this process, and the deliveries its leases
run under.

A quorum queue per (model, priority, pool) bounded with `x-max-length` + `reject-publish` (a
full lane is a 429), `x-delivery-limit` and a dead-letter queue per model for a message whose
holders keep dying; a delay queue per lane and delay for retries. A worker's blocking claim
consumes each lane with prefetch = its capacity: what it runs stays unacked, so RabbitMQ pushes
it at most its free slots (back-pressure). Nothing here reads or writes a job's record: the
queue core (queue.py) decides, by the table's scripts, what each message still speaks for.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections import deque
from collections.abc import Awaitable, Sequence
from typing import NamedTuple

from aio_pika.abc import AbstractIncomingMessage

from tokenyard.broker.amqp.connection import AmqpConnection, Arguments
from tokenyard.broker.amqp.names import Names
from tokenyard.broker.core import Lease
from tokenyard.config import BrokerSettings
from tokenyard.messages import JobSpec, Priority

# A retry waits in the delay queue whose TTL is the first of these at or above its backoff
# (rounded up: never sooner than the backoff asks); each lane has one queue per delay used.
DELAYS_MS = (50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 30_000, 60_000, 120_000)
# A blocked claim looks at the lanes at least this often: a lane whose whole prefetch this
# process holds gets no pushes, so its new messages are found by basic.get only.
WAKE_CAP_S = 1.0
DELIVERY_LIMIT_FACTOR = 4  # RabbitMQ's delivery limit, over tokenyard's (see _lane_args)

_PRIORITIES = list(Priority)  # claim_order's lane indexes, highest priority first


def _delay_ms(delay_s: float) -> int:
    wanted = delay_s * 1000
    return next((d for d in DELAYS_MS if d >= wanted), DELAYS_MS[-1])


def new_msg() -> str:
    """A new message id: the record names the one live message of its job by it."""
    return secrets.token_hex(8)


class Lane:
    """A lane this process consumes: what RabbitMQ pushed that no claim took yet."""

    def __init__(self, name: str, priority: Priority, pool: int) -> None:
        self.name = name
        self.priority = priority
        self.pool = pool
        self.buffer: deque[AbstractIncomingMessage] = deque()
        # pushed and not acked yet (the buffer, and the leases taken from it) by delivery tag,
        # in the order RabbitMQ numbered them on this lane's channel: deliveries let go at its
        # front are acked by one basic.ack (`settle`)
        self.unacked: dict[int, AbstractIncomingMessage] = {}

    def room(self, left: int, batch_left: int) -> int:
        """How many more a claim with `left` free slots takes from here (the batch lane:
        capped)."""
        return min(left, batch_left) if self.priority is Priority.BATCH else left

    def settle(self, tags: set[int]) -> list[tuple[AbstractIncomingMessage, bool]]:
        """Take the deliveries `tags` (unacked here) off; the acks that settle them, each a
        message and whether the ack is `multiple`. Those at the front of the unacked (no
        delivery before them is still held) go in one ack with `multiple`, which RabbitMQ reads
        as "every delivery up to this one": one frame, and one settlement in the quorum queue,
        for a claim's whole batch, not one per job. The others are acked one each."""
        front: list[int] = []
        for tag in self.unacked:
            if tag not in tags:
                break
            front.append(tag)
        acks: list[tuple[AbstractIncomingMessage, bool]] = []
        if len(front) > 1:
            acks.append((self.unacked[front[-1]], True))
            for tag in front:
                del self.unacked[tag]
        acks += [(self.unacked.pop(tag), False) for tag in tags if tag in self.unacked]
        return acks


class Feed:
    """A model's lanes as this process consumes them, each with the same prefetch."""

    def __init__(self, prefetch: int) -> None:
        self.prefetch = prefetch
        self.lanes: dict[tuple[Priority, int], Lane] = {}
        self.arrived = asyncio.Event()
        self.generation = -1  # the AMQP connection its consumers live on


class Delivery(NamedTuple):
    """A message a claim got: from its lane's consumer (`pushed`) or by basic.get."""

    lane: Lane
    message: AbstractIncomingMessage
    pushed: bool
    # when a claim first met it before its job's record, for one held to be asked about again
    # (queue.py `_hold_early`; monotonic); None: met now
    held_since: float | None = None


class _Held(NamedTuple):
    """A delivery a lease of this process runs under, acked when the job is settled."""

    job_id: str
    msg: str
    message: AbstractIncomingMessage
    lane: Lane | None  # the lane whose consumer it came from; None: basic.get


class RabbitLanes:
    """The lanes on one AMQP connection, as this process publishes to and consumes them."""

    def __init__(self, settings: BrokerSettings, amqp: AmqpConnection, names: Names) -> None:
        self.settings = settings
        self.amqp = amqp
        self.names = names
        self._held: dict[str, _Held] = {}  # lease token -> its delivery
        self._token_of: dict[str, str] = {}  # job id -> the token this process holds it under
        self._feeds: dict[str, Feed] = {}  # model -> its lanes' consumers

    # -- queues ----------------------------------------------------------------------------
    @property
    def delivery_limit(self) -> int:
        """RabbitMQ's `x-delivery-limit` on the lanes: a multiple of `max_deliveries`."""
        return DELIVERY_LIMIT_FACTOR * self.settings.max_deliveries

    def _lane_args(self, model: str) -> Arguments:
        return {
            "x-queue-type": "quorum",
            "x-max-length": self.settings.max_queue_depth,
            "x-overflow": "reject-publish",
            # RabbitMQ's own count of returns: past it the message goes to the model's dead
            # queue, which reap() drains into the dead-letter stream. It also counts what a
            # worker was pushed and gave back unrun (its connection closed), so it is a backstop
            # above tokenyard's own count of deliveries (take.lua), not the limit itself
            "x-delivery-limit": self.delivery_limit,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": self.names.dead(model),
            "x-dead-letter-strategy": "at-least-once",
        }

    async def declare(self, model: str) -> None:
        """Declare the model's lanes and dead queue, once per process."""
        dead = self.names.dead(model)
        if self.amqp.declared(dead):
            return
        await self.amqp.declare(dead, {"x-queue-type": "quorum"})
        args = self._lane_args(model)
        for priority in Priority:
            for pool in range(self.settings.pool_count):
                await self.amqp.declare(self.names.lane(model, priority, pool), args)

    async def _delay_queue(self, spec: JobSpec, delay_ms: int) -> str:
        lane = self.names.lane(spec.model, spec.priority, spec.pool)
        name = self.names.delay(lane, delay_ms)
        if not self.amqp.declared(name):
            await self.amqp.declare(
                name,
                {
                    "x-queue-type": "quorum",
                    "x-message-ttl": delay_ms,
                    "x-overflow": "reject-publish",
                    "x-dead-letter-exchange": "",
                    "x-dead-letter-routing-key": lane,
                    "x-dead-letter-strategy": "at-least-once",
                },
            )
        return name

    # -- publishing ------------------------------------------------------------------------
    async def publish(self, spec: JobSpec, job_id: str, msg: str) -> None:
        """Job `job_id`'s message `msg` on `spec`'s lane, confirmed (Refused: the lane is full)."""
        await self.amqp.publish(
            self.names.lane(spec.model, spec.priority, spec.pool), job_id.encode(), msg
        )

    async def publish_after(self, spec: JobSpec, delay_s: float) -> tuple[str, float]:
        """A new message for the job that reaches its lane after at least `delay_s` (through a
        delay queue); its id, and the delay it got."""
        delay_ms = _delay_ms(delay_s)
        msg = new_msg()
        await self.amqp.publish(await self._delay_queue(spec, delay_ms), spec.id.encode(), msg)
        return msg, delay_ms / 1000

    async def republish(self, leases: Sequence[Lease]) -> list[tuple[Lease, str]]:
        """A new message on each lease's lane (confirmed), for a requeue to point the record at."""
        moved = [(lease, new_msg()) for lease in leases]
        await asyncio.gather(
            *(self.publish(lease.spec, lease.spec.id, msg) for lease, msg in moved)
        )
        return moved

    # -- consuming -------------------------------------------------------------------------
    async def feed(self, model: str, pools: Sequence[int], slots: int, block: bool) -> Feed | None:
        """The model's lane consumers (made by the first blocking claim, prefetch = its slots:
        a worker's first claim asks for all of them; made again after a lost connection), or
        None while no blocking claim made them."""
        feed = self._feeds.get(model)
        if not block and feed is None:
            return None
        if feed is not None and feed.lanes and not self.amqp.alive(feed.generation):
            feed = None  # its consumers died with their connection: RabbitMQ redelivers
        if feed is None:
            feed = self._feeds[model] = Feed(max(1, slots))
        for priority in Priority:
            for pool in pools:
                if (priority, pool) in feed.lanes:
                    continue
                lane = Lane(self.names.lane(model, priority, pool), priority, pool)

                def deliver(message: AbstractIncomingMessage, lane: Lane = lane) -> None:
                    lane.buffer.append(message)
                    if message.delivery_tag:  # (a pushed message has one: from 1 up)
                        lane.unacked[message.delivery_tag] = message
                    feed.arrived.set()

                feed.generation = await self.amqp.consume(lane.name, feed.prefetch, deliver)
                feed.lanes[priority, pool] = lane
        return feed

    async def pull(
        self,
        model: str,
        feed: Feed | None,
        order: Sequence[int],
        pools: Sequence[int],
        slots: int,
        batch_room: int | None,
        block: bool,
    ) -> list[Delivery]:
        """At most `slots` messages, lanes in `order` (priority indexes) and each priority's
        `pools`: what was pushed first, then basic.get (slow on quorum queues: one Raft command
        each) only where a push cannot bring more now: a claim that may not `block`, or a lane
        whose whole prefetch this process holds."""
        if feed is not None:
            feed.arrived.clear()  # before the buffers are read: a push after it wakes a wait
        lanes = [
            feed.lanes[_PRIORITIES[p], pool]
            if feed is not None
            else Lane(self.names.lane(model, _PRIORITIES[p], pool), _PRIORITIES[p], pool)
            for p in order
            for pool in pools
        ]
        batch_left = slots if batch_room is None else max(0, batch_room)
        got: list[Delivery] = []
        for lane in lanes:
            while lane.buffer and lane.room(slots - len(got), batch_left) > 0:
                got.append(Delivery(lane, lane.buffer.popleft(), True))
                if lane.priority is Priority.BATCH:
                    batch_left -= 1
        for lane in lanes:
            room = lane.room(slots - len(got), batch_left)
            full = feed is not None and len(lane.unacked) >= feed.prefetch
            if room > 0 and (not block or full):
                pulled = await self.amqp.get(lane.name, room)
                got += [Delivery(lane, message, False) for message in pulled]
                if lane.priority is Priority.BATCH:
                    batch_left -= len(pulled)
        return got

    @staticmethod
    async def wait(feed: Feed, wait_s: float) -> None:
        """Until a push arrives, `wait_s` at most (and `WAKE_CAP_S`: see there)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(feed.arrived.wait(), min(wait_s, WAKE_CAP_S))

    async def dead(self, model: str, count: int) -> list[AbstractIncomingMessage]:
        """Up to `count` messages RabbitMQ dead-lettered on the model's lanes (ack them with
        `ack_dead` once what they speak for is recorded)."""
        return await self.amqp.get(self.names.dead(model), count)

    async def ack_dead(self, messages: Sequence[AbstractIncomingMessage]) -> None:
        await asyncio.gather(*(self.amqp.ack(m) for m in messages))

    # -- deliveries held -------------------------------------------------------------------
    def rehold(self, job_id: str, delivery: Delivery) -> bool:
        """Whether `delivery` is our own running job's message, redelivered after our channel
        dropped: it runs on under the lease it had, now acked by this delivery."""
        msg = delivery.message.message_id or ""
        mine = self._token_of.get(job_id)
        if mine is None or self._held[mine].msg != msg:
            return False
        self._held[mine] = _Held(job_id, msg, delivery.message, _via(delivery))
        return True

    def hold(self, token: str, job_id: str, delivery: Delivery) -> None:
        """A lease `token` now runs under `delivery`, acked when the job is let go."""
        msg = delivery.message.message_id or ""
        self._held[token] = _Held(job_id, msg, delivery.message, _via(delivery))
        self._token_of[job_id] = token

    async def let_go(self, leases: Sequence[Lease]) -> None:
        """Ack the deliveries these leases ran under: the job is settled (or the lease lost).
        A lane's consumer's deliveries are acked together where they can be (`Lane.settle`)."""
        acks: list[Awaitable[object]] = []
        by_lane: dict[Lane, set[int]] = {}
        for lease in leases:
            held = self._held.pop(lease.entry_id, None)
            if held is None:
                continue
            if self._token_of.get(held.job_id) == lease.entry_id:
                del self._token_of[held.job_id]
            tag = held.message.delivery_tag
            if held.lane is not None and tag is not None and tag in held.lane.unacked:
                by_lane.setdefault(held.lane, set()).add(tag)
            else:  # by basic.get: its channel is shared, what it holds unknown here
                acks.append(self._ack(held.message, held.lane))
        for lane, tags in by_lane.items():
            acks += [self.amqp.ack(message, multiple) for message, multiple in lane.settle(tags)]
        await asyncio.gather(*acks)

    async def drop(self, delivery: Delivery) -> None:
        """Ack a delivery no lease runs under (stale, or its job ended)."""
        await self._ack(delivery.message, _via(delivery))

    async def _ack(self, message: AbstractIncomingMessage, lane: Lane | None) -> None:
        """Ack a delivery; one its lane's consumer got frees a place in that prefetch."""
        if lane is not None and message.delivery_tag is not None:
            lane.unacked.pop(message.delivery_tag, None)
        await self.amqp.ack(message)


def _via(delivery: Delivery) -> Lane | None:
    """The lane whose consumer the delivery came from (its prefetch counts it); None: by get."""
    return delivery.lane if delivery.pushed else None
