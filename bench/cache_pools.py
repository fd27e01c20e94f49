"""Response cache, in-flight collapsing and size pools, on the sim engine (model speed is not
the point). Prints one JSON document.

  collapse  two gateways (uvicorn, real HTTP) on one private Valkey, one sim worker: N
            identical concurrent greedy requests spread over both gateways; counts engine jobs.
  latency   sequential requests: repeats of that request (cache hits) vs distinct prompts of
            the same shape (misses that run): p50/p99 of each.
  pools     a mixed workload (mostly short jobs, some long) straight on the broker, served by a
            short-context worker and a long-context worker: with size pools (the short worker
            never claims a long job) vs one pool (it claims them and must refuse them).

    python -m bench.cache_pools [--requests 100] [--samples 50] [--pool-jobs 200] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from bench.common import loadavg, percentile
from tokenyard.broker import connect, new_job_id
from tokenyard.broker.redis import connection_of
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.engines.sim import SimEngine, SimTokenizer
from tokenyard.fleet.launch import free_port, serving
from tokenyard.gateway import create_app
from tokenyard.gateway.settings import gateway_settings
from tokenyard.messages import Finished, JobSpec, JobStatus, SamplingParams
from tokenyard.worker.worker import Worker

MODEL = "sim-model"


def _ms(values: list[float]) -> dict[str, float | None]:
    def pct(q: float) -> float | None:
        found = percentile(values, q)
        return None if found is None else round(1000 * found, 3)

    return {"p50_ms": pct(50), "p99_ms": pct(99)}


@asynccontextmanager
async def _worker(
    settings: BrokerSettings, engine: SimEngine, **options: Any
) -> AsyncIterator[Worker]:
    broker = connect(settings)
    worker = Worker(
        broker,
        engine,
        WorkerSettings(model=MODEL, engine="sim", heartbeat_s=0.2, claim_block_s=0.2, **options),
    )
    task = asyncio.create_task(worker.run())
    try:
        yield worker
    finally:
        worker.drain()
        await asyncio.wait_for(task, 60)
        await broker.close()


@asynccontextmanager
async def _gateway(settings: BrokerSettings) -> AsyncIterator[str]:
    """A gateway with the cache and collapsing on, serving over real HTTP."""
    port = free_port()
    app = create_app(
        gateway_settings(models=MODEL, port=port, tokenizer="sim", cache=True, collapse=True),
        broker_settings=settings,
        tokenizers={MODEL: SimTokenizer()},
    )
    async with serving(app, port) as url:
        yield url


async def cache_and_collapse(url: str, opts: argparse.Namespace) -> dict[str, Any]:
    settings = BrokerSettings(url=url, prefix=f"bc{uuid.uuid4().hex[:8]}")
    engine = SimEngine(prefill_base=0.001, prefill_per_token=0.0, decode_base=0.02)
    async with (
        _worker(settings, engine),
        _gateway(settings) as a,
        _gateway(settings) as b,
        httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as http,
    ):
        probe = connect(settings)
        while not await probe.registry.workers(MODEL):
            await asyncio.sleep(0.05)
        body = {"model": MODEL, "prompt": "the same question", "max_tokens": 32, "temperature": 0}

        async def call(
            i: int, payload: dict[str, Any], client: httpx.AsyncClient = http
        ) -> tuple[float, str, str]:
            started = time.perf_counter()
            reply = await client.post(f"{(a, b)[i % 2]}/v1/completions", json=payload)
            reply.raise_for_status()
            return time.perf_counter() - started, reply.headers["x-cache"], reply.text

        burst = await asyncio.gather(*(call(i, body) for i in range(opts.requests)))
        pattern = probe.queue.keys.job_prefix(MODEL) + "*"
        jobs = len([k async for k in connection_of(probe).client.scan_iter(match=pattern)])
        answers = {json.loads(text)["choices"][0]["text"] for _, _, text in burst}
        # sequential calls on a client of their own: httpx's pool, left holding the burst's
        # 100 connections, added ~15 ms to every request
        async with httpx.AsyncClient(timeout=120) as one:
            hits = [await call(i, body, one) for i in range(opts.samples)]
            misses = [
                await call(i, {**body, "prompt": f"question {i}"}, one)
                for i in range(opts.samples // 5)
            ]
        await probe.close()
    verdicts = [v for _, v, _ in burst]
    return {
        "collapse": {
            "requests": opts.requests,
            "gateways": 2,
            "engine_jobs": jobs,
            "distinct_answers": len(answers),
            "verdicts": {v: verdicts.count(v) for v in sorted(set(verdicts))},
            "latency": _ms([t for t, _, _ in burst]),
        },
        "latency": {
            "hit": {"n": len(hits), **_ms([t for t, _, _ in hits])},
            "miss": {"n": len(misses), **_ms([t for t, _, _ in misses])},
            "hit_verdicts": sorted({v for _, v, _ in hits}),
            "job_decode_step_s": engine.decode_base,
            "max_tokens": 32,
        },
    }


async def pools(url: str, opts: argparse.Namespace, size_pools: str) -> dict[str, Any]:
    settings = BrokerSettings(url=url, prefix=f"bp{uuid.uuid4().hex[:8]}", size_pools=size_pools)

    def engine(context: int) -> SimEngine:
        return SimEngine(max_model_len=context, decode_base=0.005, decode_per_seq=2e-4)

    broker = connect(settings)
    specs = []
    for i in range(opts.pool_jobs):
        long = i % 5 == 0  # one job in five needs the long worker's context
        specs.append(
            JobSpec(
                id=new_job_id(MODEL),
                model=MODEL,
                prompt_token_ids=[3 + (i + j) % 200 for j in range(600 if long else 40)],
                sampling=SamplingParams(max_tokens=64 if long else 16, temperature=0.0),
            )
        )
    async with (
        _worker(settings, engine(512), max_seqs=16),
        _worker(settings, engine(4096), max_seqs=16),
    ):
        while len(await broker.registry.workers(MODEL)) < 2:
            await asyncio.sleep(0.05)
        started, wall = time.perf_counter(), time.time()
        await broker.queue.enqueue_many(specs)
        first_token: dict[str, float] = {}  # from the first event's id: the server's clock
        records = {}
        finished_at = 0.0
        for spec in specs:
            after = "0"
            while spec.id not in records:
                for event_id, event in await broker.queue.read_events(spec.id, after, block_s=5.0):
                    after = event_id
                    at = int(event_id.split("-")[0]) / 1000
                    first_token.setdefault(spec.id, max(0.0, at - wall))
                    if isinstance(event, Finished):
                        records[spec.id] = event.result
                        finished_at = max(finished_at, at - wall)
        elapsed = finished_at or time.perf_counter() - started
    await broker.close()
    ok = [r for r in records.values() if r.status is JobStatus.SUCCEEDED]
    return {
        "size_pools": size_pools or "(one pool)",
        "jobs": len(specs),
        "succeeded": len(ok),
        "failed": len(specs) - len(ok),
        "output_tokens_per_s": round(sum(r.completion_tokens for r in ok) / elapsed, 1),
        "first_event": _ms(list(first_token.values())),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--pool-jobs", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="small sizes, to check it runs")
    opts = parser.parse_args()
    if opts.quick:
        opts.requests, opts.samples, opts.pool_jobs = 20, 10, 20
    with EmbeddedServer(appendfsync="everysec") as server:
        cached = await cache_and_collapse(server.url, opts)
        pooled = await pools(server.url, opts, "512")
        single = await pools(server.url, opts, "")
    print(
        json.dumps(
            {
                "benchmark": "cache_pools",
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                "loadavg": loadavg(),
                **cached,
                "pools": {"with_pools": pooled, "one_pool": single},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
