"""RabbitMQ lanes beyond the conformance suite: what only a queue that keeps its records apart
from its messages must handle."""

from __future__ import annotations

import time

import aio_pika
import pytest

from tests.conftest import BackendFactory
from tests.integration.test_broker_conformance import (
    MODEL,
    dies_before_its_message,
    job,
    ok,
    prefixed,
    run_prefix,
)
from tests.rabbitmq_server import RabbitServer
from tokenyard.broker.amqp import queue as amqp_queue
from tokenyard.broker.amqp.queue import AmqpQueue
from tokenyard.messages import JobStatus, Priority

pytestmark = [
    pytest.mark.rabbitmq,
    pytest.mark.parametrize("make_backend", ["rabbitmq"], indirect=True),
]


async def test_a_resend_publishes_a_job_whose_producer_died_before_its_message(
    make_backend: BackendFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = make_backend()
    queue = broker.queue
    assert isinstance(queue, AmqpQueue)
    first = job(key="k1")
    await dies_before_its_message(queue, first, queue.amqp, "publish", monkeypatch)
    assert await queue.claim(MODEL, "w", slots=1) == []  # no message: nothing would run it

    monkeypatch.setattr(amqp_queue, "RESEND_AFTER_S", 0.0)
    [again] = await queue.enqueue_many([job(key="k1")])  # the client's resend, same key
    assert again.job_id == first.id and not again.created
    [lease] = await queue.claim(MODEL, "w", slots=1)
    assert lease.spec.id == first.id
    assert await queue.complete(lease, ok(lease))


async def test_a_resend_of_a_published_job_adds_no_message(
    make_backend: BackendFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = make_backend().queue
    monkeypatch.setattr(amqp_queue, "RESEND_AFTER_S", 0.0)
    first = await queue.enqueue(job(key="k2"))
    again = await queue.enqueue(job(key="k2"))
    assert again.job_id == first.job_id and not again.created
    leases = await queue.claim(MODEL, "w", slots=5)
    assert [lease.spec.id for lease in leases] == [first.job_id]
    assert await queue.claim(MODEL, "w", slots=5) == []


async def test_a_message_rabbitmq_dead_letters_becomes_a_dead_letter_with_its_reason(
    make_backend: BackendFactory, rabbitmq: RabbitServer
) -> None:
    """Past `x-delivery-limit` returns (holders whose channels died, or a client's nack),
    RabbitMQ moves the message to the model's dead queue; reap records it in the stream."""
    broker = make_backend(max_deliveries=2)
    queue = broker.queue
    assert isinstance(queue, AmqpQueue)
    spec = job()
    await queue.enqueue(spec)
    lane = queue.names.lane(MODEL, spec.priority, spec.pool)
    connection = await aio_pika.connect(rabbitmq.url)
    try:
        channel = await connection.channel()
        raw = await channel.get_queue(lane, ensure=False)
        for _ in range(queue.lanes.delivery_limit + 1):  # returned past the limit, unrun
            message = await raw.get(no_ack=False, timeout=5)
            await message.nack(requeue=True)
        assert await raw.get(no_ack=False, fail=False, timeout=5) is None
    finally:
        await connection.close()
    report = await queue.reap(MODEL)
    assert report.dead == [spec.id]
    [letter] = await queue.dead_letters(MODEL)
    assert letter.job_id == spec.id and letter.reason == "delivery_limit"
    record = await queue.record(spec.id)
    assert record is not None and record.status is JobStatus.DEAD


async def test_a_held_set_naming_a_held_queue_not_there_yet_costs_the_owner_nothing(
    make_backend: BackendFactory,
) -> None:
    """A hold is in the owner's held set before its held queue is declared (admit.lua, then
    the publish): an owner that looks in between gets nothing from that queue, and keeps its
    connection (a refused basic.get closes that channel only) and so its lanes' consumers."""
    broker = make_backend(affinity_wait_s=30.0)
    queue = broker.queue
    assert isinstance(queue, AmqpQueue)
    await run_prefix(broker, "w1")  # w1 owns the prefix: its claims look at its held sets
    lane = queue.keys.lane(MODEL, Priority.NORMAL, 0)
    await queue.conn.one(("ZADD", queue.keys.affinity_worker(lane, "w1"), time.time(), "j-x"))
    before = queue.amqp.generation
    assert await queue.claim(MODEL, "w1", slots=1) == []
    spec = prefixed()
    await queue.enqueue(spec)  # held for w1, in its held queue now there
    [lease] = await queue.claim(MODEL, "w1", slots=1)
    assert lease.spec.id == spec.id and lease.affinity
    assert queue.amqp.generation == before
    assert await queue.complete(lease, ok(lease))


async def test_a_held_job_cancelled_while_waiting_leaves_its_owners_held_set(
    make_backend: BackendFactory,
) -> None:
    """The owner's claim that meets a cancelled held job's message drops it and the job's
    entry in its held set: later claims do not look in that held queue again for it."""
    broker = make_backend(affinity_wait_s=30.0)
    queue = broker.queue
    assert isinstance(queue, AmqpQueue)
    await run_prefix(broker, "w1")
    spec = prefixed()
    await queue.enqueue(spec)
    held = queue.keys.affinity_worker(queue.keys.lane(MODEL, Priority.NORMAL, 0), "w1")
    assert await queue.conn.one(("ZCARD", held)) == 1
    await queue.cancel(spec.id)
    assert await queue.claim(MODEL, "w1", slots=1) == []
    assert await queue.conn.one(("ZCARD", held)) == 0
