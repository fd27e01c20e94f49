"""Prefix affinity on RabbitMQ lanes: a job whose prefix key a live worker owns waits in that
worker's own held queue of its lane for at most `affinity_wait_s`, then RabbitMQ hands it over
to the lane itself, where any worker takes it.

The rules are the shared ones: who a job is held for is `policy.hold_for` over the owner the
Valkey table names (`prefix key -> worker`, with a TTL) and that worker's heartbeat; who owns a
prefix after a take is lib/affinity.lua, which the Redis backend's claim runs too (take.lua).
What RabbitMQ adds is the bounded wait: each held message carries the wait as its TTL, and its
held queue dead-letters it (at least once) into the lane once the TTL passed, so a busy, hung
or killed owner keeps nothing longer than the bound, with no process of ours watching.

The owner reads its held queues by basic.get (never a push consumer: a message pushed to a
busy owner would wait for it past the bound), first in each claim, where its held sets in the
table (one per lane, by when each job was held) say something waits; a blocked claim of a
worker that took a prefixed job lately looks every `HELD_POLL_S`. A held queue expires
(`x-expires`) once nobody declared or read it for long: each hold declares it again first,
and its messages are gone (taken, or handed to the lane) long before that.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence

from aio_pika.abc import AbstractIncomingMessage

from tokenyard.broker.amqp.connection import AmqpConnection, Arguments
from tokenyard.broker.amqp.lanes import Delivery, Lane
from tokenyard.broker.amqp.names import Names
from tokenyard.broker.policy import hold_for
from tokenyard.broker.redis.connection import ms, text
from tokenyard.broker.redis.table import OnTable, ValkeyJobTable
from tokenyard.messages import JobSpec, Priority

HELD_POLL_S = 0.05  # a blocked claim of a prefix owner looks at its held sets this often
# a held-set entry this long past the wait is gone from its held queue (taken, or handed to the
# lane and taken there by a take that did not find it: a withdrawn job's); dropped from the set
STALE_AFTER_S = 5.0
HELD_EXPIRES_S = 600.0  # a held queue nobody declared or read for this long is removed

_PRIORITIES = list(Priority)


class Affinity(OnTable):
    """Holding jobs for their prefix's owner, and the owner's taking of them: the owners and
    held sets in the job table, the held queues in RabbitMQ."""

    def __init__(self, table: ValkeyJobTable, amqp: AmqpConnection, names: Names) -> None:
        super().__init__(table)
        self.amqp = amqp
        self.names = names
        # (model, consumer) -> until when (monotonic) it may own prefixes: it took a prefixed
        # job of the model within affinity_ttl_s; only then are its held sets looked at
        self._owning: dict[tuple[str, str], float] = {}

    # -- producing -------------------------------------------------------------------------
    async def holders(self, specs: Sequence[JobSpec]) -> list[str]:
        """Per job, the live worker it is held for ('' none): its prefix's owner, unless that
        one's heartbeat lapsed or `affinity_max_held` already wait for it in the lane (those
        held earlier in this batch counted)."""
        out = [""] * len(specs)
        prefixed = [i for i, spec in enumerate(specs) if spec.prefix_key]
        if not prefixed:
            return out
        owners = await self.conn.checked(
            [
                ("GET", self.keys.prefix_owner_prefix(specs[i].model) + (specs[i].prefix_key or ""))
                for i in prefixed
            ]
        )
        named = [(i, text(o)) for i, o in zip(prefixed, owners, strict=True) if o]
        if not named:
            return out
        now = self.clock()
        fresh = repr(now - self.settings.affinity_wait_s)  # held before: on its way to the lane
        commands: list[tuple[str, ...]] = []
        for i, owner in named:
            lane = self._lane_key(specs[i])
            commands += [
                ("ZSCORE", self.keys.workers(specs[i].model), owner),
                ("ZCOUNT", self.keys.affinity_worker(lane, owner), fresh, "+inf"),
            ]
        replies = await self.conn.checked(commands)
        assigned: dict[tuple[str, str], int] = defaultdict(int)
        for n, (i, owner) in enumerate(named):
            lapses, held = replies[2 * n], int(replies[2 * n + 1] or 0)
            live = lapses is not None and float(text(lapses)) > now
            where = (self._lane_key(specs[i]), owner)
            if hold_for(
                owner if live else None, held + assigned[where], self.settings.affinity_max_held
            ):
                assigned[where] += 1
                out[i] = owner
        return out

    async def publish(self, spec: JobSpec, job_id: str, msg: str, worker: str) -> None:
        """Job `job_id`'s message `msg` in `worker`'s held queue of its lane, confirmed, to
        return to the lane once it waited `affinity_wait_s`."""
        lane = self.names.lane(spec.model, spec.priority, spec.pool)
        queue = self.names.held(lane, worker)
        await self.amqp.declare(queue, self._held_args(lane), again=True)
        await self.amqp.publish(
            queue, job_id.encode(), msg, expires_s=self.settings.affinity_wait_s
        )

    def _held_args(self, lane: str) -> Arguments:
        return {
            "x-queue-type": "quorum",
            "x-expires": ms(max(HELD_EXPIRES_S, 10 * self.settings.affinity_ttl_s)),
            # at-least-once dead-lettering (it needs reject-publish): a message past its wait
            # is in the lane before it leaves here, so a crash between loses no job
            "x-overflow": "reject-publish",
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": lane,
            "x-dead-letter-strategy": "at-least-once",
        }

    # -- consuming -------------------------------------------------------------------------
    async def take_own(
        self,
        model: str,
        consumer: str,
        order: Sequence[int],
        pools: Sequence[int],
        slots: int,
        batch_room: int | None,
    ) -> list[Delivery]:
        """At most `slots` messages held for `consumer` (lanes in `order`, each priority's
        `pools`), by basic.get where its held set says some wait; none unless it owns
        prefixes lately."""
        if slots <= 0 or self._owning.get((model, consumer), 0.0) < time.monotonic():
            return []
        lanes = [(_PRIORITIES[p], pool) for p in order for pool in pools]
        sets = [
            self.keys.affinity_worker(self.keys.lane(model, priority, pool), consumer)
            for priority, pool in lanes
        ]
        stale = repr(self.clock() - self.settings.affinity_wait_s - STALE_AFTER_S)
        commands: list[tuple[str, ...]] = []
        for key in sets:
            commands += [("ZREMRANGEBYSCORE", key, "-inf", stale), ("ZCARD", key)]
        counts = [int(n or 0) for n in (await self.conn.checked(commands))[1::2]]
        batch_left = slots if batch_room is None else max(0, batch_room)
        got: list[Delivery] = []
        for (priority, pool), count in zip(lanes, counts, strict=True):
            queue = self.names.held(self.names.lane(model, priority, pool), consumer)
            lane = Lane(queue, priority, pool)
            room = min(count, lane.room(slots - len(got), batch_left))
            if room <= 0:
                continue
            pulled = await self.amqp.get(queue, room, missing_ok=True)
            got += [Delivery(lane, message, False) for message in pulled]
            if priority is Priority.BATCH:
                batch_left -= len(pulled)
        return got

    def affine(self, model: str, delivery: Delivery) -> bool:
        """Whether a delivery is a held job's: from a held queue, or handed from one to its
        lane after the wait (RabbitMQ names the queue it first left in its headers)."""
        lane = self.names.lane(model, delivery.lane.priority, delivery.lane.pool)
        first = str(_headers(delivery.message).get("x-first-death-queue", ""))
        return Names.held_of(lane, delivery.lane.name) or Names.held_of(lane, first)

    def took_prefix(self, model: str, consumer: str) -> None:
        """`consumer` took a prefixed job of `model`: it may own that prefix now."""
        self._owning[model, consumer] = time.monotonic() + self.settings.affinity_ttl_s

    def poll_s(self, model: str, consumer: str) -> float:
        """How long a blocked claim may wait before it looks at its held sets again."""
        owns = self._owning.get((model, consumer), 0.0) >= time.monotonic()
        return HELD_POLL_S if owns else float("inf")

    def _lane_key(self, spec: JobSpec) -> str:
        return self.keys.lane(spec.model, spec.priority, spec.pool)


def _headers(message: AbstractIncomingMessage) -> dict[str, object]:
    return dict(message.headers or {})
