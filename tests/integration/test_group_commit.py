"""Group commit in the Redis broker: concurrent single-job enqueues share script calls, a full
lane refuses only its own jobs, a job that cannot be encoded fails alone (on NATS too), and a
caller that leaves does not take the batch with it."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from tests.conftest import BackendFactory
from tokenyard.broker import Backend, connect, new_job_id
from tokenyard.broker.core import EnqueueResult
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings
from tokenyard.errors import InvalidRequest, QueueFull
from tokenyard.messages import JobSpec, JobStatus, Priority, SamplingParams

MODEL = "m"


def spec(priority: Priority = Priority.NORMAL) -> JobSpec:
    return JobSpec(id=new_job_id(MODEL), model=MODEL, prompt="x", priority=priority)


def broker_on(valkey: EmbeddedServer, prefix: str = "", max_queue_depth: int = 100) -> Backend:
    prefix = prefix or f"gc{uuid.uuid4().hex[:8]}"
    return connect(BrokerSettings(url=valkey.url, prefix=prefix, max_queue_depth=max_queue_depth))


async def test_concurrent_enqueues_share_script_calls(valkey: EmbeddedServer) -> None:
    broker = broker_on(valkey, max_queue_depth=1000)
    try:
        alone = await broker.queue.enqueue(spec())  # light load: goes at once, in a call of its own
        assert alone.created and broker.queue._group.calls == 1
        specs = [spec() for _ in range(200)]
        results = await asyncio.gather(*(broker.queue.enqueue(s) for s in specs))
        assert [r.job_id for r in results] == [s.id for s in specs]
        assert all(r.created for r in results)
        # the first goes alone; the rest pile up behind it, at most 64 per call
        assert 1 + 4 <= broker.queue._group.calls <= 1 + 1 + 4, broker.queue._group.calls
        assert await broker.queue.depth(MODEL) == 201
    finally:
        await broker.close()


async def test_a_full_lane_refuses_only_its_own_jobs(valkey: EmbeddedServer) -> None:
    broker = broker_on(valkey, max_queue_depth=4)
    try:
        specs = [spec() for _ in range(8)] + [spec(Priority.LOW) for _ in range(4)]
        outcomes = await asyncio.gather(
            *(broker.queue.enqueue(s) for s in specs), return_exceptions=True
        )
        normal, low = outcomes[:8], outcomes[8:]
        assert sum(isinstance(o, QueueFull) for o in normal) == 4
        assert not any(isinstance(o, BaseException) for o in low)
    finally:
        await broker.close()


async def test_a_caller_that_leaves_does_not_cancel_the_batch(valkey: EmbeddedServer) -> None:
    broker = broker_on(valkey)
    try:
        first = asyncio.create_task(broker.queue.enqueue(spec()))
        await asyncio.sleep(0)  # its call is in flight: the next ones wait for it
        leaving, staying = spec(), spec()
        gone = asyncio.create_task(broker.queue.enqueue(leaving))
        kept = asyncio.create_task(broker.queue.enqueue(staying))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        await first
        assert (await kept).created
        await broker.close()  # lets the batch in flight land
        broker = broker_on(valkey, prefix=broker.settings.prefix)
        for job in (leaving, staying):
            record = await broker.queue.record(job.id)
            assert record is not None and record.status is JobStatus.QUEUED
    finally:
        await broker.close()


def bad(i: int) -> JobSpec:
    """A job no backend can encode: an int past 64 bits (the gateway refuses such a seed)."""
    if (i // 20) % 2:
        return JobSpec(id=new_job_id(MODEL), model=MODEL, prompt_token_ids=[5, 2**70])
    sampling = SamplingParams(seed=2**64 + i)
    return JobSpec(id=new_job_id(MODEL), model=MODEL, prompt="x", sampling=sampling)


@pytest.mark.parametrize("make_backend", ["valkey", "nats"], indirect=True)
async def test_a_job_that_cannot_be_encoded_fails_alone(make_backend: BackendFactory) -> None:
    broker = make_backend(max_queue_depth=1000)
    first = asyncio.create_task(broker.queue.enqueue(spec()))
    await asyncio.sleep(0)  # its call is in flight: the jobs below batch up behind it
    jobs = [
        bad(i) if i % 20 == 7 else JobSpec(id=new_job_id(MODEL), model=MODEL, prompt="x")
        for i in range(60)
    ]
    for i, job in enumerate(jobs):
        job.tenant = f"tenant{i % 3}"
    outcomes = await asyncio.gather(
        *(broker.queue.enqueue(j) for j in jobs), return_exceptions=True
    )
    assert (await first).created
    for job, outcome in zip(jobs, outcomes, strict=True):
        if job.prompt is None or job.sampling.seed is not None:
            assert isinstance(outcome, InvalidRequest), outcome
            assert outcome.code == "invalid_value"
            assert await broker.queue.record(job.id) is None
        else:
            assert isinstance(outcome, EnqueueResult) and outcome.created, outcome
    assert await broker.queue.depth(MODEL) == 1 + 57
    assert broker.queue._group.calls < 1 + 57  # the good ones still went in batches
