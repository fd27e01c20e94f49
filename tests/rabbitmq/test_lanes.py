"""RabbitMQ lanes beyond the conformance suite: what only a queue that keeps its records apart
from its messages must handle."""

from __future__ import annotations

import asyncio
import time
from typing import Any

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
from tokenyard.errors import BrokerUnavailable, QueueFull
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

    # the client's resend, same key, at once: it may be the only one (a batch runner taking
    # over from a killed gateway resends each line once, within a second or two)
    [again] = await queue.enqueue_many([job(key="k1")])
    assert again.job_id == first.id and not again.created
    [lease] = await queue.claim(MODEL, "w", slots=1)
    assert lease.spec.id == first.id
    assert await queue.complete(lease, ok(lease))


async def test_a_reap_publishes_a_keyed_job_whose_producer_died_and_that_no_resend_finished(
    make_backend: BackendFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the client's resend the job would wait unrun for good, counted in its lane's
    depth and oldest age (the look-out, the autoscaler and alerts read those)."""
    broker = make_backend()
    queue = broker.queue
    assert isinstance(queue, AmqpQueue)
    first = job(key="k3")
    await dies_before_its_message(queue, first, queue.amqp, "publish", monkeypatch)
    await queue.reap(MODEL)  # too young: its producer may still be publishing it
    assert await queue.claim(MODEL, "w", slots=1) == []
    assert await queue.depth(MODEL) == 1

    monkeypatch.setattr(amqp_queue, "ORPHAN_AFTER_S", 0.0)
    await queue.reap(MODEL)
    [lease] = await queue.claim(MODEL, "w", slots=1, block_s=5.0)
    assert lease.spec.id == first.id
    assert await queue.complete(lease, ok(lease))
    await queue.reap(MODEL)  # published, taken and ended: not published again
    assert await queue.claim(MODEL, "w", slots=5, block_s=0.3) == []
    assert await queue.depth(MODEL) == 0


async def test_a_reap_leaves_keyed_jobs_whose_publish_was_confirmed(
    make_backend: BackendFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = make_backend().queue
    assert isinstance(queue, AmqpQueue)
    monkeypatch.setattr(amqp_queue, "ORPHAN_AFTER_S", 0.0)
    made = [await queue.enqueue(job(key=f"k4-{i}")) for i in range(3)]
    await queue.reap(MODEL)
    leases = await queue.claim(MODEL, "w", slots=10, block_s=5.0)
    while len(leases) < 3:
        more = await queue.claim(MODEL, "w", slots=10, block_s=1.0)
        assert more, "a confirmed job's message went missing"
        leases += more
    assert sorted(lease.spec.id for lease in leases) == sorted(m.job_id for m in made)
    assert await queue.claim(MODEL, "w", slots=10, block_s=0.3) == []  # no second message


async def test_a_resend_of_a_published_job_adds_no_message(make_backend: BackendFactory) -> None:
    queue = make_backend().queue
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


async def test_a_message_met_before_its_record_is_held_until_the_record_comes(
    make_backend: BackendFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job no key names is published while its record is admitted: a claim that meets its
    message first holds it and asks again, and leases the job once the record is in, once."""
    queue = make_backend().queue
    assert isinstance(queue, AmqpQueue)
    admit = queue.table.eval_audited

    async def late(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.5)  # the message lands long before the record
        return await admit(*args, **kwargs)

    held = []
    hold = queue._hold_early

    def counted(*args: Any) -> bool:
        held.append(args)
        return hold(*args)

    monkeypatch.setattr(queue.table, "eval_audited", late)
    monkeypatch.setattr(queue, "_hold_early", counted)
    spec = job()
    claiming = asyncio.create_task(queue.claim(MODEL, "w", slots=5, block_s=10.0))
    result = await queue.enqueue(spec)
    [lease] = await claiming
    assert held and lease.spec.id == result.job_id == spec.id
    assert await queue.complete(lease, ok(lease))
    assert await queue.claim(MODEL, "w", slots=5, block_s=0.3) == []
    record = await queue.record(spec.id)
    assert record is not None and record.status is JobStatus.SUCCEEDED


async def test_a_refused_admission_leaves_its_landed_message_stale(
    make_backend: BackendFactory,
) -> None:
    """The records' lane bound refuses a job whose message RabbitMQ took (it was published
    meanwhile): a tombstone says so, and a claim drops the message at once."""
    queue = make_backend(max_queue_depth=2).queue
    assert isinstance(queue, AmqpQueue)
    waiting = queue.keys.waiting(queue.keys.lane(MODEL, Priority.NORMAL, 0))
    await queue.conn.one(("ZADD", waiting, 1, "j-a", 2, "j-b"))  # full by the records only
    spec = job()
    with pytest.raises(QueueFull):
        await queue.enqueue(spec)
    assert await queue.record(spec.id) is None
    assert await queue.conn.one(("EXISTS", queue.ledger.gone_key(spec.id))) == 1
    assert await queue.claim(MODEL, "w", slots=5, block_s=0.5) == []
    assert not queue._early.get(MODEL)  # dropped, not held


async def test_an_admit_whose_answer_was_lost_is_taken_back(
    make_backend: BackendFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The admit ran but its answer never came: the enqueue fails, so the record it made is
    taken back and its message, published meanwhile, dropped: the job never runs."""
    queue = make_backend().queue
    assert isinstance(queue, AmqpQueue)
    admit = queue.table.eval_audited

    async def lost(*args: Any, **kwargs: Any) -> Any:
        await admit(*args, **kwargs)
        raise BrokerUnavailable("the admit's reply was lost")

    monkeypatch.setattr(queue.table, "eval_audited", lost)
    spec = job()
    with pytest.raises(BrokerUnavailable):
        await queue.enqueue(spec)
    monkeypatch.undo()
    assert await queue.record(spec.id) is None
    assert await queue.claim(MODEL, "w", slots=5, block_s=0.5) == []
    assert not queue._early.get(MODEL)


async def test_a_message_whose_record_never_comes_is_dropped_after_the_hold(
    make_backend: BackendFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No record and no tombstone (the admit failed with the tables unreachable): the claim
    holds the message EARLY_HOLD_S, asking again, then drops it."""
    queue = make_backend().queue
    assert isinstance(queue, AmqpQueue)
    monkeypatch.setattr(amqp_queue, "EARLY_HOLD_S", 0.3)
    spec = job()
    await queue.lanes.declare(MODEL)
    await queue.lanes.publish(spec, spec.id, "m-orphan")
    assert await queue.claim(MODEL, "w", slots=5, block_s=1.5) == []
    assert not queue._early.get(MODEL)
    late = await queue.enqueue(spec)  # the same id later: a job of its own, run once
    [lease] = await queue.claim(MODEL, "w", slots=5, block_s=5.0)
    assert lease.spec.id == late.job_id == spec.id


async def test_a_lost_admit_answer_of_a_resend_keeps_the_job_it_resent(
    make_backend: BackendFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resend by id re-points a queued job at the resend's message; when that admit's answer
    is lost, the take-back leaves the job (accepted by the first enqueue) where it stands: it
    runs, once."""
    queue = make_backend().queue
    assert isinstance(queue, AmqpQueue)
    spec = job()
    first = await queue.enqueue(spec)
    admit = queue.table.eval_audited

    async def lost(*args: Any, **kwargs: Any) -> Any:
        await admit(*args, **kwargs)
        raise BrokerUnavailable("the admit's reply was lost")

    with monkeypatch.context() as patched:
        patched.setattr(queue.table, "eval_audited", lost)
        with pytest.raises(BrokerUnavailable):
            await queue.enqueue(spec)  # the resend, same id
    record = await queue.record(spec.id)
    assert record is not None and record.status is JobStatus.QUEUED
    [lease] = await queue.claim(MODEL, "w", slots=5, block_s=5.0)
    assert lease.spec.id == first.job_id
    assert await queue.complete(lease, ok(lease))
    assert await queue.claim(MODEL, "w", slots=5, block_s=0.3) == []


async def test_a_lanes_deliveries_let_go_at_its_front_are_acked_at_once_past_none_held(
    make_backend: BackendFactory, rabbitmq: RabbitServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Completions of a lane's oldest deliveries are acked by one basic.ack with `multiple`
    (RabbitMQ: every delivery up to this one); one whose older delivery still runs, one at a
    time, so the running job's message stays unacked: its holder gone, RabbitMQ gives it back
    and it alone."""
    queue = make_backend().queue
    assert isinstance(queue, AmqpQueue)
    sent: list[bool] = []  # each ack's `multiple`
    ack = queue.amqp.ack

    async def counted(message: Any, multiple: bool = False) -> bool:
        sent.append(multiple)
        return await ack(message, multiple)

    monkeypatch.setattr(queue.amqp, "ack", counted)
    specs = [job() for _ in range(6)]
    for spec in specs:  # one by one, confirmed: delivered in this order
        await queue.enqueue(spec)
    leases: list[Any] = []
    deadline = time.monotonic() + 10
    while len(leases) < len(specs) and time.monotonic() < deadline:
        leases += await queue.claim(MODEL, "w", slots=len(specs) - len(leases), block_s=1.0)
    by_id = {lease.spec.id: lease for lease in leases}
    assert sorted(by_id) == sorted(spec.id for spec in specs)
    one, two, three, four, five, six = (by_id[spec.id] for spec in specs)

    assert await queue.complete_many([(x, ok(x)) for x in (two, one, three)]) == [True] * 3
    assert sent == [True]
    # four still runs: five and six are acked each alone (one ack up to six would take four)
    assert await queue.complete_many([(x, ok(x)) for x in (six, five)]) == [True] * 2
    assert sent == [True, False, False]

    await queue.amqp.close()  # four's holder is gone: RabbitMQ requeues what it left unacked
    connection = await aio_pika.connect(rabbitmq.url)
    try:
        channel = await connection.channel()
        lane = await channel.get_queue(queue.names.lane(MODEL, Priority.NORMAL, 0), ensure=False)
        back = await lane.get(no_ack=True, timeout=5)
        assert back.body.decode() == four.spec.id
        assert await lane.get(no_ack=True, fail=False, timeout=5) is None
    finally:
        await connection.close()
    for x in (one, two, three, five, six):
        record = await queue.record(x.spec.id)
        assert record is not None and record.status is JobStatus.SUCCEEDED
