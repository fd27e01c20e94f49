"""NATS lanes beyond the conformance suite: a job's record, its idempotency key and its lane
message are separate writes, so a producer that dies between them leaves a half-made job that
the client's resend (same idempotency key, a new job id) must finish."""

from __future__ import annotations

import pytest

from tests.conftest import BackendFactory
from tests.integration.test_broker_conformance import MODEL, dies_before_its_message, job, ok
from tokenyard.broker.nats import queue as nats_queue
from tokenyard.broker.nats.names import Names
from tokenyard.broker.nats.queue import NatsQueue

pytestmark = pytest.mark.parametrize("make_backend", ["nats"], indirect=True)


async def test_a_resend_publishes_a_job_whose_producer_died_before_its_message(
    make_backend: BackendFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = make_backend().queue
    assert isinstance(queue, NatsQueue)
    first = job(key="k1")
    await dies_before_its_message(queue, first, queue.conn, "publish_soon", monkeypatch)
    assert await queue.claim(MODEL, "w", slots=1) == []  # no message: nothing would run it

    [again] = await queue.enqueue_many([job(key="k1")])  # the client's resend, same key
    assert again.job_id == first.id and not again.created
    [lease] = await queue.claim(MODEL, "w", slots=1, block_s=2)
    assert lease.spec.id == first.id
    assert await queue.complete(lease, ok(lease))
    assert (await queue.enqueue(job(key="k1"))).job_id == first.id  # and it stands
    assert await queue.claim(MODEL, "w", slots=1) == []


async def test_a_resend_takes_over_a_key_whose_producer_died_before_its_record(
    make_backend: BackendFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = make_backend().queue
    assert isinstance(queue, NatsQueue)
    monkeypatch.setattr(nats_queue, "RECORD_GRACE_S", 0.3)
    ghost = job(key="k2")
    kv = await queue._jobs()
    await kv.create(Names.idempotency(MODEL, ghost.tenant, "k2"), ghost.id.encode())

    resend = job(key="k2")
    [again] = await queue.enqueue_many([resend])
    assert again.job_id == resend.id and again.created
    [lease] = await queue.claim(MODEL, "w", slots=1, block_s=2)
    assert lease.spec.id == resend.id
    assert (await queue.enqueue(job(key="k2"))).job_id == resend.id


async def test_a_resend_of_a_published_job_adds_no_message(make_backend: BackendFactory) -> None:
    queue = make_backend().queue
    first = await queue.enqueue(job(key="k3"))
    again = await queue.enqueue(job(key="k3"))
    assert again.job_id == first.job_id and not again.created
    leases = await queue.claim(MODEL, "w", slots=5, block_s=1)
    assert [lease.spec.id for lease in leases] == [first.job_id]
    assert await queue.claim(MODEL, "w", slots=5, block_s=0.5) == []
