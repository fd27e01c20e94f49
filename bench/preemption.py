"""High-priority latency under a saturating batch-lane load: does preemption keep it low?

Starts a private Valkey and one in-process worker on the sim engine (every slot open to the
batch lane), and measures the time to first token (enqueue to the first token event) of
sequential high-priority jobs three times: on the idle worker; while --batch jobs saturate
it, with preemption (the default); and the same load without it (`preempt_lanes` empty:
a high job waits for a batch job to end). Reports TTFT p50/p99 of each, the loaded/idle
p99 ratio (goal <= 1.5), and the total tokens/s of the loaded runs, with/without (goal
>= 0.9). Prints one JSON document.

    python -m bench.preemption [--batch 64] [--batch-tokens 200] [--high 40] [--max-seqs 16]
        [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from typing import Any

from bench.common import loadavg, percentile
from tokenyard.broker import Backend, connect, new_job_id
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.engines.sim import SimEngine
from tokenyard.messages import Finished, JobSpec, Priority, SamplingParams, TokenChunk
from tokenyard.worker.worker import Worker

MODEL = "sim-preempt-bench"


def _spec(priority: Priority, prompt: str, max_tokens: int) -> JobSpec:
    return JobSpec(
        id=new_job_id(MODEL),
        model=MODEL,
        prompt=prompt,
        priority=priority,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        created_at=time.time(),
    )


async def _first_token(broker: Backend, job_id: str) -> None:
    after = "0"
    while True:
        for event_id, event in await broker.queue.read_events(job_id, after=after, block_s=1.0):
            after = event_id
            if isinstance(event, (TokenChunk, Finished)):
                return


async def _done(broker: Backend, job_id: str) -> None:
    after = "0"
    while True:
        for event_id, event in await broker.queue.read_events(job_id, after=after, block_s=1.0):
            after = event_id
            if isinstance(event, Finished):
                return


async def _ttfts(broker: Backend, n: int, tokens: int, gap_s: float) -> list[float]:
    out = []
    for i in range(n):
        job = _spec(Priority.HIGH, f"urgent {i} {uuid.uuid4().hex[:6]}", tokens)
        started = time.perf_counter()
        await broker.queue.enqueue(job)
        await _first_token(broker, job.id)
        out.append(time.perf_counter() - started)
        await _done(broker, job.id)
        await asyncio.sleep(gap_s)
    return out


async def _phase(url: str, args: argparse.Namespace, load: bool, preempt: bool) -> dict[str, Any]:
    settings = BrokerSettings(url=url, prefix=f"pb{uuid.uuid4().hex[:8]}")
    broker = connect(settings)
    worker_broker = connect(settings)
    engine = SimEngine(decode_base=args.step_s, decode_per_seq=args.step_per_seq_s)
    worker = Worker(
        worker_broker,
        engine,
        WorkerSettings(
            model=MODEL,
            engine="sim",
            max_seqs=args.max_seqs,
            batch_share=1.0,  # the batch lane may take every slot: the load saturates
            preempt_lanes="normal,low,batch" if preempt else "",
        ),
    )
    task = asyncio.create_task(worker.run())
    try:
        await _ttfts(broker, 3, args.high_tokens, 0.0)  # warm-up
        batch: list[JobSpec] = []
        started = time.perf_counter()
        if load:
            batch = [
                _spec(Priority.BATCH, f"batch {i}", args.batch_tokens) for i in range(args.batch)
            ]
            await broker.queue.enqueue_many(batch)
            while worker.scheduler.running < args.max_seqs:
                await asyncio.sleep(0.005)
        ttft = await _ttfts(broker, args.high, args.high_tokens, args.gap_s)
        saturated = worker.scheduler.running >= args.max_seqs - 1 if load else None
        await asyncio.gather(*(_done(broker, job.id) for job in batch))
        took = time.perf_counter() - started
        tokens = len(batch) * args.batch_tokens + args.high * args.high_tokens
        records = await broker.queue.records([job.id for job in batch])
        return {
            "ttft_s": {
                "count": len(ttft),
                "p50": percentile(ttft, 50),
                "p99": percentile(ttft, 99),
            },
            "seconds": round(took, 3),
            "tokens_per_s": round(tokens / took, 1),
            "preemptions": sum(r.preemptions for r in records if r is not None),
            "still_saturated_after_high_jobs": saturated,
        }
    finally:
        worker.drain()
        await asyncio.wait_for(task, 60)
        await broker.close()
        await worker_broker.close()


async def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    idle = await _phase(url, args, load=False, preempt=True)
    with_preemption = await _phase(url, args, load=True, preempt=True)
    without = await _phase(url, args, load=True, preempt=False)
    p99 = idle["ttft_s"]["p99"]
    return {
        "benchmark": "preemption",
        "idle": idle,
        "loaded_with_preemption": with_preemption,
        "loaded_without_preemption": without,
        "ttft_p99_ratio_loaded_vs_idle": round(with_preemption["ttft_s"]["p99"] / p99, 3),
        "ttft_p99_ratio_without_preemption": round(without["ttft_s"]["p99"] / p99, 3),
        "goal_ttft_p99_ratio_max": 1.5,
        "tokens_per_s_ratio_vs_without": round(
            with_preemption["tokens_per_s"] / without["tokens_per_s"], 3
        ),
        "goal_tokens_per_s_ratio_min": 0.9,
        "settings": vars(args),
        "loadavg": loadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=200)
    parser.add_argument("--high", type=int, default=40)
    parser.add_argument("--high-tokens", type=int, default=8)
    parser.add_argument("--gap-s", type=float, default=0.02, help="between high-priority jobs")
    parser.add_argument("--max-seqs", type=int, default=16)
    parser.add_argument("--step-s", type=float, default=0.005, help="sim decode step, base")
    parser.add_argument("--step-per-seq-s", type=float, default=1e-4)
    parser.add_argument("--quick", action="store_true", help="smoke sizes")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.batch_tokens, args.high, args.max_seqs = 16, 120, 10, 4
    with EmbeddedServer() as valkey:
        report = asyncio.run(run(valkey.url, args))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
