"""NATS lanes beyond the conformance suite: a keyed job's record, its idempotency key and its
lane message are separate writes, so a producer that dies between them leaves a half-made job
that the client's resend (same idempotency key, a new job id) must finish; a plain job is its
lane message until its first claim writes its record; and a worker's events sent again after an
unanswered call must be found stored, not stored twice or fenced."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import pytest

from tests.conftest import BackendFactory
from tests.integration.test_broker_conformance import MODEL, dies_before_its_message, job, ok
from tokenyard.broker.core import CancelOutcome
from tokenyard.broker.nats import enqueue as nats_enqueue
from tokenyard.broker.nats.names import Names
from tokenyard.broker.nats.queue import NatsQueue
from tokenyard.broker.nats.records import StoredJob
from tokenyard.errors import BrokerUnavailable
from tokenyard.messages import Finished, JobStatus, TokenChunk
from tokenyard.tenancy.limiter import Quota

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
    monkeypatch.setattr(nats_enqueue, "RECORD_GRACE_S", 0.3)
    ghost = job(key="k2")
    kv = await queue.store.jobs()
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


async def test_events_sent_again_after_an_unanswered_call_are_stored_once(
    make_backend: BackendFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a worker keeps a step's events while the broker does not answer and sends the whole call
    # again: one job's events landed meanwhile, the other's last one landed but its answer was
    # lost. Each must be found stored, under the same id, not appended twice or taken as fenced
    queue = make_backend().queue
    assert isinstance(queue, NatsQueue)
    await queue.enqueue_many([job(), job()])
    one, other = await queue.claim(MODEL, "w", slots=2, block_s=2)
    publish = queue.store.publish_event

    async def answer_lost(job_id: str, *args: Any, **kwargs: Any) -> int:
        seq = await publish(job_id, *args, **kwargs)
        if job_id == other.spec.id:
            raise BrokerUnavailable("NATS: the answer never came")
        return seq

    steps = [(one, chunk("a")), (one, chunk("b")), (other, chunk("x"))]
    monkeypatch.setattr(queue.store, "publish_event", answer_lost)
    with pytest.raises(BrokerUnavailable):
        await queue.append_events(steps)
    monkeypatch.setattr(queue.store, "publish_event", publish)
    assert await queue.append_events(steps) == [True] * 3
    assert await queue.append_events([(other, chunk("y"))]) == [True]
    assert await queue.complete_many([(one, ok(one)), (other, ok(other))]) == [True, True]
    texts = {}
    for lease in (one, other):
        events = [e for _, e in await queue.read_events(lease.spec.id)]
        texts[lease.spec.id] = "".join(e.text for e in events if isinstance(e, TokenChunk))
        assert sum(isinstance(e, Finished) for e in events) == 1
    assert texts == {one.spec.id: "ab", other.spec.id: "xy"}


@pytest.mark.parametrize("zombie_ends", [False, True])
async def test_a_claim_outrun_by_a_zombie_still_fences_it(
    make_backend: BackendFactory, monkeypatch: pytest.MonkeyPatch, zombie_ends: bool
) -> None:
    # the claim marker goes after the events' last; a holder that lost the job and does not
    # know it yet appends between each look and try. The claim takes the job all the same (and
    # the claim's other job with it), or, the zombie's Finished having come first, leaves it
    # ended by that Finished
    zombie_side = make_backend(lease_s=0.2)
    queue = make_backend(lease_s=0.2).queue
    assert isinstance(queue, NatsQueue)
    contested, other = job(), job()
    await queue.enqueue(contested)
    [zombie] = await zombie_side.queue.claim(MODEL, "w1", slots=1)
    assert await zombie_side.queue.append_events([(zombie, chunk("a"))]) == [True]
    await asyncio.sleep(0.3)
    assert (await queue.reap(MODEL)).requeued == [contested.id]
    await queue.enqueue(other)
    publish = queue.store.publish_event

    async def outrun(job_id: str, data: bytes, expect: int | None, **kwargs: Any) -> int:
        if job_id == contested.id and kwargs.get("marker"):
            if expect is not None or not zombie_ends:
                await zombie_side.queue.append_events([(zombie, chunk("z"))])
            else:
                await zombie_side.queue.complete(zombie, ok(zombie, "zombie"))
        return await publish(job_id, data, expect, **kwargs)

    monkeypatch.setattr(queue.store, "publish_event", outrun)
    leases = await queue.claim(MODEL, "w2", slots=2, block_s=2)
    monkeypatch.setattr(queue.store, "publish_event", publish)
    taken = {lease.spec.id: lease for lease in leases}
    assert other.id in taken
    if zombie_ends:
        assert contested.id not in taken
        record = await queue.record(contested.id)
        assert record is not None and record.result is not None
        assert record.result.text == "zombie"
    else:
        fresh = taken[contested.id]
        assert fresh.resumable
        assert await zombie_side.queue.append_events([(zombie, chunk("late"))]) == [False]
        assert not await zombie_side.queue.complete(zombie, ok(zombie, "zombie"))
        assert await queue.complete(fresh, ok(fresh, "fresh"))
        events = [e for _, e in await queue.read_events(contested.id)]
        # the zombie's tokens before the marker stand (a resume continues from them)
        text = "".join(e.text for e in events if isinstance(e, TokenChunk))
        assert text.startswith("az") and set(text[1:]) == {"z"}
        assert [e.result.text for e in events if isinstance(e, Finished)] == ["fresh"]
    assert await queue.complete(taken[other.id], ok(taken[other.id]))


def chunk(text: str) -> TokenChunk:
    return TokenChunk(token_ids=[ord(c) for c in text], text=text)


async def test_one_claim_takes_more_plain_jobs_than_one_batched_read_holds(
    make_backend: BackendFactory,
) -> None:
    # one pull of more than the server answers in one batch, the records all written at once
    queue = make_backend().queue
    specs = [job() for _ in range(1100)]  # the server answers at most 1,024 per request
    for k in range(0, len(specs), 100):
        await queue.enqueue_many(specs[k : k + 100])
    leases = await queue.claim(MODEL, "w", slots=len(specs), block_s=2)
    assert sorted(lease.spec.id for lease in leases) == sorted(s.id for s in specs)
    assert await queue.complete_many([(lease, ok(lease)) for lease in leases]) == [True] * 1100
    # the lane messages' acks are plain publishes the server takes in its own time
    give_up = time.monotonic() + 10.0
    while (left := await queue.depth(MODEL)) and time.monotonic() < give_up:
        await asyncio.sleep(0.05)
    assert left == 0


async def test_a_plain_job_is_its_lane_message_until_its_first_claim_writes_its_record(
    make_backend: BackendFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an enqueue no key names writes the lane message alone; readers find the queued job by
    # its id there, and the first claim writes the record (expecting none) without reading
    queue = make_backend().queue
    assert isinstance(queue, NatsQueue)
    specs = [job() for _ in range(20)]
    results = await asyncio.gather(*(queue.enqueue(spec) for spec in specs))
    assert [r.job_id for r in results] == [s.id for s in specs] and all(r.created for r in results)
    assert [await queue.store.record(s.id) for s in specs] == [None] * 20
    waiting = await queue.record(specs[3].id)
    assert waiting is not None and waiting.status is JobStatus.QUEUED
    assert waiting.spec.prompt == specs[3].prompt and waiting.deliveries == 0
    assert (await queue.enqueue(specs[3])).created is False  # a resend of the job id
    read: list[str] = []
    get = queue.store.get

    async def counted_get(job_id: str) -> tuple[StoredJob, int] | None:
        read.append(job_id)
        return await get(job_id)

    monkeypatch.setattr(queue.store, "get", counted_get)
    leases = await queue.claim(MODEL, "w", slots=len(specs), block_s=2)
    assert sorted(lease.spec.id for lease in leases) == sorted(s.id for s in specs)
    assert read == []
    assert all(lease.consumer == "w" and lease.spec.attempt == 0 for lease in leases)
    monkeypatch.undo()
    stored = await queue.store.record(specs[3].id)
    assert stored is not None and stored[0].status is JobStatus.RUNNING
    assert await queue.complete_many([(lease, ok(lease)) for lease in leases]) == [True] * 20
    for spec in specs:
        done = await queue.record(spec.id)
        assert done is not None and done.status is JobStatus.SUCCEEDED


async def test_a_cancel_between_the_pull_and_the_first_claims_write_is_honoured(
    make_backend: BackendFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the cancel of a queued job writes its record (cancelled, expecting none) before its
    # message goes: a claim that pulled the message meanwhile finds its own write refused and
    # the record ended, and never runs the job
    queue = make_backend().queue
    assert isinstance(queue, NatsQueue)
    spec = job()
    await queue.enqueue(spec)
    cas_all = queue.store.cas_all

    async def cancelled_first(writes: Sequence[tuple[StoredJob, int]]) -> Any:
        for stored, _ in writes:
            if stored.spec.id == spec.id and stored.status is JobStatus.RUNNING:
                assert await queue.cancel(spec.id) is CancelOutcome.CANCELLED
        return await cas_all(writes)

    monkeypatch.setattr(queue.store, "cas_all", cancelled_first)
    assert await queue.claim(MODEL, "w", slots=1, block_s=0.5) == []
    monkeypatch.undo()
    record = await queue.record(spec.id)
    assert record is not None and record.status is JobStatus.CANCELLED
    assert await queue.claim(MODEL, "w", slots=1, block_s=0.3) == []
    give_up = time.monotonic() + 10.0
    while (left := await queue.depth(MODEL)) and time.monotonic() < give_up:
        await asyncio.sleep(0.05)
    assert left == 0


async def test_the_quota_sweep_keeps_the_reservation_of_a_job_waiting_without_a_record(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend()
    quota = Quota(max_concurrent=1)
    spec = job()
    spec.quota = True
    [decision] = await broker.quotas.reserve(spec.tenant, quota, [(spec.id, 10)])
    assert decision.admitted
    await broker.queue.enqueue(spec)
    # queued, no record: the sweep finds it in its lane and leaves its reservation held
    assert await broker.quotas.settle_finished(grace_s=0.0) == 0
    [refused] = await broker.quotas.reserve(spec.tenant, quota, [(job().id, 10)])
    assert not refused.admitted
    [lease] = await broker.queue.claim(MODEL, "w", slots=1, block_s=2)
    assert await broker.queue.complete(lease, ok(lease))
    [admitted] = await broker.quotas.reserve(spec.tenant, quota, [(job().id, 10)])
    assert admitted.admitted
