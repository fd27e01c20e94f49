"""The worker against both brokers, with the simulated engine (model speed is not the point)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest

from tests.conftest import BackendFactory
from tokenyard.broker import Backend, new_job_id
from tokenyard.config import WorkerSettings
from tokenyard.engines import EngineRequest
from tokenyard.engines.sim import SimEngine, SimTokenizer
from tokenyard.messages import (
    Finished,
    FinishReason,
    Guide,
    JobRecord,
    JobSpec,
    JobStatus,
    SamplingParams,
    TokenChunk,
)
from tokenyard.worker.worker import Worker

MODEL = "sim-model"


def spec(prompt: str = "hello", max_tokens: int = 8, **extra: object) -> JobSpec:
    return JobSpec(
        id=new_job_id(MODEL),
        model=MODEL,
        prompt=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra),  # type: ignore[arg-type]
    )


async def wait_all(
    broker: Backend, job_ids: list[str], timeout: float = 30.0
) -> dict[str, JobRecord]:
    async def one(job_id: str) -> JobRecord:
        after = "0"
        while True:
            for event_id, event in await broker.queue.read_events(job_id, after=after, block_s=1.0):
                after = event_id
                if isinstance(event, Finished):
                    record = await broker.queue.record(job_id)
                    assert record is not None
                    return record

    records = await asyncio.wait_for(asyncio.gather(*(one(j) for j in job_ids)), timeout)
    return dict(zip(job_ids, records, strict=True))


RunWorker = Callable[..., Worker]


@pytest.fixture
async def run_worker(make_backend: BackendFactory) -> AsyncIterator[RunWorker]:
    """Start workers in the background; drain and join them at teardown."""
    started: list[tuple[Worker, asyncio.Task[None]]] = []

    def start(
        engine: SimEngine | None = None, broker: Backend | None = None, **settings: object
    ) -> Worker:
        engine = engine or SimEngine(decode_base=0.002, decode_per_seq=1e-4, prefill_base=0.001)
        options: dict[str, object] = {"model": MODEL, "engine": "sim", "heartbeat_s": 0.2}
        options.update(settings)
        worker = Worker(broker or make_backend(lease_s=2.0), engine, WorkerSettings(**options))  # type: ignore[arg-type]
        started.append((worker, asyncio.create_task(worker.run())))
        return worker

    yield start
    for worker, _ in started:
        worker.drain()
    for _, task in started:
        done, _ = await asyncio.wait([task], timeout=10)
        if not done:
            for pending in asyncio.all_tasks():
                pending.print_stack(limit=4)
            pytest.fail("worker did not drain within 10 s")
        task.result()


async def test_many_concurrent_jobs_complete_in_shared_steps(
    make_backend: BackendFactory, run_worker: RunWorker
) -> None:
    broker = make_backend()
    engine = SimEngine(decode_base=0.003, decode_per_seq=1e-4)
    worker = run_worker(engine=engine, max_seqs=32)
    lengths = [4 + (i % 13) for i in range(64)]
    specs = [spec(f"prompt {i}", n) for i, n in enumerate(lengths)]
    await broker.queue.enqueue_many(specs)
    records = await wait_all(broker, [s.id for s in specs])
    for s, n in zip(specs, lengths, strict=True):
        record = records[s.id]
        assert record.status is JobStatus.SUCCEEDED, record
        assert record.result is not None
        assert record.result.completion_tokens == n == len(record.result.token_ids)
        assert record.result.finish_reason is FinishReason.LENGTH
        tokens = [e for _, e in await broker.queue.read_events(s.id) if isinstance(e, TokenChunk)]
        assert "".join(t.text for t in tokens) == record.result.text
    assert engine.stats().mean_batch > 4
    assert worker.busy == 0
    [info] = await broker.registry.workers(MODEL)
    assert info.consumer == worker.consumer and info.slots_total == 32


async def test_each_step_is_one_event_and_one_round_trip_carries_every_job(
    make_backend: BackendFactory, run_worker: RunWorker
) -> None:
    """One broker round trip per engine step (or fewer) carries every job's new tokens, each
    step's as an event of its own."""
    broker = make_backend()
    worker_broker = make_backend()
    calls: list[int] = []
    append = worker_broker.queue.append_events

    async def counting_append(events):  # type: ignore[no-untyped-def]
        calls.append(len(events))
        return await append(events)

    worker_broker.queue.append_events = counting_append  # type: ignore[method-assign]
    engine = SimEngine(decode_base=0.002)
    run_worker(engine=engine, broker=worker_broker)
    specs = [spec(f"p{i}", 20) for i in range(8)]
    await broker.queue.enqueue_many(specs)
    await wait_all(broker, [s.id for s in specs])
    for s in specs:  # every token published exactly once, the last one with the result
        tokens = [e for _, e in await broker.queue.read_events(s.id) if isinstance(e, TokenChunk)]
        assert [len(t.token_ids) for t in tokens] == [1] * 20  # a token a step, an event each
    assert len(calls) <= engine.stats().steps
    assert sum(calls) / len(calls) > 2  # most round trips carry several jobs


async def test_cancel_mid_generation_frees_the_slot(
    make_backend: BackendFactory, run_worker: RunWorker
) -> None:
    broker = make_backend()
    run_worker(engine=SimEngine(decode_base=0.01), max_seqs=1, claim_ahead=0)  # no reserve
    long, queued = spec("long", 2000), spec("short", 5)
    await broker.queue.enqueue(long)
    first_tokens = await broker.queue.read_events(long.id, block_s=10.0)
    assert first_tokens and isinstance(first_tokens[0][1], TokenChunk)
    await broker.queue.enqueue(queued)
    await asyncio.sleep(0.1)
    assert (await broker.queue.record(queued.id)).status is JobStatus.QUEUED  # type: ignore[union-attr]
    await broker.queue.cancel(long.id)
    records = await wait_all(broker, [long.id, queued.id], timeout=10)
    assert records[long.id].status is JobStatus.CANCELLED
    assert records[long.id].result is not None
    assert records[long.id].result.completion_tokens < 2000
    assert records[queued.id].status is JobStatus.SUCCEEDED


async def test_failing_engine_retries_then_dead_letters(
    make_backend: BackendFactory, run_worker: RunWorker
) -> None:
    broker = make_backend(max_deliveries=2, backoff_base_s=0.01, backoff_max_s=0.02)
    run_worker(broker=broker)
    bad, good = spec("please [[fail]] now"), spec("fine")
    await broker.queue.enqueue_many([bad, good])
    records = await wait_all(broker, [bad.id, good.id])
    assert records[good.id].status is JobStatus.SUCCEEDED
    assert records[bad.id].status is JobStatus.DEAD and records[bad.id].deliveries == 2
    [letter] = await broker.queue.dead_letters(MODEL)
    assert letter.job_id == bad.id and letter.reason == "failed"


async def test_prompt_too_long_fails_without_retry(
    make_backend: BackendFactory, run_worker: RunWorker
) -> None:
    broker = make_backend()
    run_worker(engine=SimEngine(max_model_len=64))
    job = spec("x" * 60, max_tokens=10)
    await broker.queue.enqueue(job)
    record = (await wait_all(broker, [job.id]))[job.id]
    assert record.status is JobStatus.FAILED and record.deliveries == 1
    assert record.result is not None
    assert "maximum context length is 64" in (record.result.error or "")


async def test_resumed_job_continues_after_streamed_tokens(
    make_backend: BackendFactory, run_worker: RunWorker
) -> None:
    """A redelivered job picks up the tokens its dead predecessor streamed; none repeat."""
    broker = make_backend(lease_s=0.3)
    direct = SimEngine(decode_base=0.0)
    await direct.start()
    prompt_ids = direct.tokenizer.encode("resume me")
    direct.add(EngineRequest("ref", prompt_ids, SamplingParams(max_tokens=30, temperature=0.0)))
    expected_ids: list[int] = []
    while len(expected_ids) < 30:
        expected_ids += [t for out in await direct.outputs() for t in out.token_ids]
    await direct.stop()
    expected_text = direct.tokenizer.decode(expected_ids)

    job = spec("resume me", 30)
    await broker.queue.enqueue(job)
    [lease] = await broker.queue.claim(MODEL, "crashed-worker", slots=1)
    half = expected_ids[:11]
    await broker.queue.append_events(
        [(lease, TokenChunk(token_ids=half, text=direct.tokenizer.decode(half)))]
    )
    # the crashed worker never renews; the live worker's reaper requeues the job
    run_worker(broker=broker)
    record = (await wait_all(broker, [job.id], timeout=20))[job.id]
    assert record.deliveries == 2 and record.result is not None
    assert record.result.token_ids == expected_ids
    assert record.result.text == expected_text
    texts = [e.text for _, e in await broker.queue.read_events(job.id) if isinstance(e, TokenChunk)]
    assert "".join(texts) == expected_text


async def test_drain_finishes_in_flight_work_and_stops_claiming(
    make_backend: BackendFactory, run_worker: RunWorker
) -> None:
    broker = make_backend()
    first = run_worker(engine=SimEngine(decode_base=0.005), max_seqs=4)
    specs = [spec(f"d{i}", 30) for i in range(12)]
    await broker.queue.enqueue_many(specs)
    while first.busy < 4:
        await asyncio.sleep(0.01)
    first.drain()
    await asyncio.sleep(0.5)
    assert first.busy == 0  # in-flight finished; nothing new claimed while draining
    done = [s.id for s in specs if (await broker.queue.record(s.id)).status.terminal]  # type: ignore[union-attr]
    assert len(done) == 4
    run_worker(max_seqs=8)
    records = await wait_all(broker, [s.id for s in specs])
    assert all(r.status is JobStatus.SUCCEEDED for r in records.values())
    assert all(r.deliveries == 1 for r in records.values())


async def test_drain_timeout_hands_unfinished_jobs_back(
    make_backend: BackendFactory, run_worker: RunWorker
) -> None:
    broker = make_backend()
    first = run_worker(engine=SimEngine(decode_base=0.01), max_seqs=2, drain_timeout_s=0.2)
    specs = [spec(f"slow{i}", 400) for i in range(2)]
    await broker.queue.enqueue_many(specs)
    while first.busy < 2:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    first.drain()
    while (await broker.queue.record(specs[0].id)).status is JobStatus.RUNNING:  # type: ignore[union-attr]
        await asyncio.sleep(0.05)
    run_worker(max_seqs=2)
    records = await wait_all(broker, [s.id for s in specs])
    for s in specs:
        result = records[s.id].result
        assert result is not None and result.completion_tokens == 400
        texts = [
            e.text for _, e in await broker.queue.read_events(s.id) if isinstance(e, TokenChunk)
        ]
        assert "".join(texts) == result.text
        assert records[s.id].deliveries == 1  # a release is not charged as a delivery


async def test_the_engine_fills_to_capacity_within_a_few_steps(
    make_backend: BackendFactory, run_worker: RunWorker
) -> None:
    """With more jobs waiting than slots, the running batch reaches max_seqs almost at once."""
    broker = make_backend()
    await broker.queue.enqueue_many([spec(f"fill{i}", 40) for i in range(40)])
    engine = SimEngine(decode_base=0.005)
    worker = run_worker(engine=engine, max_seqs=16)
    steps_to_full = None
    while steps_to_full is None:
        stats = engine.stats()
        if stats.running == 16:
            steps_to_full = stats.steps
        await asyncio.sleep(0.001)
    assert steps_to_full <= 3
    assert worker.scheduler.waiting >= 1  # the claim-ahead reserve is held beside the batch


async def test_a_long_job_never_reaches_a_short_worker(
    make_backend: BackendFactory, run_worker: RunWorker
) -> None:
    def engine(context: int) -> SimEngine:
        return SimEngine(
            max_model_len=context, decode_base=0.002, decode_per_seq=1e-4, prefill_base=0.001
        )

    pools = {"size_pools": "64", "lease_s": 2.0}
    broker = make_backend(**pools)
    short = run_worker(engine=engine(64), broker=make_backend(**pools), max_seqs=4)
    long = run_worker(engine=engine(4096), broker=make_backend(**pools), max_seqs=4)
    assert (short.pools, long.pools) == ([0], [1, 0])
    shorts = [spec("hi", max_tokens=8) for _ in range(24)]  # ~10 tokens: pool 0
    longs = [spec("long", max_tokens=100) for _ in range(8)]  # ~102 tokens: pool 1
    await broker.queue.enqueue_many([*longs, *shorts])
    records = await wait_all(broker, [s.id for s in [*longs, *shorts]])
    assert {r.status for r in records.values()} == {JobStatus.SUCCEEDED}
    assert {records[s.id].worker for s in longs} == {long.consumer}
    # the long worker, idle once its own pool drained, helped with the short work
    assert {records[s.id].worker for s in shorts} <= {short.consumer, long.consumer}


class _CompilingSim(SimEngine):
    """A sim whose guides "compile" in `ready_for` (off the loop) and must be ready by `add`."""

    runs_adapters = True  # in name: a LoRA job's adapter "loads" in `ready_for` too

    def __init__(self, **options: object) -> None:
        super().__init__(decode_base=0.002, **options)  # type: ignore[arg-type]
        self.readied: list[SamplingParams] = []
        self.readied_adapters: list[str] = []
        self.unready_adds: list[str] = []

    async def ready_for(
        self, params: SamplingParams, adapter: str | None = None, adapter_path: str = ""
    ) -> None:
        if adapter:
            self.readied_adapters.append(adapter)
        else:
            self.readied.append(params)
        await asyncio.sleep(0.5)  # a slow compilation, which the loop does not wait out

    def add(self, request: EngineRequest) -> None:
        if request.params.guide is not None and request.params not in self.readied:
            self.unready_adds.append(request.seq_id)
        if request.adapter and request.adapter not in self.readied_adapters:
            self.unready_adds.append(request.seq_id)
        super().add(request)


async def test_a_guide_is_made_ready_off_the_loop_before_its_job_starts(
    make_backend: BackendFactory, run_worker: RunWorker
) -> None:
    broker = make_backend()
    engine = _CompilingSim()
    run_worker(engine=engine, max_seqs=8)
    guided = spec("pick one", 4, guide=Guide(choice=("yes", "no")))
    await broker.queue.enqueue(guided)
    plain = [spec(f"plain {i}", 4) for i in range(3)]
    await broker.queue.enqueue_many(plain)
    records = await wait_all(broker, [guided.id, *(s.id for s in plain)])
    assert {r.status for r in records.values()} == {JobStatus.SUCCEEDED}
    assert engine.unready_adds == []
    assert engine.readied == [guided.sampling]  # plain jobs pay no await


async def test_an_adapter_is_made_ready_off_the_loop_before_its_job_starts(
    make_backend: BackendFactory, run_worker: RunWorker
) -> None:
    """A LoRA job comes with its prompt's ids (as the gateway sends it) and needs nothing else
    read or compiled: its adapter still loads in `ready_for`, off the loop, before `add`."""
    broker = make_backend()
    engine = _CompilingSim()
    run_worker(engine=engine, max_seqs=8)
    lora = msgspec.structs.replace(spec("x", 4), prompt=None, prompt_token_ids=[70, 71, 72])
    lora = msgspec.structs.replace(lora, adapter="a3", adapter_path="/adapters/a3")
    await broker.queue.enqueue(lora)
    plain = spec("plain", 4)
    await broker.queue.enqueue(plain)
    records = await wait_all(broker, [lora.id, plain.id])
    assert {r.status for r in records.values()} == {JobStatus.SUCCEEDED}
    assert engine.unready_adds == []
    assert engine.readied_adapters == ["a3"]


class _PickyTokenizer(SimTokenizer):
    """Fails on any text holding "\\x00" (as a tokenizer fails on what it cannot read)."""

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        if "\x00" in text:
            raise ValueError("unreadable text")
        return super().encode(text, add_special_tokens)


@pytest.mark.parametrize("length", [10, 5000], ids=["short", "long"])
async def test_a_text_prompt_the_tokenizer_refuses_fails_its_job_alone(
    make_backend: BackendFactory, run_worker: RunWorker, length: int
) -> None:
    """A producer's text prompt is tokenized by the worker: on its loop when short, in a
    thread when long (over 4,096 characters). One the tokenizer refuses fails its job, naming
    why; the jobs claimed with it run."""
    broker = make_backend()
    engine = SimEngine(decode_base=0.002, max_model_len=8192)
    engine.tokenizer = _PickyTokenizer(8192)
    bad = spec("\x00" * length, 4)
    good = [spec("a" * length, 4), spec("fine", 4)]
    await broker.queue.enqueue_many([good[0], bad, good[1]])
    run_worker(engine=engine, max_seqs=8)
    records = await wait_all(broker, [bad.id, *(s.id for s in good)])
    assert records[bad.id].status is JobStatus.FAILED
    result = records[bad.id].result
    assert result is not None
    assert "cannot tokenize the prompt: unreadable text" in (result.error or "")
    assert {records[s.id].status for s in good} == {JobStatus.SUCCEEDED}
