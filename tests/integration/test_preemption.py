"""Preemption end to end: a real worker (sim engine) full of batch-lane work hands sequences
back for high-priority jobs, on Valkey, NATS and RabbitMQ; every preempted job completes with
a stream that has no gap and no duplicate, and no job is preempted past its bound."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from tests.conftest import BackendFactory
from tests.integration.test_broker_conformance import needs_affinity, ok
from tokenyard.broker import Backend, new_job_id
from tokenyard.config import WorkerSettings
from tokenyard.engines import EngineRequest
from tokenyard.engines.sim import SimEngine
from tokenyard.messages import (
    Finished,
    JobRecord,
    JobSpec,
    JobStatus,
    Priority,
    SamplingParams,
    TokenChunk,
    WorkerInfo,
)
from tokenyard.worker.worker import Worker

MODEL = "sim-preempt"
SLOTS = 4
BATCH_TOKENS = 80

pytestmark = pytest.mark.parametrize("make_backend", ["valkey", "nats", "rabbitmq"], indirect=True)


class StepClock(SimEngine):
    """The sim engine, noting the step count at which each request was added or aborted."""

    def __init__(self) -> None:
        super().__init__(decode_base=0.01, decode_per_seq=1e-4, prefill_base=0.001)
        self.added: dict[str, int] = {}
        self.aborted: dict[str, int] = {}  # the step of each sequence's latest abort
        self.aborts: dict[str, int] = {}  # how often each sequence was aborted
        self.caps: list[int | None] = []  # each step prefill cap the worker set

    def cap_prefill(self, tokens: int | None) -> None:
        self.caps.append(tokens)
        super().cap_prefill(tokens)

    def add(self, request: EngineRequest) -> None:
        self.added[request.seq_id] = self.stats().steps
        super().add(request)

    def abort(self, seq_id: str) -> None:
        self.aborted[seq_id] = self.stats().steps
        self.aborts[seq_id] = self.aborts.get(seq_id, 0) + 1
        super().abort(seq_id)


def spec(priority: Priority, prompt: str, max_tokens: int, stream: bool = True) -> JobSpec:
    return JobSpec(
        id=new_job_id(MODEL),
        model=MODEL,
        prompt=prompt,
        priority=priority,
        stream=stream,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


async def expected_tokens(prompt: str, n: int) -> list[int]:
    """What the sim engine makes of `prompt` in one uninterrupted run."""
    direct = SimEngine(decode_base=0.0)
    await direct.start()
    direct.add(
        EngineRequest(
            "ref", direct.tokenizer.encode(prompt), SamplingParams(max_tokens=n, temperature=0.0)
        )
    )
    out: list[int] = []
    while len(out) < n:
        out += [t for o in await direct.outputs() for t in o.token_ids]
    await direct.stop()
    return out


async def finished(broker: Backend, job_id: str, timeout: float = 60.0) -> JobRecord:
    after = "0"
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        for event_id, event in await broker.queue.read_events(job_id, after=after, block_s=0.5):
            after = event_id
            if isinstance(event, Finished):
                # NATS writes the event before the record's compare-and-set lands
                while (record := await broker.queue.record(job_id)) is None or (
                    not record.status.terminal
                ):
                    assert time.monotonic() < give_up, f"{job_id}'s record never ended"
                    await asyncio.sleep(0.01)
                return record
    raise AssertionError(f"{job_id} did not finish in {timeout} s")


async def until(check: Callable[[], bool], timeout: float = 20.0) -> None:
    give_up = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < give_up, "condition not met in time"
        await asyncio.sleep(0.01)


@pytest.fixture
async def worker_on(make_backend: BackendFactory) -> AsyncIterator[Callable[..., Worker]]:
    started: list[tuple[Worker, asyncio.Task[None]]] = []

    def start(broker: Backend, engine: SimEngine, **more: Any) -> Worker:
        settings = WorkerSettings(
            model=MODEL,
            engine="sim",
            heartbeat_s=0.2,
            max_seqs=SLOTS,
            batch_share=1.0,  # batch work may take every slot: the load saturates
            claim_ahead=1,
            **more,
        )
        worker = Worker(broker, engine, settings)
        started.append((worker, asyncio.create_task(worker.run())))
        return worker

    yield start
    for worker, _ in started:
        worker.drain()
    for _, task in started:
        await asyncio.wait_for(task, 30)


async def saturate(broker: Backend, worker: Worker, n: int) -> list[JobSpec]:
    # half of them streamed, half read only as a result (they write no token events of their
    # own: a preemption writes their tokens so far)
    batch = [spec(Priority.BATCH, f"batch {i}", BATCH_TOKENS, stream=i % 2 == 0) for i in range(n)]
    await broker.queue.enqueue_many(batch)
    await until(lambda: worker.scheduler.running == SLOTS)
    await asyncio.sleep(0.1)  # a few steps in: each has tokens to resume after
    return batch


async def check_batch(broker: Backend, batch: list[JobSpec]) -> list[JobRecord]:
    records = []
    for job in batch:
        record = await finished(broker, job.id)
        assert record.status is JobStatus.SUCCEEDED and record.result is not None, record
        want = await expected_tokens(job.prompt or "", BATCH_TOKENS)
        assert record.result.token_ids == want  # resumed exactly where it was preempted
        streamed = [
            t
            for _, e in await broker.queue.read_events(job.id)
            if isinstance(e, TokenChunk)
            for t in e.token_ids
        ]
        if job.stream:
            assert streamed == want  # the client's stream: no gap, no duplicate
        else:
            assert streamed == want[: len(streamed)]  # what preemptions wrote, in order
        records.append(record)
    return records


async def test_high_priority_work_preempts_batch_work_and_nothing_is_lost(
    make_backend: BackendFactory, worker_on: Callable[..., Worker]
) -> None:
    broker = make_backend(lease_s=5.0)
    engine = StepClock()
    worker = worker_on(broker, engine)
    batch = await saturate(broker, worker, 2 * SLOTS)
    high = [spec(Priority.HIGH, f"urgent {i}", 4) for i in range(2)]
    await broker.queue.enqueue_many(high)
    for job in high:
        record = await finished(broker, job.id)
        assert record.status is JobStatus.SUCCEEDED, record
    # the high jobs did not wait for a batch job to end: none had when they were done
    done_batch = [await broker.queue.record(j.id) for j in batch]
    assert all(r is not None and not r.status.terminal for r in done_batch)
    preempted = [j for j in engine.aborted if j not in {h.id for h in high}]
    assert len(preempted) >= len(high)
    for job in high:
        # it started within one engine step of the preemption that freed its slot
        freed = max(step for step in engine.aborted.values() if step <= engine.added[job.id])
        assert engine.added[job.id] - freed <= 1
    records = await check_batch(broker, batch)
    times = sum(engine.aborts[j] for j in preempted)
    assert sum(r.preemptions for r in records) == times
    assert worker.metrics.preemptions._value.get() == times
    _, trail = await broker.audit.audit_entries(0.0, model=MODEL)
    assert sum(e.event == "preempted" for e in trail) == times


async def test_a_high_job_claimed_caps_the_prefill_of_steps_and_resumed_work_is_exact(
    make_backend: BackendFactory, worker_on: Callable[..., Worker]
) -> None:
    broker = make_backend(lease_s=5.0)
    engine = StepClock()
    worker = worker_on(broker, engine, prefill_cap_tokens=16, prefill_cap_window_s=0.3)
    batch = await saturate(broker, worker, 2 * SLOTS)
    assert engine.caps == []  # batch work alone: no lane above it came
    high = spec(Priority.HIGH, "urgent", 4)
    await broker.queue.enqueue(high)
    await until(lambda: engine.caps == [16])  # claimed: steps prefill at most 16 tokens
    assert (await finished(broker, high.id)).status is JobStatus.SUCCEEDED
    await until(lambda: engine.caps == [16, None])  # the window passed while batch work ran
    # its victim resumed from prompt + tokens (more than 16) split over steps, token-exact
    records = await check_batch(broker, batch)
    assert sum(r.preemptions for r in records) >= 1


async def test_by_default_a_high_job_claimed_caps_the_prefill_of_steps(
    make_backend: BackendFactory, worker_on: Callable[..., Worker]
) -> None:
    """The cap is on unless set to 0: a worker given no cap caps its steps' prefill at the
    default while high work came, and lifts it once the window passed."""
    broker = make_backend(lease_s=5.0)
    engine = StepClock()
    worker = worker_on(broker, engine, prefill_cap_window_s=0.3)
    default = WorkerSettings().prefill_cap_tokens
    assert worker.settings.prefill_cap_tokens == default > 0
    batch = await saturate(broker, worker, 2 * SLOTS)
    assert engine.caps == []
    high = spec(Priority.HIGH, "urgent", 4)
    await broker.queue.enqueue(high)
    await until(lambda: engine.caps == [default])
    assert (await finished(broker, high.id)).status is JobStatus.SUCCEEDED
    await until(lambda: engine.caps == [default, None])
    await check_batch(broker, batch)


async def test_a_job_preempted_its_maximum_number_of_times_is_not_preempted_again(
    make_backend: BackendFactory, worker_on: Callable[..., Worker]
) -> None:
    broker = make_backend(lease_s=5.0, max_preemptions=1)
    engine = StepClock()
    worker = worker_on(broker, engine)
    batch = await saturate(broker, worker, SLOTS)
    for wave in range(3):  # more high work than the bound lets the batch jobs yield to
        high = [spec(Priority.HIGH, f"wave {wave} {i}", 2) for i in range(SLOTS)]
        await broker.queue.enqueue_many(high)
        for job in high:
            assert (await finished(broker, job.id)).status is JobStatus.SUCCEEDED
    records = await check_batch(broker, batch)
    assert all(r.preemptions <= 1 for r in records)
    assert any(r.preemptions == 1 for r in records)
    for job, record in zip(batch, records, strict=True):
        # each time it left the engine was a preemption: one at its bound was not tried
        assert engine.aborts.get(job.id, 0) == record.preemptions


async def test_normal_work_yields_to_high_work_the_lanes_report_waiting(
    make_backend: BackendFactory, worker_on: Callable[..., Worker]
) -> None:
    """No claim is open past the reserve while normal work runs: the look-out finds the
    high job in the lanes' stats once it waited `preempt_after_s`, and preempts for it."""
    broker = make_backend(lease_s=5.0)
    engine = StepClock()
    worker = worker_on(broker, engine)
    normal = [spec(Priority.NORMAL, f"normal {i}", BATCH_TOKENS) for i in range(SLOTS + 1)]
    await broker.queue.enqueue_many(normal)
    await until(lambda: worker.scheduler.running == SLOTS and worker.scheduler.waiting == 1)
    await asyncio.sleep(0.1)
    urgent = spec(Priority.HIGH, "urgent", 4)
    await broker.queue.enqueue(urgent)
    assert (await finished(broker, urgent.id)).status is JobStatus.SUCCEEDED
    done = [await broker.queue.record(j.id) for j in normal]
    assert all(r is not None and not r.status.terminal for r in done)  # it did not wait for one
    records = await check_batch(broker, normal)
    assert sum(r.preemptions for r in records) >= 1


async def test_a_job_another_worker_preempted_to_its_bound_is_not_taken_out_here(
    make_backend: BackendFactory, worker_on: Callable[..., Worker]
) -> None:
    """The bound travels with the lease: a worker that never preempted a job, claiming it
    after another worker preempted it its maximum number of times, does not take it out of
    its engine only to be refused (the job would then wait here for a free slot)."""
    broker = make_backend(lease_s=5.0, max_preemptions=1)
    batch = [spec(Priority.BATCH, f"batch {i}", BATCH_TOKENS) for i in range(SLOTS)]
    await broker.queue.enqueue_many(batch)
    leases = []
    give_up = time.monotonic() + 10
    while len(leases) < SLOTS:  # another worker holds them, then preempts each once
        assert time.monotonic() < give_up, "the batch jobs were not claimed"
        leases += await broker.queue.claim(MODEL, "other", SLOTS - len(leases), block_s=0.2)
    assert all(await broker.queue.preempt(leases))
    engine = StepClock()
    worker = worker_on(broker, engine)
    await until(lambda: worker.scheduler.running == SLOTS)
    assert all(job.handle.preemptions == 1 for job in worker.scheduler.running_jobs())
    urgent = spec(Priority.HIGH, "urgent", 2)
    await broker.queue.enqueue(urgent)
    assert (await finished(broker, urgent.id)).status is JobStatus.SUCCEEDED
    records = await check_batch(broker, batch)
    assert all(r.preemptions == 1 for r in records)
    assert not any(engine.aborts.get(job.id) for job in batch)  # none left the engine here
    assert worker.metrics.preemptions._value.get() == 0


async def test_work_this_worker_cannot_claim_does_not_churn_its_running_jobs(
    make_backend: BackendFactory, worker_on: Callable[..., Worker]
) -> None:
    """A high job waits in a size pool this worker does not serve (its context is below the
    pool's bound): a preemption would only free a slot that the claim fills with normal work
    again, so the look-out asks only about the pools its worker serves."""
    broker = make_backend(lease_s=5.0, size_pools="200,100000", max_preemptions=10)
    engine = StepClock()
    worker = worker_on(broker, engine)
    assert worker.pools == [0]
    long = 190  # ~2 s of steps, in pool 0 with its prompt
    normal = [spec(Priority.NORMAL, f"normal {i}", long) for i in range(SLOTS + 1)]
    await broker.queue.enqueue_many(normal)
    await until(lambda: worker.scheduler.running == SLOTS and worker.scheduler.waiting == 1)
    big = spec(Priority.HIGH, "big", 300)  # pool 1: prompt + max_tokens above 200
    await broker.queue.enqueue(big)
    await asyncio.sleep(1.0)
    # not a victim every look (40 in this second before, each job preempted to its bound)
    assert sum(engine.aborts.values()) == 0, engine.aborts
    for job in normal:
        done = await finished(broker, job.id)
        assert done.result is not None
        assert done.result.token_ids == await expected_tokens(job.prompt or "", long)
    record = await broker.queue.record(big.id)
    assert record is not None and record.status is JobStatus.QUEUED  # nobody here may run it


async def test_work_held_for_another_worker_is_not_preempted_for_at_every_look(
    make_backend: BackendFactory, worker_on: Callable[..., Worker]
) -> None:
    """A high job held for the worker that ran its prefix (prefix affinity) waits in the
    lanes, but only its owner may claim it while the hold lasts: once the claim after a
    preemption did not bring it, the look-out leaves it a while, longer each time."""
    needs_affinity(make_backend)
    broker = make_backend(lease_s=5.0, affinity_wait_s=30.0, max_preemptions=10)
    owner = WorkerInfo(consumer="owner", model=MODEL, engine="sim", host="h", pid=1, started_at=0)
    await broker.registry.heartbeat(owner, 30.0)
    first = spec(Priority.HIGH, "system", 2)
    first.prefix_key = "sys-a"
    await broker.queue.enqueue(first)
    [lease] = await broker.queue.claim(MODEL, "owner", slots=1, block_s=5.0)
    assert await broker.queue.complete(lease, ok(lease))  # the owner of prefix sys-a now
    engine = StepClock()
    worker = worker_on(broker, engine)
    long = 190  # ~2 s of steps
    normal = [spec(Priority.NORMAL, f"normal {i}", long) for i in range(SLOTS + 1)]
    await broker.queue.enqueue_many(normal)
    await until(lambda: worker.scheduler.running == SLOTS and worker.scheduler.waiting == 1)
    held = spec(Priority.HIGH, "held", 4)
    held.prefix_key = "sys-a"
    await broker.queue.enqueue(held)  # held for the owner, busy elsewhere
    await asyncio.sleep(1.0)
    # tried at once, then after 0.25 s and 0.5 s more: not a victim every look (each job
    # preempted to its bound, ~40 in this second, without the hunch). Valkey gives a held
    # job no waiting age (it is not in the lane's stream), so the look-out never tries there
    assert sum(engine.aborts.values()) <= 3, engine.aborts
    for job in normal:
        done = await finished(broker, job.id)
        assert done.result is not None
        assert done.result.token_ids == await expected_tokens(job.prompt or "", long)
