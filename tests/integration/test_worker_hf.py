"""The worker on the real tiny transformers model, through a real Valkey."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import msgspec
import pytest

from tests.integration.test_worker import wait_all
from tokenyard.broker import Backend, connect, new_job_id
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.engines import EngineRequest
from tokenyard.engines.hf import HFEngine
from tokenyard.messages import (
    FinishReason,
    JobSpec,
    JobStatus,
    Priority,
    SamplingParams,
    TokenChunk,
)
from tokenyard.worker.worker import Worker

MODEL = "tiny"


def job(prompt: str, max_tokens: int, ignore_eos: bool = True) -> JobSpec:
    return JobSpec(
        id=new_job_id(MODEL),
        model=MODEL,
        prompt=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos),
    )


@pytest.fixture
async def broker(valkey: EmbeddedServer) -> AsyncIterator[Backend]:
    client = connect(BrokerSettings(url=valkey.url, prefix=f"h{uuid.uuid4().hex[:8]}"))
    yield client
    await client.close()


async def start_worker(
    broker: Backend, max_seqs: int
) -> tuple[Worker, HFEngine, asyncio.Task[None]]:
    engine = HFEngine("tiny", max_seqs=max_seqs, threads=1)
    settings = WorkerSettings(model=MODEL, max_seqs=max_seqs, heartbeat_s=0.2, claim_ahead=0)
    worker = Worker(broker, engine, settings)
    return worker, engine, asyncio.create_task(worker.run())


async def stop_worker(worker: Worker, task: asyncio.Task[None]) -> None:
    worker.drain()
    await asyncio.wait_for(task, 60)


async def direct_greedy(prompt: str, max_tokens: int) -> tuple[list[int], str]:
    """The same request straight through a fresh engine, no queue."""
    engine = HFEngine("tiny", max_seqs=1, threads=1)
    await engine.start()
    try:
        ids = engine.tokenizer.encode(prompt)
        engine.add(
            EngineRequest("direct", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        )
        tokens: list[int] = []
        text = ""
        while True:
            for out in await engine.outputs():
                tokens += out.token_ids
                text += out.text
                if out.finish_reason is not None:
                    return tokens, text
    finally:
        await engine.stop()


async def test_64_concurrent_jobs_share_engine_steps(broker: Backend) -> None:
    worker, engine, task = await start_worker(broker, max_seqs=32)
    try:
        lengths = [8 + (i % 17) for i in range(64)]
        specs = [job(f"Lane {i} takes car {i * 7}", n) for i, n in enumerate(lengths)]
        await broker.queue.enqueue_many(specs)
        records = await wait_all(broker, [s.id for s in specs], timeout=180)
        for s, n in zip(specs, lengths, strict=True):
            result = records[s.id].result
            assert records[s.id].status is JobStatus.SUCCEEDED
            assert result is not None and result.completion_tokens == n
            assert result.finish_reason is FinishReason.LENGTH
        assert engine.stats().mean_batch > 1.5
        await asyncio.sleep(0.5)  # one more heartbeat carries the engine's stats
        [info] = await broker.registry.workers(MODEL)
        assert info.mean_batch > 1.5 and info.jobs_done == 64
    finally:
        await stop_worker(worker, task)


async def test_greedy_through_the_queue_equals_a_direct_engine_call(broker: Backend) -> None:
    prompts = ["The yard master said", "Cars roll onto lane three", "ünïcode wägon"]
    expected = [await direct_greedy(p, 20) for p in prompts]
    worker, _, task = await start_worker(broker, max_seqs=8)
    try:
        specs = [job(p, 20, ignore_eos=False) for p in prompts]
        await broker.queue.enqueue_many(specs)
        records = await wait_all(broker, [s.id for s in specs], timeout=120)
        for s, (tokens, text) in zip(specs, expected, strict=True):
            result = records[s.id].result
            assert result is not None
            assert result.token_ids == tokens and result.text == text
    finally:
        await stop_worker(worker, task)


async def test_cancel_mid_generation_lets_a_queued_job_start(broker: Backend) -> None:
    worker, _, task = await start_worker(broker, max_seqs=1)
    try:
        long, short = job("a very long answer", 1500), job("short", 4)
        await broker.queue.enqueue(long)
        assert await broker.queue.read_events(long.id, block_s=60)
        await broker.queue.enqueue(short)
        await asyncio.sleep(0.3)
        waiting = await broker.queue.record(short.id)
        assert waiting is not None and waiting.status is JobStatus.QUEUED
        await broker.queue.cancel(long.id)
        records = await wait_all(broker, [long.id, short.id], timeout=60)
        assert records[long.id].status is JobStatus.CANCELLED
        assert records[short.id].status is JobStatus.SUCCEEDED
        streamed = [
            e for _, e in await broker.queue.read_events(long.id) if isinstance(e, TokenChunk)
        ]
        cancelled = records[long.id].result
        assert cancelled is not None
        assert 0 < sum(len(c.token_ids) for c in streamed) == cancelled.completion_tokens < 1500
    finally:
        await stop_worker(worker, task)


async def test_a_preempted_job_resumes_to_the_same_greedy_output(broker: Backend) -> None:
    """The real model preempted mid-generation: the batch job yields its one slot to a
    high-priority job, resumes from prompt + its streamed tokens, and ends with exactly the
    tokens an uninterrupted run makes, each streamed once."""
    prompt = "The yard master said"
    expected, _ = await direct_greedy(prompt, 120)
    engine = HFEngine("tiny", max_seqs=1, threads=1)
    settings = WorkerSettings(
        model=MODEL, max_seqs=1, heartbeat_s=0.2, claim_ahead=0, batch_share=1.0
    )
    worker = Worker(broker, engine, settings)
    task = asyncio.create_task(worker.run())
    try:
        batch = msgspec.structs.replace(job(prompt, 120, ignore_eos=False), priority=Priority.BATCH)
        await broker.queue.enqueue(batch)
        assert await broker.queue.read_events(batch.id, block_s=60)  # it runs, tokens out
        urgent = msgspec.structs.replace(job("urgent", 4), priority=Priority.HIGH)
        await broker.queue.enqueue(urgent)
        records = await wait_all(broker, [urgent.id, batch.id], timeout=120)
        assert records[urgent.id].status is JobStatus.SUCCEEDED
        done = records[batch.id]
        assert done.preemptions == 1 and done.result is not None
        assert done.result.token_ids == expected
        streamed = [
            t
            for _, e in await broker.queue.read_events(batch.id)
            if isinstance(e, TokenChunk)
            for t in e.token_ids
        ]
        assert streamed == expected
        assert worker.metrics.preemptions._value.get() == 1
    finally:
        await stop_worker(worker, task)
