"""Prefix affinity (issue 11 item 4): TTFT with vs without it on a shared-prefix workload.

Several sim workers, each with its own LRU prefix cache (a cached leading run of blocks costs
no prefill; a miss costs `--prefill-per-token` per token), serve a Poisson stream of jobs whose
prompts start with one of a few long system prompts. Each worker's cache holds fewer system
prompts than there are (`--cache-prompts` < `--prompts`): without affinity every worker sees
every prompt and its LRU thrashes; with it each prompt sticks to the worker that ran it last.
Both runs use the same arrivals, workers and broker (a private Valkey; `--broker rabbitmq`: RabbitMQ
lanes, Debian's rabbitmq-server as tests/rabbitmq_server.py runs it, with that Valkey holding
the tables); jobs go straight to the
broker (the gateway's part, the prefix key, is the pure `tokenyard.gateway.affinity.prefix_key`).
TTFT is enqueue → first token event, on the server's clock (the event's id). Prints one JSON.

    python -m bench.prefix_affinity [--jobs 400] [--rate 40] [--workers 4] [--quick]

`--engine vllm` (run from the vLLM venv, e.g. `VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python`)
runs the same comparison on real vLLM prefix caching: `tokenyard worker --engine vllm` processes
on the tiny model (head size 32), whose KV caches hold every prompt, so what affinity saves is
the cold misses: many system prompts, each used a few times (`--prompts 32 --jobs 96`); a
different set of prompts per run, a warm-up before both. The hit rate is not reported there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

from bench.common import loadavg, percentile
from tokenyard.broker import Backend, connect, new_job_id
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.engines.sim import SimEngine
from tokenyard.fleet.launch import Processes
from tokenyard.gateway.affinity import prefix_key
from tokenyard.messages import Finished, JobResult, JobSpec, JobStatus, SamplingParams, TokenChunk
from tokenyard.worker.worker import Worker

MODEL = "tiny"  # the lane; vLLM workers serve the tiny model under this name


def _ms(values: list[float]) -> dict[str, float | None]:
    def pct(q: float) -> float | None:
        found = percentile(values, q)
        return None if found is None else round(1000 * found, 2)

    mean = round(1000 * sum(values) / len(values), 2) if values else None
    return {"p50_ms": pct(50), "p99_ms": pct(99), "mean_ms": mean}


def workload(opts: argparse.Namespace, seed: int) -> list[tuple[float, list[int]]]:
    """(arrival offset s, prompt ids): a system prompt picked uniformly, then a user turn."""
    rng = random.Random(seed)
    vocab = 256 if opts.engine == "sim" else 1000  # byte tokens; the tiny model's ids

    def tokens(n: int) -> list[int]:
        return [3 + rng.randrange(vocab) for _ in range(n)]

    systems = [tokens(opts.prompt_tokens) for _ in range(opts.prompts)]
    at, jobs = 0.0, []
    for _ in range(opts.jobs):
        at += rng.expovariate(opts.rate)
        jobs.append((at, systems[rng.randrange(opts.prompts)] + tokens(opts.user_tokens)))
    return jobs


@asynccontextmanager
async def _worker(settings: BrokerSettings, engine: SimEngine, slots: int) -> AsyncIterator[None]:
    broker = connect(settings)
    worker = Worker(
        broker,
        engine,
        WorkerSettings(
            model=MODEL, engine="sim", heartbeat_s=0.2, claim_block_s=0.2, max_seqs=slots
        ),
    )
    task = asyncio.create_task(worker.run())
    try:
        yield
    finally:
        worker.drain()
        await asyncio.wait_for(task, 60)
        await broker.close()


async def run(
    url: str, opts: argparse.Namespace, affinity: bool, tables: str = ""
) -> dict[str, Any]:
    """One run on in-process sim workers (their engines' prefix caches counted)."""
    settings = BrokerSettings(
        url=url,
        tables_url=tables,
        prefix=f"pa{uuid.uuid4().hex[:8]}",
        affinity_wait_s=opts.wait_ms / 1000,
    )
    engines = [
        SimEngine(
            prefill_base=0.002,
            prefill_per_token=opts.prefill_per_token,
            decode_base=opts.decode_step,
            decode_per_seq=5e-4,
            prefix_cache_tokens=opts.cache_prompts * (opts.prompt_tokens + opts.user_tokens),
        )
        for _ in range(opts.workers)
    ]
    broker = connect(settings)
    async with AsyncExitStack() as stack:
        for engine in engines:
            await stack.enter_async_context(_worker(settings, engine, opts.slots))
        while len(await broker.registry.workers(MODEL)) < opts.workers:
            await asyncio.sleep(0.05)
        report = await measure(broker, workload(opts, opts.seed), opts, affinity)
    await broker.close()
    queries = sum(e.stats().prefix_cache_queries for e in engines)
    hits = sum(e.stats().prefix_cache_hits for e in engines)
    return {**report, "prefix_cache_hit_rate": round(hits / queries, 3) if queries else None}


async def measure(
    broker: Backend,
    jobs: list[tuple[float, list[int]]],
    opts: argparse.Namespace,
    affinity: bool,
) -> dict[str, Any]:
    """Enqueue `jobs` on their schedule, then read every job's events: TTFT and throughput."""
    enqueued: dict[str, float] = {}
    specs = []
    start = time.time()
    for offset, ids in jobs:
        delay = start + offset - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        spec = JobSpec(
            id=new_job_id(MODEL),
            model=MODEL,
            prompt_token_ids=ids,
            sampling=SamplingParams(max_tokens=opts.max_tokens, temperature=0.0, ignore_eos=True),
            prefix_key=prefix_key(ids, opts.prompt_tokens) if affinity else "",
        )
        enqueued[spec.id] = time.time()
        await broker.queue.enqueue(spec)
        specs.append(spec)
    ttft: list[float] = []
    results: dict[str, JobResult] = {}
    end = 0.0
    for spec in specs:
        after, first = "0", None
        while spec.id not in results:
            for event_id, event in await broker.queue.read_events(spec.id, after, block_s=5.0):
                after = event_id
                at = int(event_id.split("-")[0]) / 1000
                if isinstance(event, TokenChunk) and first is None:
                    first = at
                if isinstance(event, Finished):
                    results[spec.id] = event.result
                    end = max(end, at)
        if first is not None:
            ttft.append(max(0.0, first - enqueued[spec.id]))
    ok = [r for r in results.values() if r.status is JobStatus.SUCCEEDED]
    elapsed = max(1e-9, end - start)
    per_worker: dict[str, int] = {}
    for r in ok:
        per_worker[r.worker or "?"] = per_worker.get(r.worker or "?", 0) + 1
    return {
        "affinity": affinity,
        "jobs": len(specs),
        "succeeded": len(ok),
        "ttft": _ms(ttft),
        "jobs_per_s": round(len(ok) / elapsed, 2),
        "output_tokens_per_s": round(sum(r.completion_tokens for r in ok) / elapsed, 1),
        "jobs_per_worker": sorted(per_worker.values()),
    }


async def run_vllm(url: str, opts: argparse.Namespace) -> tuple[dict[str, Any], ...]:
    """Both runs on `tokenyard worker --engine vllm` processes (started once, warmed up)."""
    settings = BrokerSettings(
        url=url, prefix=f"pv{uuid.uuid4().hex[:8]}", affinity_wait_s=opts.wait_ms / 1000
    )
    # the worker processes inherit this environment
    os.environ["TOKENYARD_BROKER_AFFINITY_WAIT_S"] = str(settings.affinity_wait_s)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    procs = Processes(Path(tempfile.mkdtemp(prefix="prefix-affinity-")))
    broker = connect(settings)
    try:
        for i in range(opts.workers):
            cmd = [
                sys.executable, "-m", "tokenyard.worker", "--broker", url,
                "--prefix", settings.prefix, "--model", "tiny", "--engine", "vllm",
                "--max-seqs", str(opts.slots), "--consumer", f"vllm-{i}",
            ]  # fmt: skip
            procs.start(f"worker-{i}", cmd)
        give_up = time.monotonic() + 600
        while len(await broker.registry.workers(MODEL)) < opts.workers:
            procs.check()
            if time.monotonic() > give_up:
                raise TimeoutError("vLLM workers did not start")
            await asyncio.sleep(0.5)
        # warm-up (not counted): compile and first-step costs, on prompts of their own
        warm = argparse.Namespace(**{**vars(opts), "jobs": 4 * opts.workers, "rate": 4.0})
        await measure(broker, workload(warm, opts.seed + 100), warm, affinity=False)
        without = await measure(broker, workload(opts, opts.seed), opts, affinity=False)
        with_affinity = await measure(broker, workload(opts, opts.seed + 1), opts, affinity=True)
    finally:
        await broker.close()
        procs.stop()
    return without, with_affinity


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--rate", type=float, default=40.0, help="arrivals per second (Poisson)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--slots", type=int, default=8, help="sequences per worker")
    parser.add_argument("--prompts", type=int, default=4, help="distinct system prompts")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="tokens per system prompt")
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument(
        "--cache-prompts", type=int, default=2, help="prompts a worker's cache holds"
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prefill-per-token", type=float, default=1e-4)
    parser.add_argument("--decode-step", type=float, default=0.01)
    parser.add_argument("--wait-ms", type=float, default=100.0, help="affinity bound")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    parser.add_argument("--broker", choices=("valkey", "rabbitmq"), default="valkey")
    parser.add_argument("--quick", action="store_true", help="small sizes, to check it runs")
    opts = parser.parse_args()
    if opts.broker == "rabbitmq" and opts.engine != "sim":
        parser.error("--broker rabbitmq runs the sim engine only")
    if opts.quick:
        opts.jobs, opts.rate = min(opts.jobs, 60), 30.0
    with EmbeddedServer(appendfsync="everysec") as server:
        if opts.broker == "rabbitmq":
            from tests.rabbitmq_server import RabbitServer  # the tests' node, started alike

            with RabbitServer() as rabbit:
                without = await run(rabbit.url, opts, affinity=False, tables=server.url)
                with_affinity = await run(rabbit.url, opts, affinity=True, tables=server.url)
        elif opts.engine == "vllm":
            without, with_affinity = await run_vllm(server.url, opts)
        else:
            without = await run(server.url, opts, affinity=False)
            with_affinity = await run(server.url, opts, affinity=True)
    gain = None
    if with_affinity["ttft"]["p50_ms"] and without["ttft"]["p50_ms"]:
        gain = round(without["ttft"]["p50_ms"] / with_affinity["ttft"]["p50_ms"], 2)
    print(
        json.dumps(
            {
                "benchmark": "prefix_affinity",
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                "loadavg": loadavg(),
                "workload": {
                    k: getattr(opts, k)
                    for k in (
                        "broker",
                        "engine",
                        "jobs",
                        "rate",
                        "workers",
                        "slots",
                        "prompts",
                        "prompt_tokens",
                        "user_tokens",
                        "cache_prompts",
                        "max_tokens",
                        "prefill_per_token",
                        "decode_step",
                        "wait_ms",
                    )
                },
                "without_affinity": without,
                "with_affinity": with_affinity,
                "ttft_p50_speedup": gain,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
