"""Prefix affinity end to end on a real Valkey and on RabbitMQ lanes (Valkey tables beside): a
real gateway computes each chat request's prefix key, sim workers with prefix caches serve it; a
job preferred for a busy or killed worker still runs elsewhere after the bound."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import httpx
import pytest

from tests.conftest import kinds, session_urls
from tokenyard.broker import Backend, connect, new_job_id
from tokenyard.broker.core import Trait
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.engines.sim import SimEngine, SimTokenizer
from tokenyard.fleet.launch import Launcher, Processes, free_port, serving
from tokenyard.gateway import create_app
from tokenyard.gateway.affinity import prefix_key
from tokenyard.gateway.settings import gateway_settings
from tokenyard.messages import Finished, JobResult, JobSpec, SamplingParams
from tokenyard.worker.worker import Worker

MODEL = "sim-model"
SYSTEMS = [f"System prompt {i}: you route freight cars; be brief and exact. " * 5 for i in range(3)]
WAIT_S = 0.2
REQUESTS = 45  # chat requests per hit-rate run: enough that chance does not decide the margin


@pytest.fixture(params=kinds(Trait.PREFIX_AFFINITY, among=("valkey", "rabbitmq")))
def urls(request: pytest.FixtureRequest) -> tuple[str, str]:
    """(broker URL, tables URL) of a backend that holds prefixed jobs for their owner."""
    return session_urls(request, request.param)


def settings_for(urls: tuple[str, str], **overrides: object) -> BrokerSettings:
    url, tables = urls
    return BrokerSettings(
        url=url,
        tables_url=tables,
        prefix=f"pa{uuid.uuid4().hex[:8]}",
        **overrides,  # type: ignore[arg-type]
    )


@asynccontextmanager
async def worker(
    settings: BrokerSettings, engine: SimEngine, slots: int, claim_ahead: int | None = None
) -> AsyncIterator[None]:
    # a name of its own: in-process workers started in one millisecond would share one
    consumer = f"w-{uuid.uuid4().hex[:8]}"
    broker = connect(settings)
    options = WorkerSettings(
        model=MODEL,
        engine="sim",
        heartbeat_s=0.2,
        claim_block_s=0.2,
        max_seqs=slots,
        claim_ahead=claim_ahead,
    )
    task = asyncio.create_task(Worker(broker, engine, options, consumer=consumer).run())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await broker.close()


@asynccontextmanager
async def gateway(settings: BrokerSettings, prefix_tokens: int) -> AsyncIterator[str]:
    port = free_port()
    app = create_app(
        gateway_settings(
            models=MODEL,
            port=port,
            tokenizer="sim",
            cache=False,
            collapse=False,
            affinity_prefix_tokens=prefix_tokens,
        ),
        broker_settings=settings,
        tokenizers={MODEL: SimTokenizer()},
    )
    async with serving(app, port) as url:
        yield url


async def hit_rate(url: tuple[str, str], prefix_tokens: int) -> float:
    """Chat requests over three system prompts, through a real gateway, to three workers whose
    prefix caches hold one prompt each; the fraction of prompt tokens their caches served."""
    settings = settings_for(url, affinity_wait_s=1.0)
    engines = [
        SimEngine(decode_base=0.005, prefill_per_token=1e-5, prefix_cache_tokens=800)
        for _ in range(3)
    ]
    async with AsyncExitStack() as stack:
        for engine in engines:
            await stack.enter_async_context(worker(settings, engine, slots=4))
        base = await stack.enter_async_context(gateway(settings, prefix_tokens))
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=base, timeout=60))
        probe = connect(settings)
        while len(await probe.registry.workers(MODEL)) < 3:
            await asyncio.sleep(0.05)
        await probe.close()

        async def ask(i: int) -> None:
            await asyncio.sleep(0.03 * i)  # a steady stream, not one burst
            body = {
                "model": MODEL,
                "messages": [
                    # each third of the requests still cycles through all three prompts: a
                    # server that hands requests round-robin to the three workers (RabbitMQ's
                    # pushes) must not sort them by prompt itself
                    {"role": "system", "content": SYSTEMS[(i + i // 3) % 3]},
                    {"role": "user", "content": f"where is car {i}?"},
                ],
                "max_tokens": 4,
                "temperature": 0,
            }
            reply = await http.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text

        await asyncio.gather(*(ask(i) for i in range(REQUESTS)))
    queries = sum(e.stats().prefix_cache_queries for e in engines)
    return sum(e.stats().prefix_cache_hits for e in engines) / queries


async def test_affinity_steers_shared_prefixes_to_warm_workers(urls: tuple[str, str]) -> None:
    without = await hit_rate(urls, prefix_tokens=0)  # no prefix keys: no affinity
    with_affinity = await hit_rate(urls, prefix_tokens=1024)
    # ideal: every request after its prompt's first hits (0.93; measured 0.84-0.86, and 0.58
    # on RabbitMQ with the box loaded: an owner slower than the bound loses its held jobs);
    # without keys the rate is whatever the claims' order happened to give (0.39-0.77)
    assert with_affinity > 0.5, (with_affinity, without)
    assert with_affinity > without + 0.1, (with_affinity, without)


def prefixed_job(system: str, user: str, max_tokens: int = 4) -> JobSpec:
    ids = SimTokenizer().encode(system + user)
    return JobSpec(
        id=new_job_id(MODEL),
        model=MODEL,
        prompt_token_ids=ids,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        prefix_key=prefix_key(ids, len(SimTokenizer().encode(system))),
    )


async def finished(broker: Backend, job_id: str, timeout: float = 20.0) -> JobResult:
    give_up, after = time.monotonic() + timeout, "0"
    while time.monotonic() < give_up:
        for event_id, event in await broker.queue.read_events(job_id, after, block_s=1.0):
            after = event_id
            if isinstance(event, Finished):
                return event.result
    raise TimeoutError(job_id)


async def test_a_job_preferred_for_a_busy_worker_runs_elsewhere_after_the_bound(
    urls: tuple[str, str],
) -> None:
    settings = settings_for(urls, affinity_wait_s=WAIT_S)
    broker = connect(settings)
    busy = SimEngine(max_seqs=1, decode_base=0.02, prefix_cache_tokens=4096)
    async with worker(settings, busy, slots=1, claim_ahead=0):
        while not await broker.registry.workers(MODEL):
            await asyncio.sleep(0.05)
        # the only worker runs a long job: it owns the prefix and has no free slot
        long = prefixed_job(SYSTEMS[0], "a long answer", max_tokens=100)  # ~2 s
        await broker.queue.enqueue(long)
        assert await broker.queue.read_events(long.id, "0", block_s=5.0)  # it is running
        async with worker(settings, SimEngine(decode_base=0.005), slots=4):
            while len(await broker.registry.workers(MODEL)) < 2:
                await asyncio.sleep(0.05)
            started = time.monotonic()
            short = prefixed_job(SYSTEMS[0], "a short one")
            await broker.queue.enqueue(short)
            result = await finished(broker, short.id)
            took = time.monotonic() - started
            first = await broker.queue.record(long.id)
            assert first is not None and first.worker is not None
            assert result.worker != first.worker  # the idle worker took it
            assert WAIT_S * 0.7 < took < 1.5  # held for the busy worker, for the bound only
            assert not first.status.terminal  # long before the busy worker would have been free
            await finished(broker, long.id)
    await broker.close()


def start_worker_process(settings: BrokerSettings) -> subprocess.Popen[bytes]:
    launcher = Launcher(Processes(), settings.url, settings.prefix, settings.tables_url)
    env = {**os.environ, "TOKENYARD_WORKER_SIM_PREFIX_CACHE_TOKENS": "4096"}
    return launcher.worker(
        "--model", MODEL, "--engine", "sim", "--max-seqs", "4",
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


async def test_a_job_preferred_for_a_killed_worker_still_runs(urls: tuple[str, str]) -> None:
    settings = settings_for(urls, affinity_wait_s=WAIT_S)
    broker = connect(settings)
    proc = start_worker_process(settings)
    try:
        give_up = time.monotonic() + 30
        while not await broker.registry.workers(MODEL):
            assert proc.poll() is None and time.monotonic() < give_up, proc.stderr
            await asyncio.sleep(0.05)
        first = prefixed_job(SYSTEMS[1], "warm it up")
        await broker.queue.enqueue(first)
        dead_worker = (await finished(broker, first.id)).worker
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        held = prefixed_job(SYSTEMS[1], "and now?")
        await broker.queue.enqueue(held)  # held for the dead worker, its prefix's owner
        async with worker(settings, SimEngine(decode_base=0.005), slots=4):
            result = await finished(broker, held.id)
        assert result.worker is not None and result.worker != dead_worker
        assert result.status.value == "succeeded"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        await broker.close()
