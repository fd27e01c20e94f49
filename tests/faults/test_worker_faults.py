"""Worker processes killed and drained for real, serving the tiny model through a real broker."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import jsonschema
import pytest

from tests.conftest import BackendFactory, kinds
from tokenyard.broker import Backend, new_job_id
from tokenyard.fleet.launch import Launcher, Processes
from tokenyard.messages import (
    Finished,
    Guide,
    JobResult,
    JobSpec,
    JobStatus,
    SamplingParams,
    TokenChunk,
)
from tokenyard.tenancy.limiter import Quota

pytestmark = [pytest.mark.fault, pytest.mark.slow]
# a worker's fault needs nothing of the harness: every kind (RabbitMQ lanes' run under
# `make test-brokers`)
KINDS = pytest.mark.parametrize("make_backend", kinds(), indirect=True)

MODEL = "tiny"
LEASE_S = 2.0


class Workers:
    """Spawns `python -m tokenyard worker` processes and kills them all at the end."""

    def __init__(self, url: str, prefix: str, tables_url: str = "") -> None:
        self.url = url
        self.prefix = prefix
        self.processes = Processes()
        self.launcher = Launcher(self.processes, url, prefix, tables_url)

    def start(
        self,
        *extra: str,
        engine: str = "hf",
        env: dict[str, str] | None = None,
        lease_s: float = LEASE_S,
    ) -> subprocess.Popen[bytes]:
        return self.launcher.worker(
            "--model", MODEL, "--engine", engine, "--max-seqs", "16",
            "--lease-s", str(lease_s), *extra,
            env={**os.environ, **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip

    def stop_all(self) -> None:
        self.processes.stop(timeout_s=10, sig=signal.SIGKILL)


@pytest.fixture
def workers(make_backend: BackendFactory) -> Iterator[Workers]:
    pool = Workers(make_backend.url, make_backend.prefix, make_backend.tables_url)
    try:
        yield pool
    finally:
        pool.stop_all()


@pytest.fixture
def broker(make_backend: BackendFactory, workers: Workers) -> Backend:
    return make_backend(lease_s=LEASE_S)


def greedy_jobs(n: int, max_tokens: int = 24) -> list[JobSpec]:
    return [
        JobSpec(
            id=new_job_id(MODEL),
            model=MODEL,
            prompt=f"The yard sorts car number {i} onto lane {i % 3}",
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )
        for i in range(n)
    ]


async def results(broker: Backend, ids: list[str], timeout: float) -> dict[str, JobResult]:
    give_up = time.monotonic() + timeout
    done: dict[str, JobResult] = {}
    while len(done) < len(ids):
        assert time.monotonic() < give_up, f"{len(ids) - len(done)} jobs never finished"
        for job_id in ids:
            if job_id not in done:
                record = await broker.queue.record(job_id)
                if record is not None and record.result is not None:
                    done[job_id] = record.result
        await asyncio.sleep(0.2)
    return done


async def streamed_text(broker: Backend, job_id: str) -> tuple[str, int]:
    """The text a reader of the event stream saw, and how many Finished events it got."""
    events = [e for _, e in await broker.queue.read_events(job_id, count=100_000)]
    text = "".join(e.text for e in events if isinstance(e, TokenChunk))
    return text, sum(isinstance(e, Finished) for e in events)


async def wait_for_tokens(broker: Backend, ids: list[str], at_least: int) -> None:
    give_up = time.monotonic() + 120
    while time.monotonic() < give_up:
        started = 0
        for job_id in ids:
            if await broker.queue.read_events(job_id, count=1):
                started += 1
        if started >= at_least:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("workers never started streaming")


@KINDS
async def test_sigkill_mid_generation_resumes_to_identical_text(
    workers: Workers, broker: Backend
) -> None:
    reference_jobs = greedy_jobs(50)
    first = workers.start()
    await broker.queue.enqueue_many(reference_jobs)
    reference = await results(broker, [j.id for j in reference_jobs], timeout=240)

    jobs = greedy_jobs(50)
    await broker.queue.enqueue_many(jobs)
    ids = [j.id for j in jobs]
    await wait_for_tokens(broker, ids, at_least=8)
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    mid_flight = [
        r
        for r in [await broker.queue.record(i) for i in ids]
        if r and r.status is JobStatus.RUNNING
    ]
    assert mid_flight, "the kill should catch jobs in flight"

    workers.start()
    done = await results(broker, ids, timeout=240)
    for ref_job, job in zip(reference_jobs, jobs, strict=True):
        result = done[job.id]
        assert result.status is JobStatus.SUCCEEDED
        assert result.text == reference[ref_job.id].text
        assert result.token_ids == reference[ref_job.id].token_ids
        text, finishes = await streamed_text(broker, job.id)
        assert text == result.text and finishes == 1  # the reader saw one unbroken answer
    resumed = [r for r in [await broker.queue.record(i) for i in ids] if r and r.deliveries > 1]
    assert len(resumed) >= len(mid_flight)


@KINDS
async def test_sigterm_under_load_drains_without_loss_or_duplicates(
    workers: Workers, broker: Backend
) -> None:
    first = workers.start("--drain-timeout-s", "1")
    jobs = greedy_jobs(60, max_tokens=48)
    await broker.queue.enqueue_many(jobs)
    ids = [j.id for j in jobs]
    await wait_for_tokens(broker, ids, at_least=8)
    first.send_signal(signal.SIGTERM)
    assert first.wait(60) == 0, first.stderr.read().decode() if first.stderr else ""
    assert not await broker.registry.workers(MODEL)  # it deregistered

    workers.start()
    done = await results(broker, ids, timeout=240)
    assert all(r.status is JobStatus.SUCCEEDED for r in done.values())
    for job_id in ids:
        text, finishes = await streamed_text(broker, job_id)
        assert finishes == 1 and text == done[job_id].text
        assert done[job_id].completion_tokens == 48
    stats = await broker.queue.stats(MODEL)
    assert stats.dead_letters == 0
    assert sum(lane.waiting + lane.in_flight for lane in stats.lanes) == 0


@KINDS
async def test_worker_process_exits_cleanly_on_sigterm_when_idle(
    workers: Workers, broker: Backend
) -> None:
    proc = workers.start()
    give_up = time.monotonic() + 120
    while not await broker.registry.workers(MODEL):
        assert time.monotonic() < give_up and proc.poll() is None, "worker never registered"
        await asyncio.sleep(0.1)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(60) == 0
    assert not await broker.registry.workers(MODEL)


@KINDS
async def test_poison_jobs_end_failed_or_dead_and_no_worker_restarts(
    workers: Workers, broker: Backend
) -> None:
    """Jobs no engine can take, batched among 100 good ones: each poison ends with its reason."""
    env = {"TOKENYARD_BROKER_MAX_DELIVERIES": "2", "TOKENYARD_BROKER_BACKOFF_BASE_S": "0.05"}
    procs = [workers.start(engine="sim", env=env) for _ in range(2)]
    give_up = time.monotonic() + 60
    while len(await broker.registry.workers(MODEL)) < 2:
        assert time.monotonic() < give_up, "workers never registered"
        await asyncio.sleep(0.1)
    consumers = {w.consumer for w in await broker.registry.workers(MODEL)}
    [limits] = {w.limits for w in await broker.registry.workers(MODEL)}
    assert limits is not None and limits.vocab_size > 0

    def poison(name: str, prompt: str | None, ids: list[int] | None) -> JobSpec:
        sampling = SamplingParams(max_tokens=16, temperature=0.0)
        return JobSpec(
            id=new_job_id(MODEL), model=MODEL, prompt=prompt, prompt_token_ids=ids,
            sampling=sampling, tenant=name,
        )  # fmt: skip

    too_long = poison("too-long", None, [5] * (limits.max_model_len + 1))
    unknown_token = poison("unknown-token", None, [5, limits.vocab_size + 7])
    engine_fault = poison("engine-fault", "this one makes the engine [[fail]]", None)
    good = greedy_jobs(100, max_tokens=32)
    jobs = [*good[:50], too_long, unknown_token, engine_fault, *good[50:]]
    await broker.queue.enqueue_many(jobs)
    done = await results(broker, [j.id for j in jobs], timeout=120)

    assert all(done[j.id].status is JobStatus.SUCCEEDED for j in good)
    assert all(done[j.id].completion_tokens == 32 for j in good)
    assert done[too_long.id].status is JobStatus.FAILED
    assert "maximum context length" in (done[too_long.id].error or "")
    assert done[unknown_token.id].status is JobStatus.FAILED
    assert "token ids must be in" in (done[unknown_token.id].error or "")
    fault = await broker.queue.record(engine_fault.id)
    assert fault is not None and fault.status is JobStatus.DEAD and fault.deliveries == 2
    assert "injected" in (fault.last_error or "")
    [letter] = await broker.queue.dead_letters(MODEL)
    assert letter.job_id == engine_fault.id and "injected" in (letter.error or "")
    # the refused ones were never retried, and no worker died on the way
    for refused in (too_long, unknown_token):
        record = await broker.queue.record(refused.id)
        assert record is not None and record.deliveries == 1
    assert all(proc.poll() is None for proc in procs)
    assert {w.consumer for w in await broker.registry.workers(MODEL)} == consumers


@KINDS
async def test_sigkill_while_holding_a_concurrency_slot_does_not_leak_it(
    workers: Workers, broker: Backend
) -> None:
    quota = Quota(max_concurrent=1)
    [job] = greedy_jobs(1, max_tokens=300)  # ~3 s on the sim engine
    job.tenant, job.quota = "acme", True

    async def admitted(job_id: str) -> bool:
        [decision] = await broker.quotas.reserve("acme", quota, [(job_id, 10)])
        return decision.admitted

    assert await admitted(job.id)
    await broker.queue.enqueue(job)
    first = workers.start(engine="sim")
    await wait_for_tokens(broker, [job.id], at_least=1)
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    assert not await admitted(new_job_id(MODEL))  # the dead worker's job still holds it

    workers.start(engine="sim")  # reaps the lapsed lease, resumes and completes the job
    done = await results(broker, [job.id], timeout=120)
    assert done[job.id].status is JobStatus.SUCCEEDED
    assert await admitted(new_job_id(MODEL))


async def followed(
    broker: Backend, job_id: str, timeout: float
) -> list[tuple[float, TokenChunk | Finished]]:
    """A client's view of a job's stream: each event with when it arrived (monotonic)."""
    seen: list[tuple[float, TokenChunk | Finished]] = []
    cursor = "0"
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        for event_id, event in await broker.queue.read_events(job_id, after=cursor, block_s=0.2):
            cursor = event_id
            if isinstance(event, TokenChunk | Finished):
                seen.append((time.monotonic(), event))
            if isinstance(event, Finished):
                return seen
    raise AssertionError(f"{job_id} never finished")


@KINDS
async def test_sigkill_mid_stream_moves_the_job_to_a_live_worker_within_three_seconds(
    make_backend: BackendFactory, workers: Workers
) -> None:
    """With leases as long as slow engine steps need (the default 30 s), a killed worker's
    job moves by its lapsed liveness: the client's stream stalls at most 3 s, then goes on
    to the whole answer, nothing lost or repeated."""
    broker = make_backend()
    lease_s = broker.queue.settings.lease_s
    assert lease_s >= 30.0  # the lease is not what moves the job here
    procs = [workers.start(engine="sim", lease_s=lease_s) for _ in range(2)]
    give_up = time.monotonic() + 120
    while len(await broker.registry.workers(MODEL)) < 2:
        assert time.monotonic() < give_up, "the workers never registered"
        assert all(p.poll() is None for p in procs)
        await asyncio.sleep(0.1)
    # ~10 ms a token on the sim engine, whose tokens are a function of prompt and position:
    # a resumed run writes what an unbroken one does
    reference, spec = greedy_jobs(2, max_tokens=800)
    spec.prompt = reference.prompt
    await broker.queue.enqueue(reference)
    whole = (await results(broker, [reference.id], timeout=120))[reference.id]
    assert whole.status is JobStatus.SUCCEEDED and len(whole.token_ids) == 800

    await broker.queue.enqueue(spec)
    stream = asyncio.create_task(followed(broker, spec.id, timeout=120))
    await wait_for_tokens(broker, [spec.id], at_least=1)
    await asyncio.sleep(1.0)  # well into its stream
    record = await broker.queue.record(spec.id)
    assert record is not None and record.status is JobStatus.RUNNING and record.worker
    holder = int(record.worker.split(":")[-2])  # host:pid:start
    [victim] = [p for p in procs if p.pid == holder]
    killed_at = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    seen = await stream

    chunks = [(at, e) for at, e in seen if isinstance(e, TokenChunk)]
    arrivals = [at for at, _ in chunks]
    assert arrivals[0] <= killed_at < arrivals[-1], "the kill should land mid-stream"
    stall = max(b - a for a, b in itertools.pairwise(arrivals))
    assert stall <= 3.0, f"the stream stalled {stall:.2f} s after the kill"
    [(_, end)] = [(at, e) for at, e in seen if isinstance(e, Finished)]
    assert isinstance(end, Finished) and end.result.status is JobStatus.SUCCEEDED
    assert end.result.text == whole.text and end.result.token_ids == whole.token_ids
    ids = [t for _, e in chunks for t in e.token_ids]
    assert ids == whole.token_ids  # every token once, in order: none lost, none repeated
    done = await broker.queue.record(spec.id)
    assert done is not None and done.deliveries == 2 and done.worker != record.worker


@KINDS
async def test_engine_steps_longer_than_the_liveness_do_not_make_a_worker_dead(
    make_backend: BackendFactory, workers: Workers
) -> None:
    """Engine steps run off the worker's event loop, which keeps beating through a step
    longer than `liveness_s`: the live worker beside it takes nothing over."""
    broker = make_backend()
    step_s = broker.queue.settings.liveness_s * 1.5
    slow = {"TOKENYARD_WORKER_SIM_DECODE_BASE_S": str(step_s)}
    procs = [workers.start(engine="sim", lease_s=30.0, env=slow) for _ in range(2)]
    give_up = time.monotonic() + 120
    while len(await broker.registry.workers(MODEL)) < 2:
        assert time.monotonic() < give_up, "the workers never registered"
        assert all(p.poll() is None for p in procs)
        await asyncio.sleep(0.1)
    jobs = greedy_jobs(2, max_tokens=3)
    await broker.queue.enqueue_many(jobs)
    done = await results(broker, [j.id for j in jobs], timeout=120)
    for job in jobs:
        assert done[job.id].status is JobStatus.SUCCEEDED
        record = await broker.queue.record(job.id)
        assert record is not None and record.deliveries == 1
    assert (await broker.queue.stats(MODEL)).fenced_completions == 0


# A constrained (JSON-schema) generation whose worker is killed mid-way resumes to the same
# valid output: the grammar is replayed over the tokens already streamed, logprobs included.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "lane": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["box", "tank", "flat"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "lane", "kind", "tags"],
    "additionalProperties": False,
}


def constrained_jobs(n: int) -> list[JobSpec]:
    guide = Guide(json=json.dumps(SCHEMA))
    return [
        JobSpec(
            id=new_job_id(MODEL),
            model=MODEL,
            prompt=f"Describe car number {i} as JSON",
            sampling=SamplingParams(
                max_tokens=160, temperature=1.0, seed=1000 + i, guide=guide, logprobs=2
            ),
        )
        for i in range(n)
    ]


@KINDS
async def test_sigkill_mid_constrained_generation_resumes_to_the_same_valid_json(
    workers: Workers, broker: Backend
) -> None:
    reference_jobs = constrained_jobs(24)
    first = workers.start()
    await broker.queue.enqueue_many(reference_jobs)
    reference = await results(broker, [j.id for j in reference_jobs], timeout=300)

    jobs = constrained_jobs(24)
    await broker.queue.enqueue_many(jobs)
    ids = [j.id for j in jobs]
    await wait_for_tokens(broker, ids, at_least=6)
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    workers.start()
    done = await results(broker, ids, timeout=300)

    for ref_job, job in zip(reference_jobs, jobs, strict=True):
        result = done[job.id]
        assert result.status is JobStatus.SUCCEEDED, result.error
        jsonschema.validate(json.loads(result.text), SCHEMA)
        # seeded sampling under a replayed grammar continues exactly as the unbroken run
        assert result.token_ids == reference[ref_job.id].token_ids
        assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
        assert [lp.token_id for lp in result.logprobs] == result.token_ids
        text, finishes = await streamed_text(broker, job.id)
        assert text == result.text and finishes == 1
    resumed = [r for r in [await broker.queue.record(i) for i in ids] if r and r.deliveries > 1]
    assert resumed, "the kill should catch constrained jobs in flight"
