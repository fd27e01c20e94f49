"""One behaviour suite, run against every backend on a real server (`BACKENDS` in
tests/conftest.py: Valkey, a 3-shard Valkey cluster, NATS JetStream, and RabbitMQ lanes with
Valkey tables). A guarantee a backend holds only in a weaker form (README, "Choosing a broker")
is tested in that form on it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest

from tests.conftest import BACKENDS, REDIS_KINDS, BackendFactory
from tokenyard.broker import Backend, admin, new_job_id
from tokenyard.broker.core import CancelOutcome, Lease, Preempted, QueueCore, Trait
from tokenyard.broker.nats.queue import NatsQueue
from tokenyard.broker.redis import connection_of
from tokenyard.broker.tables import Settlement
from tokenyard.errors import QueueFull
from tokenyard.messages import (
    AdapterRecord,
    BatchRecord,
    BatchStatus,
    Finished,
    FinishReason,
    JobResult,
    JobSpec,
    JobStatus,
    Priority,
    SamplingParams,
    TokenChunk,
    WorkerInfo,
)
from tokenyard.tenancy.admin import create_key, revoke_key
from tokenyard.tenancy.limiter import Quota
from tokenyard.tenancy.records import TenantConfig, key_digest

MODEL = "tiny"


# A guarantee some backends hold only in a weaker form (README, "Choosing a broker") is tested
# in that form where the backend does not declare its trait (core.Trait).
def fifo(make_backend: BackendFactory) -> bool:
    """Lanes served in arrival order: no fair-share staging (quotas and caps only)."""
    return Trait.FAIR_SHARE not in make_backend.traits


def pushed(make_backend: BackendFactory) -> bool:
    """The server pushes what is ready to the consumers a worker's blocking claim makes
    (prefetch = its free slots): priority order holds among what was pushed, and what was
    pushed to one worker waits for that worker."""
    return Trait.PUSHED in make_backend.traits


def needs_affinity(make_backend: BackendFactory) -> None:
    if Trait.PREFIX_AFFINITY not in make_backend.traits:
        pytest.skip("no prefix affinity declared (README; test_fifo_lanes_*)")


# every behaviour on every backend, a 3-shard cluster included (issue 13: model keys share a slot)
pytestmark = pytest.mark.parametrize("make_backend", list(BACKENDS), indirect=True)


def job(
    priority: Priority = Priority.NORMAL,
    key: str | None = None,
    deadline: float | None = None,
    tenant: str = "acme",
    prompt: str = "hello",
) -> JobSpec:
    return JobSpec(
        id=new_job_id(MODEL),
        model=MODEL,
        tenant=tenant,
        priority=priority,
        prompt=prompt,
        sampling=SamplingParams(max_tokens=4, temperature=0.0, stop=("\n",)),
        deadline=deadline,
        idempotency_key=key,
        trace_context={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    )


def ok(lease: Lease, text: str = "done") -> JobResult:
    return JobResult(
        status=JobStatus.SUCCEEDED,
        finish_reason=FinishReason.STOP,
        text=text,
        token_ids=[1, 2],
        completion_tokens=2,
        worker=lease.consumer,
    )


async def dies_before_its_message(
    queue: QueueCore,
    spec: JobSpec,
    publisher: object,
    publish: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Enqueue `spec` while the backend's `publisher.publish` never answers, and kill the
    producer once the job's record is in: a producer dead between its record and its message
    (backends that write them apart: NATS, RabbitMQ lanes)."""
    stuck = asyncio.Event()

    async def never(*_: Any) -> None:
        await stuck.wait()

    with monkeypatch.context() as patched:
        patched.setattr(publisher, publish, never)
        producer = asyncio.create_task(queue.enqueue_many([spec]))
        for _ in range(200):
            if await queue.record(spec.id) is not None:
                break
            await asyncio.sleep(0.01)
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)


async def test_enqueue_claim_complete_round_trip(make_backend: BackendFactory) -> None:
    broker = make_backend()
    spec = job()
    created = await broker.queue.enqueue(spec)
    assert created.created and created.job_id == spec.id

    record = await broker.queue.record(spec.id)
    assert record is not None and record.status is JobStatus.QUEUED
    assert record.spec.trace_context == spec.trace_context
    assert record.spec.sampling.stop == ("\n",)

    [lease] = await broker.queue.claim(MODEL, "w1", slots=4)
    assert lease.spec.id == spec.id and lease.spec.attempt == 0
    assert lease.spec.prompt == "hello"
    running = await broker.queue.record(spec.id)
    assert running is not None and running.status is JobStatus.RUNNING
    assert running.worker == "w1" and running.started_at is not None

    assert await broker.queue.complete(lease, ok(lease))
    done = await broker.queue.record(spec.id)
    assert done is not None and done.status is JobStatus.SUCCEEDED
    assert done.result is not None and done.result.text == "done"
    assert done.finished_at is not None

    events = await broker.queue.read_events(spec.id)
    assert isinstance(events[-1][1], Finished)
    assert events[-1][1].result.text == "done"

    assert await broker.queue.claim(MODEL, "w1", slots=4) == []
    stats = await broker.queue.stats(MODEL)
    assert sum(lane.waiting + lane.in_flight for lane in stats.lanes) == 0
    assert MODEL in await broker.queue.models()


async def test_second_completion_is_rejected(make_backend: BackendFactory) -> None:
    broker = make_backend()
    await broker.queue.enqueue(job())
    [lease] = await broker.queue.claim(MODEL, "w1", slots=1)
    assert await broker.queue.complete(lease, ok(lease, "first"))
    assert not await broker.queue.complete(lease, ok(lease, "second"))
    record = await broker.queue.record(lease.spec.id)
    assert record is not None and record.result is not None
    assert record.result.text == "first"


async def test_idempotency_key_returns_the_same_job(make_backend: BackendFactory) -> None:
    broker = make_backend()
    first = await broker.queue.enqueue(job(key="req-1"))
    again = await broker.queue.enqueue(job(key="req-1"))
    other_tenant = await broker.queue.enqueue(job(key="req-1", tenant="other"))
    assert first.created and not again.created
    assert again.job_id == first.job_id
    assert other_tenant.created and other_tenant.job_id != first.job_id
    leases = await broker.queue.claim(MODEL, "w1", slots=10)
    assert sorted(lease.spec.id for lease in leases) == sorted([first.job_id, other_tenant.job_id])


async def test_claim_takes_no_more_than_free_slots(make_backend: BackendFactory) -> None:
    broker = make_backend()
    await broker.queue.enqueue_many([job() for _ in range(10)])
    assert len(await broker.queue.claim(MODEL, "w1", slots=3)) == 3
    assert len(await broker.queue.claim(MODEL, "w1", slots=0)) == 0
    assert len(await broker.queue.claim(MODEL, "w2", slots=100)) == 7
    stats = await broker.queue.stats(MODEL)
    assert sum(lane.in_flight for lane in stats.lanes) == 10


async def test_higher_priority_first(make_backend: BackendFactory) -> None:
    broker = make_backend(starvation_every=0)
    low = await broker.queue.enqueue(job(Priority.LOW))
    normal = await broker.queue.enqueue(job(Priority.NORMAL))
    high = await broker.queue.enqueue(job(Priority.HIGH))
    order = [(await broker.queue.claim(MODEL, "w", slots=1))[0].spec.id for _ in range(3)]
    assert order == [high.job_id, normal.job_id, low.job_id]


async def test_low_priority_progresses_under_sustained_high_load(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend(starvation_every=4)
    await broker.queue.enqueue_many([job(Priority.LOW) for _ in range(5)])
    await broker.queue.enqueue_many([job(Priority.NORMAL) for _ in range(5)])
    served: list[Priority] = []
    for _ in range(40):
        await broker.queue.enqueue(job(Priority.HIGH))  # high-priority work never runs out
        [lease] = await broker.queue.claim(MODEL, "w", slots=1)
        served.append(lease.spec.priority)
        await broker.queue.complete(lease, ok(lease))
    assert served.count(Priority.LOW) >= 3
    assert served.count(Priority.NORMAL) >= 3
    assert served.count(Priority.HIGH) >= 30


async def test_blocking_claim_wakes_on_enqueue(make_backend: BackendFactory) -> None:
    consumer = make_backend()
    producer = make_backend()
    await consumer.queue.claim(MODEL, "w", slots=1)  # lanes exist before the waiter blocks

    async def enqueue_later() -> str:
        await asyncio.sleep(0.2)
        return (await producer.queue.enqueue(job(Priority.LOW))).job_id

    started = time.monotonic()
    task = asyncio.create_task(enqueue_later())
    leases = await consumer.queue.claim(MODEL, "w", slots=1, block_s=5.0)
    waited = time.monotonic() - started
    assert [lease.spec.id for lease in leases] == [await task]
    assert waited < 2.0

    started = time.monotonic()
    assert await consumer.queue.claim(MODEL, "w", slots=1, block_s=0.3) == []
    assert time.monotonic() - started >= 0.25


async def test_claim_after_an_idle_claim_sees_work_that_came_meanwhile(
    make_backend: BackendFactory,
) -> None:
    consumer = make_backend(starvation_every=0)
    producer = make_backend()
    assert await consumer.queue.claim(MODEL, "w", slots=1, block_s=0.05) == []  # idle: lanes known
    low = await producer.queue.enqueue(job(Priority.LOW))
    high = await producer.queue.enqueue(job(Priority.HIGH))
    if pushed(make_backend):  # the order holds among what was pushed: let both arrive
        await asyncio.sleep(0.2)
    started = time.monotonic()
    first = await consumer.queue.claim(MODEL, "w", slots=1, block_s=5.0)
    assert [lease.spec.id for lease in first] == [high.job_id]  # priority order still holds
    assert time.monotonic() - started < 2.0
    [second] = await consumer.queue.claim(MODEL, "w", slots=1, block_s=5.0)
    assert second.spec.id == low.job_id

    async def enqueue_later() -> str:
        await asyncio.sleep(0.2)
        return (await producer.queue.enqueue(job())).job_id

    assert await consumer.queue.claim(MODEL, "w", slots=1, block_s=0.05) == []
    task = asyncio.create_task(enqueue_later())
    started = time.monotonic()
    woken = await consumer.queue.claim(MODEL, "w", slots=2, block_s=5.0)
    assert [lease.spec.id for lease in woken] == [await task]
    assert time.monotonic() - started < 2.0


async def test_completing_a_batch_across_lanes(make_backend: BackendFactory) -> None:
    broker = make_backend()
    specs = [job(p) for p in Priority for _ in range(3)]
    await broker.queue.enqueue_many(specs)
    leases = await broker.queue.claim(MODEL, "w", slots=len(specs))
    assert len(leases) == len(specs)
    again = leases[0]
    flags = await broker.queue.complete_many([(lease, ok(lease)) for lease in [*leases, again]])
    assert flags == [True] * len(specs) + [False]  # the same lease twice: the second is fenced
    # NATS: a lane message's ack is a plain publish the server takes in its own time
    give_up = time.monotonic() + 5.0
    while True:
        stats = await broker.queue.stats(MODEL)
        drained = all(lane.waiting == lane.in_flight == 0 for lane in stats.lanes)
        if drained or time.monotonic() > give_up:
            break
        await asyncio.sleep(0.02)
    assert drained, stats
    assert [lane.priority for lane in stats.lanes] == list(Priority)
    for spec in specs:
        events = await broker.queue.read_events(spec.id)
        assert [type(e) for _, e in events] == [Finished]


async def test_fenced_batches_may_mix_models(make_backend: BackendFactory) -> None:
    broker = make_backend()
    other = "other-model"
    first = job()
    second = JobSpec(id=new_job_id(other), model=other, prompt="hi")
    await broker.queue.enqueue_many([first, second])
    [a] = await broker.queue.claim(MODEL, "w", slots=1)
    [b] = await broker.queue.claim(other, "w", slots=1)
    assert (a.model, b.model) == (MODEL, other) and a.priority is Priority.NORMAL
    chunk = TokenChunk(token_ids=[1], text="a")
    assert await broker.queue.append_events([(a, chunk), (b, chunk), (a, chunk)]) == [True] * 3
    assert await broker.queue.renew([a, b]) == [True, True]
    assert await broker.queue.release([a, b]) == 2
    assert await broker.queue.renew([a, b]) == [False, False]


async def test_expired_lease_is_reclaimed_and_the_zombie_is_fenced(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend(lease_s=0.2)
    spec = job()
    await broker.queue.enqueue(spec)
    [zombie] = await broker.queue.claim(MODEL, "w1", slots=1)
    await asyncio.sleep(0.35)
    report = await broker.queue.reap(MODEL)
    assert report.requeued == [spec.id] and report.dead == []

    [fresh] = await broker.queue.claim(MODEL, "w2", slots=1)
    assert fresh.spec.id == spec.id and fresh.spec.attempt == 1

    assert await broker.queue.append_events([(zombie, TokenChunk(token_ids=[9], text="z"))]) == [
        False
    ]
    assert await broker.queue.renew([zombie]) == [False]
    assert not await broker.queue.complete(zombie, ok(zombie, "zombie"))
    assert await broker.queue.complete(fresh, ok(fresh, "fresh"))
    record = await broker.queue.record(spec.id)
    assert record is not None and record.result is not None
    assert record.result.text == "fresh" and record.deliveries == 2
    assert (await broker.queue.stats(MODEL)).fenced_completions == 1
    tokens = [e for _, e in await broker.queue.read_events(spec.id) if isinstance(e, TokenChunk)]
    assert tokens == []


async def test_a_zombie_appending_without_pause_keeps_no_job_from_the_next_claim(
    make_backend: BackendFactory,
) -> None:
    """A holder that lost its lease and does not know it yet may append as fast as it can (its
    engine runs on): the next claim still takes the job, with the claim's other jobs, and the
    zombie's writes after it are refused."""
    zombie_side, broker = make_backend(lease_s=0.2), make_backend(lease_s=0.2)
    contested, other = job(), job()
    await broker.queue.enqueue(contested)
    [zombie] = await zombie_side.queue.claim(MODEL, "w1", slots=1)
    kept: list[bool] = []

    async def keep_appending() -> None:
        while not kept or kept[-1]:
            chunk = TokenChunk(token_ids=[7], text="z")
            kept.extend(await zombie_side.queue.append_events([(zombie, chunk)]))

    appending = asyncio.create_task(keep_appending())
    try:
        await asyncio.sleep(0.35)
        assert (await broker.queue.reap(MODEL)).requeued == [contested.id]
        await broker.queue.enqueue(other)
        leases = await broker.queue.claim(MODEL, "w2", slots=2, block_s=2.0)
        if len(leases) < 2:
            leases += await broker.queue.claim(MODEL, "w2", slots=1, block_s=2.0)
        assert sorted(x.spec.id for x in leases) == sorted([contested.id, other.id])
        await asyncio.wait_for(appending, 5.0)
    finally:
        appending.cancel()
    assert kept[-1] is False
    fresh = next(x for x in leases if x.spec.id == contested.id)
    assert fresh.spec.attempt == 1
    for lease in leases:
        assert await broker.queue.complete(lease, ok(lease, "fresh"))
    assert not await zombie_side.queue.complete(zombie, ok(zombie, "zombie"))
    record = await broker.queue.record(contested.id)
    assert record is not None and record.result is not None
    assert record.result.text == "fresh" and record.deliveries == 2


async def test_renewed_lease_is_not_reclaimed(make_backend: BackendFactory) -> None:
    broker = make_backend(lease_s=0.3)
    await broker.queue.enqueue(job())
    [lease] = await broker.queue.claim(MODEL, "w1", slots=1)
    for _ in range(4):
        await asyncio.sleep(0.15)
        assert await broker.queue.renew([lease]) == [True]
    assert (await broker.queue.reap(MODEL)).requeued == []
    assert await broker.queue.complete(lease, ok(lease))


class Shifted:
    """The wall clock moved on by `ahead` seconds: liveness lapses without a wait."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.time() + self.ahead


async def test_a_lapsed_workers_jobs_move_long_before_their_lease_and_it_is_fenced(
    make_backend: BackendFactory,
) -> None:
    clock = Shifted()
    broker = make_backend(clock=clock, lease_s=30.0, liveness_s=2.0)
    spec, other = job(), job()
    await broker.queue.enqueue_many([spec, other])
    await broker.queue.beat(MODEL, "w1")
    await broker.queue.beat(MODEL, "w2")
    [zombie] = await broker.queue.claim(MODEL, "w1", slots=1)
    [kept] = await broker.queue.claim(MODEL, "w2", slots=1)
    assert (zombie.spec.id, kept.spec.id) == (spec.id, other.id)
    assert await broker.queue.append_events([(zombie, TokenChunk(token_ids=[7], text="a"))]) == [
        True
    ]
    clock.ahead = 1.5  # both beat less than liveness_s ago: nobody's jobs move
    assert (await broker.queue.reap(MODEL, expired=False)).requeued == []
    await broker.queue.beat(MODEL, "w2")
    clock.ahead = 2.5  # w1's last beat lapsed, w2's did not; no lease is anywhere near its end
    report = await broker.queue.reap(MODEL, expired=False)
    assert report.requeued == [spec.id] and report.dead == []

    [fresh] = await broker.queue.claim(MODEL, "w3", slots=1, block_s=2.0)
    assert fresh.spec.id == spec.id and fresh.spec.attempt == 1 and fresh.resumable
    assert await broker.queue.append_events([(zombie, TokenChunk(token_ids=[9], text="z"))]) == [
        False
    ]
    assert await broker.queue.renew([zombie, kept]) == [False, True]
    assert not await broker.queue.complete(zombie, ok(zombie, "zombie"))
    assert await broker.queue.complete(fresh, ok(fresh, "fresh"))
    assert await broker.queue.complete(kept, ok(kept, "kept"))
    record = await broker.queue.record(spec.id)
    assert record is not None and record.result is not None
    assert record.result.text == "fresh" and record.deliveries == 2
    tokens = [e for _, e in await broker.queue.read_events(spec.id) if isinstance(e, TokenChunk)]
    assert [t.text for t in tokens] == ["a"]  # the first holder's, once; the zombie's refused


async def test_a_lapsed_worker_that_beats_again_lives_and_one_that_never_beat_keeps_its_jobs(
    make_backend: BackendFactory,
) -> None:
    clock = Shifted()
    broker = make_backend(clock=clock, lease_s=30.0, liveness_s=2.0)
    first, second, third = job(), job(), job()
    await broker.queue.enqueue_many([first, second, third])
    await broker.queue.beat(MODEL, "w1")
    [a] = await broker.queue.claim(MODEL, "w1", slots=1)
    [b] = await broker.queue.claim(MODEL, "quiet", slots=1)  # never beats: only its lease counts
    clock.ahead = 3.0
    assert (await broker.queue.reap(MODEL, expired=False)).requeued == [a.spec.id]
    # w1 comes back: its old job is gone for good, and it is alive again
    await broker.queue.beat(MODEL, "w1")
    [c] = await broker.queue.claim(MODEL, "w1", slots=1, block_s=2.0)
    assert c.spec.id in (first.id, third.id)
    clock.ahead = 4.0
    assert (await broker.queue.reap(MODEL, expired=False)).requeued == []
    assert await broker.queue.renew([a, b, c]) == [False, True, True]
    clock.ahead = 6.0  # w1 lapsed again: only what it holds now moves
    assert (await broker.queue.reap(MODEL, expired=False)).requeued == [c.spec.id]
    assert (await broker.queue.reap(MODEL, expired=False)).requeued == []


async def test_lease_expiring_past_delivery_limit_goes_to_dead_letters(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend(lease_s=0.1, max_deliveries=2)
    spec = job()
    bystander = job()
    await broker.queue.enqueue_many([spec, bystander])
    [first] = await broker.queue.claim(MODEL, "w1", slots=1)
    assert first.spec.id == spec.id
    await asyncio.sleep(0.2)
    assert (await broker.queue.reap(MODEL)).requeued == [spec.id]
    [other] = await broker.queue.claim(MODEL, "w2", slots=1)
    assert other.spec.id == bystander.id
    assert await broker.queue.complete(other, ok(other))
    [second] = await broker.queue.claim(MODEL, "w2", slots=1)
    assert second.spec.id == spec.id and second.spec.attempt == 1
    await asyncio.sleep(0.2)
    report = await broker.queue.reap(MODEL)
    assert report.dead == [spec.id]

    [letter] = await broker.queue.dead_letters(MODEL)
    assert letter.job_id == spec.id and letter.reason == "lease_expired"
    assert letter.deliveries == 2
    record = await broker.queue.record(spec.id)
    assert record is not None and record.status is JobStatus.DEAD
    events = await broker.queue.read_events(spec.id)
    assert isinstance(events[-1][1], Finished) and events[-1][1].result.status is JobStatus.DEAD
    done = await broker.queue.record(bystander.id)
    assert done is not None and done.status is JobStatus.SUCCEEDED


async def test_retry_backs_off_then_dead_letters_with_last_error(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend(max_deliveries=3, backoff_base_s=0.05, backoff_max_s=0.1)
    spec = job()
    await broker.queue.enqueue(spec)
    attempts = []
    for expected in range(3):
        leases = await broker.queue.claim(MODEL, "w", slots=1, block_s=2.0)
        assert [lease.spec.id for lease in leases] == [spec.id]
        attempts.append(leases[0].spec.attempt)
        retrying = await broker.queue.retry(leases[0], f"boom {expected}")
        assert retrying == (expected < 2)
    assert attempts == [0, 1, 2]
    assert await broker.queue.claim(MODEL, "w", slots=1, block_s=0.3) == []

    [letter] = await broker.queue.dead_letters(MODEL)
    assert letter.reason == "failed" and letter.error == "boom 2" and letter.deliveries == 3
    record = await broker.queue.record(spec.id)
    assert record is not None and record.status is JobStatus.DEAD
    assert record.last_error == "boom 2"
    assert record.result is not None and "boom 2" in (record.result.error or "")
    stats = await broker.queue.stats(MODEL)
    assert stats.dead_letters == 1 and stats.delayed == 0


async def test_retry_is_delayed_by_backoff(make_backend: BackendFactory) -> None:
    broker = make_backend(backoff_base_s=0.4, backoff_max_s=0.4)
    spec = job()
    await broker.queue.enqueue(spec)
    [lease] = await broker.queue.claim(MODEL, "w", slots=1)
    # attempt 0: delay is uniform in [0, 0.4]; the delayed set holds it meanwhile
    assert await broker.queue.retry(lease, "transient")
    record = await broker.queue.record(spec.id)
    assert record is not None and record.status is JobStatus.QUEUED
    assert record.last_error == "transient"
    leases = await broker.queue.claim(MODEL, "w", slots=1, block_s=2.0)
    assert [x.spec.id for x in leases] == [spec.id] and leases[0].spec.attempt == 1


async def test_forced_dead_letter(make_backend: BackendFactory) -> None:
    broker = make_backend()
    spec = job()
    await broker.queue.enqueue(spec)
    [lease] = await broker.queue.claim(MODEL, "w", slots=1)
    assert await broker.queue.dead_letter(lease, "bad_input", "prompt cannot be tokenized")
    [letter] = await broker.queue.dead_letters(MODEL)
    assert letter.reason == "bad_input" and letter.error == "prompt cannot be tokenized"
    assert not await broker.queue.complete(lease, ok(lease))


async def test_events_are_appended_and_read_from_an_id(make_backend: BackendFactory) -> None:
    broker = make_backend()
    reader = make_backend()
    spec = job()
    await broker.queue.enqueue(spec)
    [lease] = await broker.queue.claim(MODEL, "w", slots=1)

    async def read_blocking() -> list[str]:
        got = await reader.queue.read_events(spec.id, after="0", block_s=5.0)
        return [e.text for _, e in got if isinstance(e, TokenChunk)]

    waiter = asyncio.create_task(read_blocking())
    await asyncio.sleep(0.1)
    assert await broker.queue.append_events([(lease, TokenChunk(token_ids=[1], text="Hel"))]) == [
        True
    ]
    assert await asyncio.wait_for(waiter, 5) == ["Hel"]

    await broker.queue.append_events([(lease, TokenChunk(token_ids=[2, 3], text="lo"))])
    await broker.queue.complete(lease, ok(lease, "Hello"))
    events = await reader.queue.read_events(spec.id)
    assert [type(e) for _, e in events] == [TokenChunk, TokenChunk, Finished]
    ids = [eid for eid, _ in events]
    assert ids == sorted(ids, key=lambda i: tuple(int(p) for p in i.split("-")))
    resumed = await reader.queue.read_events(spec.id, after=ids[0])
    assert [eid for eid, _ in resumed] == ids[1:]
    assert await reader.queue.read_events(spec.id, after=ids[-1], block_s=0.1) == []


async def test_events_of_many_jobs_are_read_in_one_call(make_backend: BackendFactory) -> None:
    broker = make_backend()
    reader = make_backend()
    specs = [job() for _ in range(3)]
    await broker.queue.enqueue_many(specs)
    leases = {lease.spec.id: lease for lease in await broker.queue.claim(MODEL, "w", slots=3)}
    a, b, c = (s.id for s in specs)
    cursors = {a: "0", b: "0", c: "0"}
    assert await reader.queue.read_events_many(cursors) == []

    waiter = asyncio.create_task(reader.queue.read_events_many(cursors, block_s=5.0))
    await asyncio.sleep(0.1)
    assert not waiter.done()
    await broker.queue.append_events([(leases[b], TokenChunk(token_ids=[1], text="x"))])
    [(job_id, first, event)] = await asyncio.wait_for(waiter, 5)
    assert job_id == b and isinstance(event, TokenChunk) and event.text == "x"

    await broker.queue.append_events(
        [
            (leases[a], TokenChunk(token_ids=[2], text="y")),
            (leases[b], TokenChunk(token_ids=[3], text="z")),
        ]
    )
    await broker.queue.complete(leases[a], ok(leases[a]))
    got = await reader.queue.read_events_many({a: "0", b: first, c: "0"})
    assert [(j, type(e)) for j, _, e in got if j == a] == [(a, TokenChunk), (a, Finished)]
    assert [e.text for j, _, e in got if j == b and isinstance(e, TokenChunk)] == ["z"]
    assert all(j != c for j, _, _ in got)

    done = await reader.queue.read_events_many({a: "0", b: "0"})
    last_b = [eid for j, eid, _ in done if j == b][-1]
    assert await reader.queue.read_events_many({b: last_b}, block_s=0.1) == []


async def test_cancel_waiting_job_ends_it_at_once(make_backend: BackendFactory) -> None:
    broker = make_backend()
    spec = job()
    keep = job()
    await broker.queue.enqueue_many([spec, keep])
    assert await broker.queue.cancel(spec.id) is CancelOutcome.CANCELLED
    record = await broker.queue.record(spec.id)
    assert record is not None and record.status is JobStatus.CANCELLED
    events = await broker.queue.read_events(spec.id)
    assert isinstance(events[-1][1], Finished)
    leases = await broker.queue.claim(MODEL, "w", slots=5)
    assert [lease.spec.id for lease in leases] == [keep.id]
    assert await broker.queue.cancel(spec.id) is CancelOutcome.ALREADY_FINISHED
    assert await broker.queue.cancel(new_job_id(MODEL)) is CancelOutcome.NOT_FOUND


async def test_cancel_running_job_signals_its_worker(make_backend: BackendFactory) -> None:
    broker = make_backend()
    a, b = job(), job()
    await broker.queue.enqueue_many([a, b])
    leases = await broker.queue.claim(MODEL, "w", slots=2)
    assert await broker.queue.cancel(a.id) is CancelOutcome.SIGNALLED
    assert await broker.queue.cancelled(MODEL, [a.id, b.id]) == {a.id}
    record = await broker.queue.record(a.id)
    assert record is not None and record.cancel_requested
    lease_a = next(lease for lease in leases if lease.spec.id == a.id)
    stopped = JobResult(status=JobStatus.CANCELLED, finish_reason=FinishReason.CANCELLED)
    assert await broker.queue.complete(lease_a, stopped)
    assert await broker.queue.cancelled(MODEL, [a.id, b.id]) == set()


async def test_cancel_during_retry_backoff(make_backend: BackendFactory) -> None:
    broker = make_backend(backoff_base_s=5.0, backoff_max_s=5.0)
    spec = job()
    await broker.queue.enqueue(spec)
    [lease] = await broker.queue.claim(MODEL, "w", slots=1)
    await broker.queue.retry(lease, "transient")
    assert await broker.queue.cancel(spec.id) is CancelOutcome.CANCELLED
    assert (await broker.queue.stats(MODEL)).delayed == 0


async def test_deadline_passed_before_start_expires_without_delivery(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend()
    late = job(deadline=time.time() - 1)
    fine = job(deadline=time.time() + 60)
    await broker.queue.enqueue_many([late, fine])
    leases = await broker.queue.claim(MODEL, "w", slots=5)
    assert [lease.spec.id for lease in leases] == [fine.id]
    record = await broker.queue.record(late.id)
    assert record is not None and record.status is JobStatus.EXPIRED
    assert record.result is not None and record.result.finish_reason is FinishReason.EXPIRED
    assert record.deliveries == 0
    assert (await broker.queue.stats(MODEL)).expired == 1


async def test_stats_report_depth_age_and_in_flight(make_backend: BackendFactory) -> None:
    broker = make_backend()
    await broker.queue.enqueue_many([job(Priority.HIGH) for _ in range(3)] + [job(Priority.LOW)])
    await asyncio.sleep(0.05)
    await broker.queue.claim(MODEL, "w", slots=1)
    stats = await broker.queue.stats(MODEL)
    by_lane = {lane.priority.name.lower(): lane for lane in stats.lanes}
    assert by_lane["high"].waiting == 2 and by_lane["high"].in_flight == 1
    assert by_lane["low"].waiting == 1 and by_lane["low"].in_flight == 0
    assert by_lane["normal"].waiting == 0 and by_lane["normal"].oldest_waiting_age_s is None
    age = by_lane["low"].oldest_waiting_age_s
    assert age is not None and 0.03 <= age < 5
    assert await broker.queue.depth(MODEL) == 4  # waiting or in flight, over the lanes


async def test_waiting_reads_the_lanes_above_a_priority_of_the_pools_asked(
    make_backend: BackendFactory,
) -> None:
    """The preemption look-out's question: what waits, and since when, in the lanes that
    outrank a priority, of the size pools its worker serves only."""
    broker = make_backend(size_pools="100")
    big = job(Priority.HIGH)
    big.sampling = SamplingParams(max_tokens=500, temperature=0.0)  # pool 1
    await broker.queue.enqueue_many([big, job(Priority.HIGH), job(Priority.HIGH), job()])
    await asyncio.sleep(0.05)
    [lease] = await broker.queue.claim(MODEL, "w", slots=1, pools=(0,))
    assert lease.priority is Priority.HIGH and lease.spec.pool == 0
    [high] = await broker.queue.waiting(MODEL, Priority.NORMAL, (0,))
    assert (high.priority, high.waiting) == (Priority.HIGH, 1)  # not the one in flight
    assert high.oldest_waiting_age_s is not None and 0.03 <= high.oldest_waiting_age_s < 5
    both = await broker.queue.waiting(MODEL, Priority.NORMAL, (0, 1))
    assert [(lane.priority, lane.waiting) for lane in both] == [(Priority.HIGH, 2)]
    below = await broker.queue.waiting(MODEL, Priority.BATCH, (0,))
    assert [(lane.priority, lane.waiting) for lane in below] == [
        (Priority.HIGH, 1),
        (Priority.NORMAL, 1),
    ]
    assert await broker.queue.waiting(MODEL, Priority.HIGH, (0, 1)) == []  # nothing outranks


async def test_backlog_counts_each_tenants_staged_jobs(make_backend: BackendFactory) -> None:
    broker = make_backend(fair_window=2)
    heavy = [job(tenant="acme") for _ in range(6)]
    light = [msgspec.structs.replace(job(tenant="other"), weight=2.0) for _ in range(4)]
    await broker.queue.enqueue_many([job(Priority.HIGH), *heavy, *light])
    [lease] = await broker.queue.claim(MODEL, "w", slots=1)
    assert lease.priority is Priority.HIGH
    lanes = await broker.queue.backlog(MODEL)
    assert [lane.priority for lane in lanes] == list(Priority)  # highest first
    high, normal = lanes[0], lanes[1]
    assert (high.queued, high.in_flight, high.tenants) == (0, 1, [])
    # a fair-share window stays in the lane (queued); without one every waiting job is staged
    # by tenant (README, "NATS JetStream")
    window = 2 if Trait.FAIR_WINDOW in make_backend.traits else 0
    if fifo(make_backend):  # FIFO lanes stage nothing: every waiting job is queued
        assert (normal.queued, normal.in_flight, normal.tenants) == (10, 0, [])
        return
    assert normal.in_flight == 0 and normal.queued >= window
    staged = {t.tenant: t for t in normal.tenants}
    assert normal.queued + sum(t.staged for t in staged.values()) == 10
    assert staged["acme"].weight == 1.0 and 0 < staged["acme"].staged <= 6
    assert staged["other"].weight == 2.0 and 0 < staged["other"].staged <= 4
    assert all(not lane.tenants and lane.queued == lane.in_flight == 0 for lane in lanes[2:])


async def test_full_lane_refuses_and_adds_nothing(make_backend: BackendFactory) -> None:
    broker = make_backend(max_queue_depth=3)
    await broker.queue.enqueue_many([job() for _ in range(3)])
    with pytest.raises(QueueFull) as raised:
        await broker.queue.enqueue(job())
    assert raised.value.limit == 3
    await broker.queue.enqueue(job(Priority.HIGH))  # other lanes have their own bound
    assert len(await broker.queue.claim(MODEL, "w", slots=10)) == 4


async def test_a_full_lane_refuses_its_models_jobs_while_the_other_models_jobs_stand(
    make_backend: BackendFactory,
) -> None:
    """A batch of several models' jobs is admitted model by model, each model's all or none
    (core.QueueCore): the full lane's model adds none, the other model's are added and said."""
    broker = make_backend(max_queue_depth=2)
    other = "other-model"
    await broker.queue.enqueue_many([job(), job()])  # MODEL's normal lane is full

    def theirs() -> JobSpec:
        return JobSpec(id=new_job_id(other), model=other, prompt="hi")

    batch = [job(), theirs(), job(), theirs()]  # the refused model's jobs come first
    with pytest.raises(QueueFull) as raised:
        await broker.queue.enqueue_many(batch)
    stand = [batch[1].id, batch[3].id]
    assert [r and (r.job_id, r.created) for r in raised.value.admitted] == [
        None,
        (stand[0], True),
        None,
        (stand[1], True),
    ]
    found = await broker.queue.records([spec.id for spec in batch])
    assert [rec is not None for rec in found] == [False, True, False, True]
    assert await broker.queue.depth(MODEL) == 2 and await broker.queue.depth(other) == 2
    taken = await broker.queue.claim(other, "w", slots=10)
    assert sorted(lease.spec.id for lease in taken) == sorted(stand)
    assert len(await broker.queue.claim(MODEL, "w", slots=10)) == 2


async def test_release_hands_jobs_back_without_charging_a_delivery(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend()
    spec = job()
    await broker.queue.enqueue(spec)
    [lease] = await broker.queue.claim(MODEL, "w1", slots=1)
    assert await broker.queue.release([lease]) == 1
    assert not await broker.queue.complete(lease, ok(lease))
    [again] = await broker.queue.claim(MODEL, "w2", slots=1)
    assert again.spec.id == spec.id and again.spec.attempt == 0


async def test_a_preempted_job_is_requeued_counted_resumable_and_bounded(
    make_backend: BackendFactory,
) -> None:
    """machine.preempt on each backend: the job goes back to its lane uncharged with its
    streamed tokens, its record and the audit trail count it, the next holder resumes after
    those tokens, and past `max_preemptions` the holder keeps it."""
    broker = make_backend(max_preemptions=2)
    start = time.time() - 1
    spec = job(priority=Priority.BATCH)
    await broker.queue.enqueue(spec)
    [lease] = await broker.queue.claim(MODEL, "w1", slots=1)
    chunk = TokenChunk(token_ids=[5], text="a")
    assert await broker.queue.append_events([(lease, chunk)]) == [True]
    for n in (1, 2):
        assert await broker.queue.preempt([lease]) == [Preempted.PREEMPTED]
        assert not await broker.queue.complete(lease, ok(lease))  # the old holder is fenced
        record = await broker.queue.record(spec.id)
        assert record is not None and record.status is JobStatus.QUEUED
        assert record.preemptions == n
        [lease] = await broker.queue.claim(MODEL, f"w{n + 1}", slots=1, block_s=2.0)
        # resumed as a redelivered job is, not charged a delivery
        assert lease.spec.id == spec.id and lease.resumable and lease.spec.attempt == 0
        assert lease.preemptions == n  # its next holder knows: one at the bound is not tried
        tokens = [
            e for _, e in await broker.queue.read_events(spec.id) if isinstance(e, TokenChunk)
        ]
        assert tokens == [chunk]
    # preempted its maximum number of times: refused, the holder keeps the job and ends it
    assert await broker.queue.preempt([lease]) == [Preempted.KEPT]
    record = await broker.queue.record(spec.id)
    assert record is not None and record.status is JobStatus.RUNNING and record.preemptions == 2
    assert await broker.queue.renew([lease]) == [True]
    assert await broker.queue.complete(lease, ok(lease))
    record = await broker.queue.record(spec.id)
    assert record is not None and record.status is JobStatus.SUCCEEDED
    assert record.preemptions == 2 and record.deliveries == 1
    # a lost lease preempts nothing
    assert await broker.queue.preempt([lease]) == [Preempted.KEPT]
    for _ in range(100):  # NATS writes its audit entries off the caller's path
        _, entries = await broker.audit.audit_entries(start, model=MODEL)
        if sum(e.event == "preempted" for e in entries) == 2:
            break
        await asyncio.sleep(0.02)
    assert [e.event for e in entries if e.job_id == spec.id] == [
        "received",
        "preempted",
        "preempted",
        "terminal",
    ]


async def test_a_victim_cancelled_meanwhile_ends_cancelled_and_is_not_counted_preempted(
    make_backend: BackendFactory,
) -> None:
    """A preemption of a job whose client asked to cancel while it ran ends it cancelled: the
    answer says so (its holder counts no preemption), its record and the audit trail none."""
    broker = make_backend()
    start = time.time() - 1
    spec = job(priority=Priority.BATCH)
    await broker.queue.enqueue(spec)
    [lease] = await broker.queue.claim(MODEL, "w1", slots=1)
    assert await broker.queue.cancel(spec.id) is CancelOutcome.SIGNALLED
    assert await broker.queue.preempt([lease]) == [Preempted.CANCELLED]
    record = await broker.queue.record(spec.id)
    assert record is not None and record.status is JobStatus.CANCELLED
    assert record.preemptions == 0
    assert await broker.queue.claim(MODEL, "w2", slots=1) == []  # not back in its lane
    for _ in range(100):  # NATS writes its audit entries off the caller's path
        _, entries = await broker.audit.audit_entries(start, model=MODEL)
        if any(e.event == "terminal" for e in entries if e.job_id == spec.id):
            break
        await asyncio.sleep(0.02)
    events = [e.event for e in entries if e.job_id == spec.id]
    assert "terminal" in events and "preempted" not in events


async def test_worker_heartbeats_lapse(make_backend: BackendFactory) -> None:
    broker = make_backend()
    info = WorkerInfo(
        consumer="h:1:0", model=MODEL, engine="sim", host="h", pid=1, started_at=time.time()
    )
    await broker.registry.heartbeat(info, ttl_s=0.3)
    assert [w.consumer for w in await broker.registry.workers(MODEL)] == ["h:1:0"]
    await asyncio.sleep(0.4)
    assert await broker.registry.workers(MODEL) == []
    await broker.registry.heartbeat(info, ttl_s=5)
    await broker.registry.deregister(MODEL, "h:1:0")
    assert await broker.registry.workers(MODEL) == []


async def test_an_operator_asks_one_live_worker_to_drain_at_its_heartbeat(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend()

    def beat(consumer: str) -> WorkerInfo:
        return WorkerInfo(
            consumer=consumer, model=MODEL, engine="sim", host="h", pid=1, started_at=time.time()
        )

    assert not await broker.registry.heartbeat(beat("h:1:0"), ttl_s=5)
    assert not await broker.registry.heartbeat(beat("h:2:0"), ttl_s=0.3)
    assert not await broker.registry.request_drain(MODEL, "h:9:0")  # no such worker
    assert not await broker.registry.request_drain("other-model", "h:1:0")
    assert await broker.registry.request_drain(MODEL, "h:1:0")
    assert await broker.registry.heartbeat(beat("h:1:0"), ttl_s=5)
    assert await broker.registry.heartbeat(beat("h:1:0"), ttl_s=5)  # until it leaves
    assert [w.consumer for w in await broker.registry.workers(MODEL)] == ["h:2:0", "h:1:0"]
    await asyncio.sleep(0.4)
    assert not await broker.registry.request_drain(MODEL, "h:2:0")  # its heartbeat lapsed
    assert not await broker.registry.heartbeat(beat("h:3:0"), ttl_s=5)


async def test_a_dead_letter_is_requeued_once_as_a_new_job_of_its_request(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend()
    spec = job(prompt="poison", deadline=time.time() + 60)
    await broker.queue.enqueue(spec)
    [lease] = await broker.queue.claim(MODEL, "w1", slots=1)
    assert await broker.queue.dead_letter(lease, "poison_pill", "boom")
    [listed] = await admin.dead_letters(broker.queue, MODEL)
    assert (listed.entry.job_id, listed.entry.reason, listed.requeued_as) == (
        spec.id,
        "poison_pill",
        None,
    )
    done = await admin.requeue_dead(broker.queue, spec.id)
    assert done.outcome is admin.RequeueOutcome.REQUEUED and done.requeued_as
    again = await admin.requeue_dead(broker.queue, spec.id)
    assert again == admin.Requeue(admin.RequeueOutcome.ALREADY_REQUEUED, spec.id, done.requeued_as)
    [listed] = await admin.dead_letters(broker.queue, MODEL)
    assert listed.requeued_as == done.requeued_as
    dead = await broker.queue.record(spec.id)
    assert dead is not None and dead.status is JobStatus.DEAD  # it stays dead: a new job runs
    [new] = await broker.queue.claim(MODEL, "w2", slots=1)
    assert new.spec.id == done.requeued_as and new.spec.id != spec.id
    assert (new.spec.prompt, new.spec.tenant, new.spec.attempt) == ("poison", "acme", 0)
    assert new.spec.deadline is not None and new.spec.deadline > time.time() + 30
    running = await admin.requeue_dead(broker.queue, new.spec.id)
    assert running.outcome is admin.RequeueOutcome.NOT_DEAD
    assert running.status is JobStatus.RUNNING
    assert (await admin.requeue_dead(broker.queue, new_job_id(MODEL))).outcome is (
        admin.RequeueOutcome.NOT_FOUND
    )
    assert (await admin.requeue_dead(broker.queue, "nonsense")).outcome is (
        admin.RequeueOutcome.NOT_FOUND
    )
    assert await broker.queue.claim(MODEL, "w3", slots=5) == []  # one new job, not two


async def test_resent_enqueue_of_a_known_job_adds_nothing(make_backend: BackendFactory) -> None:
    broker = make_backend()
    spec = job()
    assert (await broker.queue.enqueue(spec)).created
    again = await broker.queue.enqueue(spec)  # e.g. resent after a timeout; the first one landed
    assert not again.created and again.job_id == spec.id
    [lease] = await broker.queue.claim(MODEL, "w", slots=10)
    assert await broker.queue.complete(lease, ok(lease, "once"))
    assert not (await broker.queue.enqueue(spec)).created  # a finished job is not run again
    assert await broker.queue.claim(MODEL, "w", slots=10) == []
    record = await broker.queue.record(spec.id)
    assert record is not None and record.result is not None and record.result.text == "once"


async def test_batch_is_all_or_nothing_when_a_lane_would_overflow(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend(max_queue_depth=3)
    with pytest.raises(QueueFull):
        await broker.queue.enqueue_many([job() for _ in range(5)])
    assert await broker.queue.claim(MODEL, "w", slots=10) == []
    batch = [job(key="same"), job(key="same"), job()]
    results = await broker.queue.enqueue_many(batch)
    assert [r.created for r in results] == [True, False, True]
    assert results[1].job_id == batch[0].id
    assert len(await broker.queue.claim(MODEL, "w", slots=10)) == 2


async def test_completion_can_carry_the_last_tokens(make_backend: BackendFactory) -> None:
    broker = make_backend()
    spec = job()
    await broker.queue.enqueue(spec)
    [lease] = await broker.queue.claim(MODEL, "w", slots=1)
    await broker.queue.append_events([(lease, TokenChunk(token_ids=[1], text="a"))])
    assert await broker.queue.complete(
        lease, ok(lease, "ab"), tail=TokenChunk(token_ids=[2], text="b")
    )
    events = [e for _, e in await broker.queue.read_events(spec.id)]
    assert [type(e) for e in events] == [TokenChunk, TokenChunk, Finished]
    assert "".join(e.text for e in events if isinstance(e, TokenChunk)) == "ab"


async def test_lease_says_whether_earlier_tokens_exist(make_backend: BackendFactory) -> None:
    broker = make_backend(lease_s=0.1)
    spec = job()
    await broker.queue.enqueue(spec)
    [first] = await broker.queue.claim(MODEL, "w1", slots=1)
    assert not first.resumable
    await broker.queue.append_events([(first, TokenChunk(token_ids=[1], text="a"))])
    await asyncio.sleep(0.2)
    await broker.queue.reap(MODEL)
    [second] = await broker.queue.claim(MODEL, "w2", slots=1)
    assert second.resumable and second.spec.attempt == 1


async def test_scripts_survive_a_flushed_script_cache(make_backend: BackendFactory) -> None:
    broker = make_backend()
    if make_backend.kind not in REDIS_KINDS:
        pytest.skip("a Redis server's script cache")
    await broker.queue.enqueue(job())
    client = connection_of(broker).client
    await client.script_flush()  # what a server restart does to loaded scripts
    [lease] = await broker.queue.claim(MODEL, "w", slots=1)
    await client.script_flush()
    assert await broker.queue.complete(lease, ok(lease))


def collapsing(key: str = "digest-1") -> JobSpec:
    spec = job()
    spec.collapse_key = key
    return spec


async def test_identical_request_in_flight_joins_the_job(make_backend: BackendFactory) -> None:
    broker = make_backend()
    first = await broker.queue.enqueue(collapsing())
    joined = await broker.queue.enqueue(collapsing())
    in_batch = await broker.queue.enqueue_many([collapsing("digest-2"), collapsing("digest-2")])
    other = await broker.queue.enqueue(collapsing("digest-3"))
    assert first.created and not first.collapsed
    assert joined == type(joined)(job_id=first.job_id, created=False, collapsed=True)
    assert in_batch[0].created and in_batch[1].collapsed
    assert in_batch[1].job_id == in_batch[0].job_id
    assert other.created
    leases = await broker.queue.claim(MODEL, "w1", slots=10)
    assert len(leases) == 3  # one job per collapse key
    # running jobs are joined too
    running = await broker.queue.enqueue(collapsing())
    assert running.collapsed and running.job_id == first.job_id
    # a job that failed is not joined: the next identical request runs again
    lease = next(x for x in leases if x.spec.id == first.job_id)
    assert await broker.queue.dead_letter(lease, "engine_error", "boom")
    after = await broker.queue.enqueue(collapsing())
    assert after.created and after.job_id != first.job_id


async def test_a_join_after_the_end_before_the_answer_is_cached_gets_the_one_job(
    make_backend: BackendFactory,
) -> None:
    """Issue 36: the end of a collapsed job and its answer in the response cache are two
    writes; an identical request arriving between them joins the finished job (its answer is
    in its record) rather than running it again, for `collapse_grace_s` at most: a gateway that
    died before caching the answer leaves no key that is joined for ever."""
    now = [time.time()]
    broker = make_backend(clock=lambda: now[0], collapse_grace_s=5.0)
    first = await broker.queue.enqueue(collapsing())
    [lease] = await broker.queue.claim(MODEL, "w1", slots=1)
    assert await broker.queue.complete(lease, ok(lease, "the answer"))
    now[0] += 4.9
    late = await broker.queue.enqueue_many([collapsing(), collapsing()])
    assert [(r.job_id, r.created, r.collapsed) for r in late] == [(first.job_id, False, True)] * 2
    record = await broker.queue.record(first.job_id)
    assert record is not None and record.result is not None
    assert record.result.text == "the answer"
    events = await broker.queue.read_events(first.job_id)
    finished = events[-1][1]
    assert isinstance(finished, Finished) and finished.result.text == "the answer"
    # the cache never got it (its gateway died): past the bound the next one runs again
    now[0] += 0.2
    again = await broker.queue.enqueue(collapsing())
    assert again.created and again.job_id != first.job_id
    # ...and the key names that new job: identical requests join it, not the old one
    assert (await broker.queue.enqueue(collapsing())).job_id == again.job_id
    assert len(await broker.queue.claim(MODEL, "w1", slots=5)) == 1


async def test_a_refused_batch_joins_nothing(make_backend: BackendFactory) -> None:
    broker = make_backend(max_queue_depth=2)
    first = await broker.queue.enqueue(collapsing())
    with pytest.raises(QueueFull):
        await broker.queue.enqueue_many([collapsing(), job(), job()])
    # had the refused batch counted its follower, one leave would not cancel the job
    assert await broker.queue.leave(first.job_id) is CancelOutcome.CANCELLED


async def test_collapsed_job_is_cancelled_only_when_its_last_follower_leaves(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend()
    first = await broker.queue.enqueue(collapsing())
    for _ in range(2):
        await broker.queue.enqueue(collapsing())
    assert await broker.queue.leave(first.job_id) is CancelOutcome.FOLLOWED
    assert len(await broker.queue.claim(MODEL, "w1", slots=1)) == 1
    assert await broker.queue.leave(first.job_id) is CancelOutcome.FOLLOWED
    assert await broker.queue.cancelled(MODEL, [first.job_id]) == set()
    assert await broker.queue.leave(first.job_id) is CancelOutcome.SIGNALLED
    assert await broker.queue.cancelled(MODEL, [first.job_id]) == {first.job_id}
    # a job that never collapsed is cancelled by its one caller leaving
    plain = await broker.queue.enqueue(job())
    assert await broker.queue.leave(plain.job_id) is CancelOutcome.CANCELLED
    # two followers leaving together (one gateway's) count as two
    pair = await broker.queue.enqueue(collapsing("digest-9"))
    await broker.queue.enqueue(collapsing("digest-9"))
    assert await broker.queue.leave(pair.job_id, 2) is CancelOutcome.CANCELLED


async def test_response_cache_entries_expire_and_stay_under_the_byte_bound(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend()
    assert await broker.responses.cache_get(MODEL, "a") is None
    await broker.responses.cache_put(MODEL, "a", b"x" * 40, ttl_s=60, max_bytes=100)
    await broker.responses.cache_put(MODEL, "b", b"y" * 40, ttl_s=60, max_bytes=100)
    assert await broker.responses.cache_get(MODEL, "a") == b"x" * 40
    await broker.responses.cache_put(MODEL, "c", b"z" * 40, ttl_s=60, max_bytes=100)
    # over the bound: the entry soonest to expire went
    assert await broker.responses.cache_get(MODEL, "a") is None
    assert await broker.responses.cache_get(MODEL, "b") == b"y" * 40
    assert await broker.responses.cache_get(MODEL, "c") == b"z" * 40
    # too big for the bound: not stored, nothing evicted for it
    await broker.responses.cache_put(MODEL, "huge", b"h" * 101, ttl_s=60, max_bytes=100)
    assert await broker.responses.cache_get(MODEL, "huge") is None
    assert await broker.responses.cache_get(MODEL, "b") is not None
    await broker.responses.cache_put(MODEL, "short", b"s", ttl_s=0.05, max_bytes=100)
    assert await broker.responses.cache_get(MODEL, "short") == b"s"
    await asyncio.sleep(0.1)
    assert await broker.responses.cache_get(MODEL, "short") is None


async def test_size_pools_split_lanes_by_estimated_tokens(make_backend: BackendFactory) -> None:
    broker = make_backend(size_pools="10,100", lease_s=0.2)
    small, medium, large = job(), job(), job()  # "hello": ~2 tokens + max_tokens 4 -> pool 0
    medium.sampling = SamplingParams(max_tokens=50, temperature=0.0)
    large.sampling = SamplingParams(max_tokens=500, temperature=0.0)
    await broker.queue.enqueue_many([small, medium, large])
    assert await broker.queue.depth(MODEL) == 3
    stats = await broker.queue.stats(MODEL)
    assert sum(lane.waiting for lane in stats.lanes) == 3
    # a worker that holds only the small pool never sees the others
    [only] = await broker.queue.claim(MODEL, "short", slots=10, pools=(0,))
    assert only.spec.id == small.id and only.spec.pool == 0
    assert await broker.queue.claim(MODEL, "short", slots=10, pools=(0,)) == []
    # a bigger worker takes its own pool first, then smaller ones
    [first] = await broker.queue.claim(MODEL, "mid", slots=1, pools=(1, 0))
    assert first.spec.id == medium.id
    # pool lanes are leased like any other: lost leases are reaped back into their pool
    await asyncio.sleep(0.3)
    report = await broker.queue.reap(MODEL)
    assert sorted(report.requeued) == sorted([small.id, medium.id])
    claimed = await broker.queue.claim(MODEL, "big", slots=10, pools=(2, 1, 0))
    assert [lease.spec.id for lease in claimed] == [large.id, medium.id, small.id]
    assert await broker.queue.complete_many([(lease, ok(lease)) for lease in claimed]) == [True] * 3
    await drained(broker)


async def test_records_reads_many_jobs_at_once(make_backend: BackendFactory) -> None:
    broker = make_backend()
    a, b = await broker.queue.enqueue(job()), await broker.queue.enqueue(job())
    [lease] = await broker.queue.claim(MODEL, "w", slots=1)
    await broker.queue.complete(lease, ok(lease))
    got = await broker.queue.records([a.job_id, new_job_id(MODEL), b.job_id])
    assert got[1] is None
    assert [r.spec.id for r in (got[0], got[2]) if r is not None] == [a.job_id, b.job_id]
    assert {r.status for r in (got[0], got[2]) if r is not None} == {
        JobStatus.SUCCEEDED,
        JobStatus.QUEUED,
    }
    assert await broker.queue.records([]) == []


async def test_batch_lane_is_last_but_never_starved(make_backend: BackendFactory) -> None:
    broker = make_backend(starvation_every=4)
    await broker.queue.enqueue_many([job(Priority.BATCH) for _ in range(5)])
    await broker.queue.enqueue(job(Priority.LOW))
    [first] = await broker.queue.claim(MODEL, "w", slots=1)
    assert first.spec.priority is Priority.LOW  # interactive work goes first
    served: list[Priority] = []
    for _ in range(40):
        await broker.queue.enqueue(job(Priority.NORMAL))
        [lease] = await broker.queue.claim(MODEL, "w", slots=1)
        served.append(lease.spec.priority)
        await broker.queue.complete(lease, ok(lease))
    assert served.count(Priority.BATCH) >= 2
    assert served.count(Priority.NORMAL) >= 30


async def test_batch_room_caps_the_batch_lane_only(make_backend: BackendFactory) -> None:
    broker = make_backend()
    await broker.queue.enqueue_many([job(Priority.BATCH) for _ in range(6)])
    await broker.queue.enqueue_many([job(Priority.NORMAL) for _ in range(2)])
    first = await broker.queue.claim(MODEL, "w", slots=8, batch_room=2)
    assert [lease.spec.priority for lease in first] == [Priority.NORMAL] * 2 + [Priority.BATCH] * 2
    # no room left: the batch backlog waits, and a blocking claim waits out its time
    started = time.monotonic()
    assert await broker.queue.claim(MODEL, "w", slots=8, batch_room=0, block_s=0.3) == []
    assert time.monotonic() - started >= 0.25
    # new interactive work wakes the capped claim at once
    await broker.queue.enqueue(job(Priority.HIGH))
    [high] = await broker.queue.claim(MODEL, "w", slots=8, batch_room=0, block_s=2.0)
    assert high.spec.priority is Priority.HIGH
    # room again: the rest of the backlog, capped, then uncapped
    assert len(await broker.queue.claim(MODEL, "w", slots=8, batch_room=3, block_s=1.0)) == 3
    assert len(await broker.queue.claim(MODEL, "w", slots=8, block_s=1.0)) == 1


async def test_batch_store(make_backend: BackendFactory) -> None:

    broker = make_backend()
    store = broker.batches
    other = make_backend().batches  # another gateway on the same broker
    rec = BatchRecord(
        id="batch_1",
        tenant="acme",
        endpoint="/v1/completions",
        input_file_id="f",
        created_at=1,
        expires_at=2,
    )
    await store.create(rec)
    await store.create(msgspec.structs.replace(rec, id="batch_2", tenant="globex"))
    await store.create(msgspec.structs.replace(rec, id="batch_3"))
    assert await other.list_ids("acme") == ["batch_3", "batch_1"]
    assert set(await other.active()) >= {"batch_1", "batch_2", "batch_3"}
    # one runner at a time; the other takes over once the lease lapses
    assert await store.acquire("batch_1", "r1", 0.2)
    assert not await other.acquire("batch_1", "r2", 0.2)
    assert await store.acquire("batch_1", "r1", 0.2)  # renewal
    await asyncio.sleep(0.3)
    assert await other.acquire("batch_1", "r2", 5)
    await other.release("batch_1", "r1")  # not r1's any more: no effect
    assert not await store.acquire("batch_1", "r1", 5)
    await other.release("batch_1", "r2")
    assert await store.acquire("batch_1", "r1", 5)
    # jobs and outcomes: adding an outcome twice counts it once
    await store.set_jobs("batch_1", {0: "j0", 1: "j1", 2: "j2"})
    await store.add_outcomes("batch_1", [0], [2])
    await other.add_outcomes("batch_1", [0], [])
    assert await other.jobs("batch_1") == {0: "j0", 1: "j1", 2: "j2"}
    assert await other.outcomes("batch_1") == ({0}, {2})
    state = await other.get("batch_1")
    assert state is not None
    assert (state.completed, state.failed, state.cancel_requested) == (1, 1, False)
    await other.request_cancel("batch_1")
    rec.status = BatchStatus.CANCELLED
    await store.save(rec)
    state = await other.get("batch_1")
    assert state is not None and state.cancel_requested
    assert state.record.status is BatchStatus.CANCELLED
    assert "batch_1" not in await other.active()
    assert await other.get("batch_missing") is None


async def test_directory_of_tenants_and_keys_is_shared(make_backend: BackendFactory) -> None:
    admin, gateway = make_backend(), make_backend()  # two clients of one store
    assert not await gateway.directory.has_api_keys()
    assert (
        await gateway.directory.tenant("acme") is None and await gateway.directory.tenants() == []
    )

    await admin.directory.put_tenant(TenantConfig(name="acme", priority=Priority.HIGH))
    await admin.directory.put_tenant(TenantConfig(name="ops", admin=True))
    assert await gateway.directory.tenant("acme") == TenantConfig(
        name="acme", priority=Priority.HIGH
    )
    assert [t.name for t in await gateway.directory.tenants()] == ["acme", "ops"]

    key, record = await create_key(admin.directory, "acme", now=100.0, label="ci")
    assert key.startswith("ty-") and record.digest == key_digest(key) != key
    assert await gateway.directory.has_api_keys()
    assert await gateway.directory.api_key(key_digest(key)) == record
    assert await gateway.directory.api_key(key_digest("ty-unknown")) is None

    second, _ = await create_key(admin.directory, "acme", now=101.0)
    revoked = await revoke_key(admin.directory, record.key_id, now=102.0)
    assert revoked is not None and revoked.revoked_at == 102.0
    stored = await gateway.directory.api_key(record.digest)
    assert stored is not None and not stored.active
    assert await revoke_key(admin.directory, record.key_id, now=103.0) is None  # already revoked
    assert await revoke_key(admin.directory, second, now=104.0) is not None  # by the key itself
    listed = await gateway.directory.api_keys()
    assert [r.digest for r in listed] == [record.digest, key_digest(second)]
    assert all(not r.active for r in listed)
    assert await gateway.directory.has_api_keys()  # revoked keys keep auth on


async def test_directory_of_lora_adapters_is_shared(make_backend: BackendFactory) -> None:
    admin, gateway = make_backend(), make_backend()  # two clients of one store
    assert await gateway.directory.adapters() == []
    first = AdapterRecord(name="sql", base="tiny", path="/loras/sql", created_at=1.0)
    await admin.directory.put_adapter(first)
    await admin.directory.put_adapter(AdapterRecord(name="chat.v2", base="tiny", path="org/x"))
    assert [a.name for a in await gateway.directory.adapters()] == ["chat.v2", "sql"]
    moved = AdapterRecord(name="sql", base="tiny", path="/loras/sql-2", created_at=2.0)
    await admin.directory.put_adapter(moved)  # replaced by name
    assert moved in await gateway.directory.adapters()
    assert await gateway.directory.delete_adapter("sql")
    assert not await gateway.directory.delete_adapter("sql")
    assert [a.name for a in await gateway.directory.adapters()] == ["chat.v2"]


def held_job(tenant: str = "acme", deadline: float | None = None) -> JobSpec:
    spec = job(tenant=tenant, deadline=deadline)
    spec.quota = True
    return spec


async def test_request_quota_is_exact_across_clients(make_backend: BackendFactory) -> None:
    one, two = make_backend(), make_backend()
    quota = Quota(rpm=3)
    decisions = []
    for i in range(6):
        decisions += await (one if i % 2 else two).quotas.reserve("acme", quota, [(f"j{i}", 1)])
    assert [d.admitted for d in decisions] == [True, True, True, False, False, False]
    assert [d.requests[1] for d in decisions if d.requests] == [2, 1, 0, 0, 0, 0]
    refused = decisions[3]
    assert refused.reason == "requests" and 19.0 < refused.retry_after_s <= 20.0
    # another tenant's quota is its own
    [other] = await one.quotas.reserve("bob", quota, [("b0", 1)])
    assert other.admitted


async def test_a_job_never_entered_gives_its_request_back_once(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend()
    quota = Quota(rpm=2)
    first, second = await broker.quotas.reserve("acme", quota, [("j1", 1), ("j2", 1)])
    assert first.admitted and second.admitted
    # j1 ended (it counts as a request), j2 never entered (its request comes back, once)
    assert await broker.quotas.settle([Settlement("acme", "j1", 1)]) == 1
    assert await broker.quotas.settle([Settlement("acme", "j2", 0, request=True)]) == 1
    assert await broker.quotas.settle([Settlement("acme", "j2", 0, request=True)]) == 0
    [third] = await broker.quotas.reserve("acme", quota, [("j3", 1)])
    assert third.admitted and third.requests is not None and third.requests[1] == 0
    [fourth] = await broker.quotas.reserve("acme", quota, [("j4", 1)])
    assert not fourth.admitted and fourth.reason == "requests"


async def test_token_quota_reserves_then_settles_to_the_real_count(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend()
    quota = Quota(tpm=100)
    first, second = await broker.quotas.reserve("acme", quota, [("j1", 60), ("j2", 60)])
    assert first.admitted and first.tokens is not None and first.tokens[1] == 40
    assert not second.admitted and second.reason == "tokens" and second.retry_after_s > 0
    [huge] = await broker.quotas.reserve("acme", quota, [("j3", 101)])
    assert huge.reason == "too_large" and huge.retry_after_s == float("inf")
    # j1 used 10 of its 60: 50 come back, once
    assert await broker.quotas.settle([Settlement("acme", "j1", 10)]) == 1
    assert await broker.quotas.settle([Settlement("acme", "j1", 10)]) == 0
    [again] = await broker.quotas.reserve("acme", quota, [("j2", 60)])
    assert again.admitted and again.tokens is not None and again.tokens[1] == 30


async def test_concurrency_is_released_at_every_terminal_state(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend(lease_s=0.1, max_deliveries=1)
    quota = Quota(max_concurrent=1)

    async def admit(spec: JobSpec) -> bool:
        [decision] = await broker.quotas.reserve(spec.tenant, quota, [(spec.id, 10)])
        if decision.admitted:
            await broker.queue.enqueue(spec)
        return decision.admitted

    # completed
    spec = held_job()
    assert await admit(spec) and not await admit(held_job())
    [lease] = await broker.queue.claim(MODEL, "w1", slots=1)
    assert await broker.queue.complete(lease, ok(lease))
    # dead-lettered by the worker
    assert await admit(held_job())
    [lease] = await broker.queue.claim(MODEL, "w1", slots=1)
    assert await broker.queue.dead_letter(lease, "bad_output")
    # cancelled while waiting
    spec = held_job()
    assert await admit(spec)
    assert await broker.queue.cancel(spec.id) is CancelOutcome.CANCELLED
    # its worker died: the reaper dead-letters it
    assert await admit(held_job())
    await broker.queue.claim(MODEL, "w1", slots=1)
    await asyncio.sleep(0.2)
    assert len((await broker.queue.reap(MODEL)).dead) == 1
    # expired in the queue: the claim that finds it settles it (the sweep finds nothing left)
    assert await admit(held_job(deadline=time.time() + 0.05))
    await asyncio.sleep(0.1)
    assert await broker.queue.claim(MODEL, "w1", slots=1) == []
    assert await broker.quotas.settle_finished() == 0
    spec = held_job()
    assert await admit(spec)
    assert await broker.queue.cancel(spec.id) is CancelOutcome.CANCELLED
    # a reservation whose enqueue never landed is released after the grace time
    [decision] = await broker.quotas.reserve("acme", quota, [(new_job_id(MODEL), 10)])
    assert decision.admitted
    assert await broker.quotas.settle_finished(grace_s=60.0) == 0
    assert await broker.quotas.settle_finished(grace_s=0.0) == 1
    assert await admit(held_job())


def tenant_job(tenant: str, weight: float = 1.0, deadline: float | None = None) -> JobSpec:
    spec = job(tenant=tenant, deadline=deadline)
    spec.weight = weight
    return spec


async def drain_order(broker: Backend, jobs: int, slots: int = 4) -> list[str]:
    """Tenants of the next `jobs` claimed jobs, completing each claim before the next."""
    order: list[str] = []
    while len(order) < jobs:
        leases = await broker.queue.claim(MODEL, "w1", slots=slots)
        assert leases
        order += [lease.spec.tenant for lease in leases]
        await broker.queue.complete_many([(lease, ok(lease)) for lease in leases])
    return order[:jobs]


async def test_a_tenants_backlog_delays_another_by_a_bounded_amount(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend(fair_window=4)
    for _ in range(10):
        await broker.queue.enqueue_many([tenant_job("a") for _ in range(200)])
    await broker.queue.enqueue_many([tenant_job("b") for _ in range(20)])
    assert await broker.queue.depth(MODEL) == 2020
    order = await drain_order(broker, 60)
    if fifo(make_backend):  # the weaker form: arrival order, a's backlog first
        assert order == ["a"] * 60
        return
    # ahead of b's first job: at most the window already in the stream and one job of a
    assert order.index("b") <= 4 + 1
    # then the two share the lane job for job: b's 20 are done within 2 x 20 + the window
    last_b = max(i for i, t in enumerate(order) if t == "b")
    assert order.count("b") == 20 and last_b <= 2 * 20 + 4 + 1
    stats = await broker.queue.stats(MODEL)
    assert sum(lane.waiting for lane in stats.lanes) == 2020 - 60


async def test_weights_split_a_lane_by_token_cost(make_backend: BackendFactory) -> None:
    broker = make_backend(fair_window=1)
    await broker.queue.enqueue_many([tenant_job("a", 1.0) for _ in range(100)])
    await broker.queue.enqueue_many([tenant_job("b", 3.0) for _ in range(100)])
    order = (await drain_order(broker, 81, slots=1))[1:]  # past the one in the stream
    if fifo(make_backend):  # the weaker form: arrival order, weights aside
        assert order == ["a"] * 80
        return
    assert abs(order.count("b") / len(order) - 0.75) <= 0.05


async def test_earliest_deadline_first_within_a_tenant(make_backend: BackendFactory) -> None:
    broker = make_backend(fair_window=1)
    now = time.time()
    late = [tenant_job("a", deadline=now + 300 + i) for i in range(3)]
    none = tenant_job("a")
    urgent = tenant_job("a", deadline=now + 60)
    await broker.queue.enqueue_many([*late, none, urgent])
    claimed = []
    if Trait.DEADLINE_ORDER in make_backend.traits:
        for _ in range(5):
            [lease] = await broker.queue.claim(MODEL, "w1", slots=1)
            claimed.append(lease.spec.id)
            await broker.queue.complete(lease, ok(lease))
    else:
        # without the trait a tenant's jobs run in arrival order: deadlines order what one
        # claim takes (the weaker guarantee, README "Choosing a broker")
        claimed = [lease.spec.id for lease in await broker.queue.claim(MODEL, "w1", slots=5)]
    # one batch is staged whole, then the stream is filled: earliest deadline first, and a job
    # without a deadline after every job with one
    assert claimed == [urgent.id, late[0].id, late[1].id, late[2].id, none.id]


# -- prefix affinity (issue 11 item 4) ---------------------------------------------------------
def prefixed(prefix: str = "sys-a") -> JobSpec:
    spec = job()
    spec.prefix_key = prefix
    return spec


async def test_fifo_lanes_serve_a_prefixed_job_to_any_worker(make_backend: BackendFactory) -> None:
    """The weaker form where lanes are FIFO: a prefix key holds a job for nobody."""
    if Trait.PREFIX_AFFINITY in make_backend.traits:
        pytest.skip("prefix affinity holds jobs here (the tests above)")
    broker = make_backend(affinity_wait_s=30.0)
    await run_prefix(broker, "w1")
    later = prefixed()
    await broker.queue.enqueue(later)
    [lease] = await broker.queue.claim(MODEL, "w2", slots=1)
    assert lease.spec.id == later.id and not lease.affinity


async def drained(broker: Backend, within_s: float = 5.0) -> None:
    """The model's lanes hold nothing once its jobs ended: polled, since a backend may drop an
    acknowledged message a moment after the ack (NATS acks without awaiting an answer)."""
    give_up = time.monotonic() + within_s
    while (depth := await broker.queue.depth(MODEL)) != 0:
        assert time.monotonic() < give_up, f"{depth} jobs still in the lanes"
        await asyncio.sleep(0.02)


async def beat(broker: Backend, worker: str, ttl_s: float = 30.0) -> None:
    info = WorkerInfo(consumer=worker, model=MODEL, engine="sim", host="h", pid=1, started_at=0)
    await broker.registry.heartbeat(info, ttl_s)


async def run_prefix(broker: Backend, worker: str, prefix: str = "sys-a") -> None:
    """Live `worker` claims (and finishes) a job with `prefix`: it becomes the prefix's owner."""
    await beat(broker, worker)
    await broker.queue.enqueue(prefixed(prefix))
    [lease] = await broker.queue.claim(MODEL, worker, slots=1)
    assert await broker.queue.complete(lease, ok(lease))


async def test_prefix_affinity_holds_a_job_for_the_worker_that_ran_its_prefix(
    make_backend: BackendFactory,
) -> None:
    needs_affinity(make_backend)
    broker = make_backend(affinity_wait_s=30.0)
    await run_prefix(broker, "w1")
    await beat(broker, "w2")
    held, plain, other = prefixed(), job(), prefixed("sys-b")
    await broker.queue.enqueue_many([held, plain, other])
    assert await broker.queue.depth(MODEL) == 3
    assert (await broker.queue.stats(MODEL)).lanes[1].waiting == 3  # held jobs count as waiting
    # another worker gets everything but the job held for w1
    taken = await broker.queue.claim(MODEL, "w2", slots=5)
    assert {lease.spec.id for lease in taken} == {plain.id, other.id}
    assert not any(lease.affinity for lease in taken)
    [mine] = await broker.queue.claim(MODEL, "w1", slots=5)
    assert mine.spec.id == held.id and mine.affinity
    assert await broker.queue.renew([mine]) == [True]
    assert await broker.queue.append_events([(mine, TokenChunk(token_ids=[7], text="x"))]) == [True]
    assert await broker.queue.complete(mine, ok(mine))
    record = await broker.queue.record(held.id)
    assert record is not None and record.status is JobStatus.SUCCEEDED
    assert record.worker == "w1"
    for lease in taken:
        assert await broker.queue.complete(lease, ok(lease))
    await drained(broker)
    # w2 ran sys-b last: its next sys-b job waits for w2, not w1
    later = prefixed("sys-b")
    await broker.queue.enqueue(later)
    assert await broker.queue.claim(MODEL, "w1", slots=1) == []
    [again] = await broker.queue.claim(MODEL, "w2", slots=1)
    assert again.spec.id == later.id and again.affinity


async def test_a_held_job_goes_to_any_worker_after_the_affinity_wait(
    make_backend: BackendFactory,
) -> None:
    needs_affinity(make_backend)
    broker = make_backend(affinity_wait_s=0.3)
    await run_prefix(broker, "w1")  # w1 owns the prefix, then is busy (or hangs)
    spec = prefixed()
    await broker.queue.enqueue(spec)
    assert await broker.queue.claim(MODEL, "w2", slots=1) == []  # held for w1
    started = time.monotonic()
    [lease] = await broker.queue.claim(MODEL, "w2", slots=1, block_s=3.0)  # wakes when it is due
    waited = time.monotonic() - started
    assert lease.spec.id == spec.id and lease.affinity
    assert 0.15 < waited < 1.5
    assert await broker.queue.complete(lease, ok(lease))
    # ownership is sticky while w1 lives: the next job still waits for w1, not for w2
    again = prefixed()
    await broker.queue.enqueue(again)
    assert await broker.queue.claim(MODEL, "w2", slots=1) == []
    [mine] = await broker.queue.claim(MODEL, "w1", slots=1)
    assert mine.spec.id == again.id and mine.affinity


async def test_no_job_waits_for_a_worker_whose_heartbeat_lapsed(
    make_backend: BackendFactory,
) -> None:
    needs_affinity(make_backend)
    broker = make_backend(affinity_wait_s=30.0)
    await run_prefix(broker, "w1")
    await beat(broker, "w1", ttl_s=0.2)
    await asyncio.sleep(0.3)  # w1 died: its heartbeat lapsed
    spec = prefixed()
    await broker.queue.enqueue(spec)
    [lease] = await broker.queue.claim(MODEL, "w2", slots=1)  # at once, from the lane
    assert lease.spec.id == spec.id and not lease.affinity
    assert await broker.queue.complete(lease, ok(lease))
    # w2 ran it with w1 gone: w2 owns the prefix now
    await beat(broker, "w2")
    later = prefixed()
    await broker.queue.enqueue(later)
    assert await broker.queue.claim(MODEL, "w3", slots=1) == []
    [mine] = await broker.queue.claim(MODEL, "w2", slots=1)
    assert mine.spec.id == later.id and mine.affinity


async def test_the_preferred_worker_wakes_for_a_job_held_for_it(
    make_backend: BackendFactory,
) -> None:
    needs_affinity(make_backend)
    broker = make_backend(affinity_wait_s=30.0)
    await run_prefix(broker, "w1")
    assert await broker.queue.claim(MODEL, "w1", slots=1) == []  # idle: the next claim waits
    waiter = asyncio.create_task(broker.queue.claim(MODEL, "w1", slots=1, block_s=5.0))
    await asyncio.sleep(0.1)
    started = time.monotonic()
    spec = prefixed()
    await broker.queue.enqueue(spec)
    [lease] = await asyncio.wait_for(waiter, 5.0)
    assert lease.spec.id == spec.id and lease.affinity
    assert time.monotonic() - started < 1.0
    assert await broker.queue.complete(lease, ok(lease))


async def test_an_affinity_lease_is_reaped_and_released_like_any_other(
    make_backend: BackendFactory,
) -> None:
    needs_affinity(make_backend)
    broker = make_backend(affinity_wait_s=30.0, lease_s=0.2)
    await run_prefix(broker, "w1")
    spec = prefixed()
    await broker.queue.enqueue(spec)
    [zombie] = await broker.queue.claim(MODEL, "w1", slots=1)
    assert zombie.affinity
    await asyncio.sleep(0.35)  # w1 died holding it
    assert (await broker.queue.reap(MODEL)).requeued == [spec.id]
    # requeued to the lane itself: any worker takes it at once
    [fresh] = await broker.queue.claim(MODEL, "w2", slots=1)
    assert fresh.spec.id == spec.id and fresh.spec.attempt == 1 and not fresh.affinity
    assert not await broker.queue.complete(zombie, ok(zombie, "zombie"))
    assert await broker.queue.complete(fresh, ok(fresh, "fresh"))
    await broker.registry.deregister(MODEL, "w1")  # w1 is gone for good
    # w2 owns the prefix once it runs it; a drain hands its affinity job back, for anyone
    await run_prefix(broker, "w2")
    spec2 = prefixed()
    await broker.queue.enqueue(spec2)
    [held] = await broker.queue.claim(MODEL, "w2", slots=1)
    assert held.affinity and await broker.queue.release([held]) == 1
    [again] = await broker.queue.claim(MODEL, "w3", slots=1)
    assert again.spec.id == spec2.id and again.spec.attempt == 0
    assert await broker.queue.complete(again, ok(again))
    await drained(broker)


async def test_at_most_max_held_jobs_wait_for_one_worker(make_backend: BackendFactory) -> None:
    needs_affinity(make_backend)
    broker = make_backend(affinity_wait_s=30.0, affinity_max_held=2)
    await run_prefix(broker, "w1")
    specs = [prefixed() for _ in range(4)]
    await broker.queue.enqueue_many(specs)
    # two wait for w1; the rest are staged as usual
    taken = await broker.queue.claim(MODEL, "w2", slots=4)
    assert [lease.spec.id for lease in taken] == [s.id for s in specs[2:]]
    mine = await broker.queue.claim(MODEL, "w1", slots=4)
    assert [lease.spec.id for lease in mine] == [s.id for s in specs[:2]]


async def test_a_held_job_cancelled_while_waiting_never_runs(make_backend: BackendFactory) -> None:
    needs_affinity(make_backend)
    broker = make_backend(affinity_wait_s=30.0)
    await run_prefix(broker, "w1")
    spec = prefixed()
    await broker.queue.enqueue(spec)
    assert await broker.queue.cancel(spec.id) is CancelOutcome.CANCELLED
    assert await broker.queue.claim(MODEL, "w1", slots=1) == []
    await drained(broker)


async def audit_of(broker: Backend, since: float = 0.0, **filters: str) -> list[tuple[str, str]]:
    """(event, status) of every audit entry matching, paging through with small reads."""
    out: list[tuple[str, str]] = []
    cursor = None
    while True:
        cursor, entries = await broker.audit.audit_entries(since, cursor=cursor, count=7, **filters)
        out += [(e.event, e.status) for e in entries]
        if cursor is None:
            return out


async def test_audit_trail_records_receipts_and_terminal_states(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend(fair_window=1)
    start = time.time() - 1
    done, dead, gone = job(tenant="acme"), job(tenant="acme"), job(tenant="bob")
    for spec in (done, dead, gone):
        assert (await broker.queue.enqueue(spec)).created
    # an idempotent replay and a fenced completion leave no entry of their own
    key = job(tenant="acme", key="k1")
    await broker.queue.enqueue(key)
    assert not (await broker.queue.enqueue(job(tenant="acme", key="k1"))).created
    assert await broker.queue.cancel(gone.id) is CancelOutcome.CANCELLED
    leases = await broker.queue.claim(MODEL, "w1", slots=2)
    by_id = {lease.spec.id: lease for lease in leases}
    assert set(by_id) == {done.id, dead.id}
    result = ok(by_id[done.id])
    result.prompt_tokens = 5
    assert await broker.queue.complete(by_id[done.id], result)
    assert not await broker.queue.complete(by_id[done.id], result)  # fenced: already completed
    assert await broker.queue.dead_letter(by_id[dead.id], "bad_input", "no")

    acme = await audit_of(broker, start, tenant="acme")
    assert sorted(acme) == sorted(
        [("received", "queued")] * 3 + [("terminal", "succeeded"), ("terminal", "dead")]
    )
    assert await audit_of(broker, start, tenant="bob") == [
        ("received", "queued"),
        ("terminal", "cancelled"),
    ]
    _, entries = await broker.audit.audit_entries(start, tenant="acme", model=MODEL)
    [finished] = [e for e in entries if e.status == "succeeded"]
    assert (finished.job_id, finished.model, finished.prompt_tokens) == (done.id, MODEL, 5)
    assert finished.completion_tokens == 2 and finished.max_tokens == 4
    assert finished.total_s is not None and finished.received_at == done.created_at
    assert await audit_of(broker, start, model="other") == []
    assert await audit_of(broker, time.time() + 60) == []


async def test_audit_trail_records_a_job_that_expired_in_the_queue(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend()
    start = time.time() - 1
    late = job(tenant="late", deadline=time.time() + 0.05)
    await broker.queue.enqueue(late)
    await asyncio.sleep(0.1)
    assert await broker.queue.claim(MODEL, "w1", slots=1) == []  # the claim ends it, unrun
    assert await audit_of(broker, start, tenant="late") == [
        ("received", "queued"),
        ("terminal", "expired"),
    ]


async def test_audit_trail_is_bounded(make_backend: BackendFactory) -> None:
    broker = make_backend(audit_max_len=10)
    for _ in range(5):
        await broker.queue.enqueue_many([job() for _ in range(100)])
    kept = await audit_of(broker)
    # MAXLEN ~ trims whole stream nodes (100 entries each by default): near the bound
    assert 10 <= len(kept) <= 10 + 100
    off = make_backend(audit_max_len=0)
    before = len(await audit_of(off))
    await off.queue.enqueue(job())
    assert len(await audit_of(off)) == before


async def test_token_budget_per_period_reserves_settles_and_resets(
    make_backend: BackendFactory,
) -> None:
    from datetime import UTC, datetime

    broker = make_backend()
    now = [datetime(2026, 2, 15, 12, tzinfo=UTC).timestamp()]
    broker.quotas.clock = lambda: now[0]  # injected time: the scripts take it instead of TIME
    quota = Quota(token_budget=100, budget_period="month", rpm=1000)
    march = datetime(2026, 3, 1, tzinfo=UTC).timestamp()
    [first] = await broker.quotas.reserve("acme", quota, [("j1", 60)])
    assert first.admitted
    [over] = await broker.quotas.reserve("acme", quota, [("j2", 50)])
    assert (over.admitted, over.reason) == (False, "budget")
    assert abs(over.retry_after_s - (march - now[0])) < 1e-3
    assert over.requests is not None and over.requests[1] == 999  # the refusal took nothing
    [huge] = await broker.quotas.reserve("acme", quota, [("j9", 101)])
    assert huge.reason == "too_large"
    # settled to its real count: the unused 40 come back within the month
    assert await broker.quotas.settle([Settlement("acme", "j1", 20)]) == 1
    [fits] = await broker.quotas.reserve("acme", quota, [("j2", 50)])
    assert fits.admitted
    [full] = await broker.quotas.reserve("acme", quota, [("j3", 31)])
    assert full.reason == "budget"
    # a new month: the whole budget again; February's job refunds nothing into it
    now[0] = march + 1
    [fresh] = await broker.quotas.reserve("acme", quota, [("j4", 100)])
    assert fresh.admitted
    assert await broker.quotas.settle([Settlement("acme", "j2", 0)]) == 1
    [none] = await broker.quotas.reserve("acme", quota, [("j5", 1)])
    assert none.reason == "budget"
    # calendar months across a year's end, and plain seconds (epoch-aligned windows)
    now[0] = datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC).timestamp()
    monthly = Quota(token_budget=5, budget_period="month")
    [dec] = await broker.quotas.reserve("bob", monthly, [("b1", 5)])
    [dec_over] = await broker.quotas.reserve("bob", monthly, [("b2", 1)])
    assert dec.admitted and dec_over.reason == "budget"
    assert abs(dec_over.retry_after_s - 1.0) < 1e-3  # to midnight UTC, Jan 1st
    now[0] += 1
    assert (await broker.quotas.reserve("bob", monthly, [("b3", 5)]))[0].admitted
    [end] = await broker.quotas.reserve(
        "eve", Quota(token_budget=5, budget_period="month"), [("e", 9)]
    )
    assert end.reason == "too_large"
    hourly = Quota(token_budget=5, budget_period="3600")
    now[0] = 7200.0 + 1800
    assert (await broker.quotas.reserve("ann", hourly, [("a1", 5)]))[0].admitted
    [later] = await broker.quotas.reserve("ann", hourly, [("a2", 5)])
    assert later.reason == "budget" and abs(later.retry_after_s - 1800) < 1e-3
    now[0] = 10800.0
    assert (await broker.quotas.reserve("ann", hourly, [("a3", 5)]))[0].admitted


# -- the queue's hot path (issue 16 item 2): fewer commands, the same behaviour ----------------
async def test_a_lease_naming_another_consumer_is_fenced(make_backend: BackendFactory) -> None:
    broker = make_backend()
    await broker.queue.enqueue(job())
    [lease] = await broker.queue.claim(MODEL, "w1", slots=1)
    forged = msgspec.structs.replace(lease, consumer="w2")
    assert await broker.queue.complete_many([(forged, ok(forged))]) == [False]
    assert await broker.queue.complete(lease, ok(lease))
    assert (await broker.queue.stats(MODEL)).fenced_completions == 1


async def test_jobs_enqueued_one_at_a_time_take_the_same_fair_turns(
    make_backend: BackendFactory,
) -> None:
    """A lone job into an idle lane skips staging (enqueue.lua's fast path) but leaves its
    tenant's tag as staging would: the turns that follow are the staged path's."""
    broker = make_backend(fair_window=1)
    order = []
    first = tenant_job("a")
    await broker.queue.enqueue(first)  # idle lane: straight into the stream
    [lease] = await broker.queue.claim(MODEL, "w1", slots=1)
    order.append(lease.spec.id)
    assert await broker.queue.complete(lease, ok(lease))
    specs = [tenant_job("a"), tenant_job("b", 2.0), tenant_job("a"), tenant_job("b", 2.0)]
    specs += [tenant_job("a"), tenant_job("b", 2.0), tenant_job("c")]
    for spec in specs:  # the first into the stream at once, the rest staged behind it
        await broker.queue.enqueue(spec)
    for _ in specs:
        [lease] = await broker.queue.claim(MODEL, "w1", slots=1)
        order.append(lease.spec.id)
        assert await broker.queue.complete(lease, ok(lease))
    names = {spec.id: f"{spec.tenant}{i}" for i, spec in enumerate([first, *specs])}
    # a's tag moved by each of its jobs, the fast-path one included; b's weight halves its cost
    if fifo(make_backend):
        assert [names[i] for i in order] == ["a0", "a1", "b2", "a3", "b4", "a5", "b6", "c7"]
    elif Trait.FAIR_WINDOW in make_backend.traits:
        assert [names[i] for i in order] == ["a0", "a1", "b2", "c7", "b4", "a3", "b6", "a5"]
    else:  # no window: a1 waits its turn like the rest (b and c start at a0's tag)
        assert [names[i] for i in order] == ["a0", "b2", "c7", "b4", "a1", "b6", "a3", "a5"]


async def test_a_waiting_claim_wakes_for_work_in_any_lane_after_others_took_the_rest(
    make_backend: BackendFactory,
) -> None:
    """A claim's wait hint may skip lanes with nothing after it (claim.lua's `after`): work
    another worker took meanwhile, or work that lands in any lane later, changes nothing."""
    waiter, other = make_backend(), make_backend()
    assert await waiter.queue.claim(MODEL, "w1", slots=2, block_s=0.05) == []  # idle: hints known
    if not pushed(make_backend):  # (pushed, it would be the waiter's: the idle claim's consumer)
        taken = job()
        await other.queue.enqueue(taken)
        [lease] = await other.queue.claim(MODEL, "w2", slots=1)  # newer than w1's hint, and gone
        assert await other.queue.complete(lease, ok(lease))
    assert await waiter.queue.claim(MODEL, "w1", slots=2, block_s=0.2) == []
    for priority in (Priority.LOW, Priority.NORMAL, Priority.HIGH):
        spec = job(priority)
        pending = asyncio.create_task(waiter.queue.claim(MODEL, "w1", slots=2, block_s=5.0))
        await asyncio.sleep(0.05)
        await other.queue.enqueue(spec)
        leases = await asyncio.wait_for(pending, 3.0)
        assert [lease.spec.id for lease in leases] == [spec.id]
        assert await waiter.queue.complete(leases[0], ok(leases[0]))
    # a retry due while the waiter's lanes are quiet is still taken
    again = job()
    await other.queue.enqueue(again)
    [lease] = await waiter.queue.claim(MODEL, "w1", slots=1, block_s=1.0)
    assert await waiter.queue.retry(lease, "boom")
    [retried] = await waiter.queue.claim(MODEL, "w1", slots=1, block_s=5.0)
    assert retried.spec.id == again.id and retried.spec.attempt == 1
    assert await waiter.queue.complete(retried, ok(retried))


async def test_reading_one_event_at_a_time_sees_every_event(make_backend: BackendFactory) -> None:
    """A reader asking for one event gets the first one, whatever a backend keeps beside the
    events (NATS: the claim marker each delivery appends first)."""
    broker = make_backend()
    spec = job()
    await broker.queue.enqueue(spec)
    [lease] = await broker.queue.claim(MODEL, "w1", slots=1)
    await broker.queue.append_events([(lease, TokenChunk(token_ids=[1], text="a"))])
    assert await broker.queue.complete(lease, ok(lease), TokenChunk(token_ids=[2], text="b"))
    seen, after = [], "0"
    while True:
        found = await broker.queue.read_events(spec.id, after=after, count=1)
        if not found:
            break
        assert len(found) == 1
        after = found[0][0]
        seen.append(found[0][1])
    assert [e.text for e in seen if isinstance(e, TokenChunk)] == ["a", "b"]
    assert isinstance(seen[-1], Finished) and len(seen) == 3


async def test_a_tenant_consumer_the_server_removed_is_made_again(
    make_backend: BackendFactory,
) -> None:
    """NATS removes a tenant's pull consumer idle past its inactive threshold; a worker that
    made it before still takes that tenant's next job."""
    if make_backend.kind != "nats":
        pytest.skip("NATS's pull consumers")
    broker = make_backend()
    await broker.queue.enqueue(job())
    [lease] = await broker.queue.claim(MODEL, "w1", slots=1)
    assert await broker.queue.complete(lease, ok(lease))
    queue = broker.queue
    assert isinstance(queue, NatsQueue)
    js = await queue.conn.js()
    for stream, name in list(queue.store.consumers):
        await js.delete_consumer(stream, name)  # as the server does once it idles too long
    spec = job()
    await queue.enqueue(spec)
    assert [x.spec.id for x in await queue.claim(MODEL, "w1", slots=1, block_s=1.0)] == [spec.id]
