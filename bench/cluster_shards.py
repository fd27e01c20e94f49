"""Broker throughput on a 3-shard Valkey cluster: three models on one shard vs one per shard.

Each model gets its own process (producer + consumers on one Redis backend): enqueue in batches,
claim, complete. Prints JSON: jobs/s per layout and the ratio. Smoke:
    python -m bench.cluster_shards --jobs 300
For the record (a quiet machine with >= 4 cores):
    python -m bench.cluster_shards --jobs 20000 --consumers 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
import uuid
from typing import Any

from redis.crc import key_slot

from bench.common import loadavg
from tokenyard.broker import connect, new_job_id
from tokenyard.broker.core import Lease
from tokenyard.broker.redis.cluster import Cluster, running_cluster
from tokenyard.broker.redis.keys import Keys
from tokenyard.config import BrokerSettings
from tokenyard.messages import FinishReason, JobResult, JobSpec, JobStatus, SamplingParams


def models_on(cluster: Cluster, prefix: str, shards: list[int]) -> list[str]:
    """One model name per entry of `shards`, each hashing (by its tag) to that shard."""
    keys, found, n = Keys(prefix), [], 0
    for shard in shards:
        while True:
            name, n = f"m{n}", n + 1
            if cluster.shard_of_slot(key_slot(keys.counters(name).encode())) == shard:
                found.append(name)
                break
    return found


async def _run_model(url: str, prefix: str, model: str, jobs: int, consumers: int) -> float:
    broker = connect(BrokerSettings(url=url, prefix=prefix, max_queue_depth=10**7))
    done = 0
    result = JobResult(status=JobStatus.SUCCEEDED, finish_reason=FinishReason.STOP, text="ok")

    async def produce() -> None:
        for start in range(0, jobs, 32):
            n = min(32, jobs - start)
            specs = [
                JobSpec(
                    id=new_job_id(model),
                    model=model,
                    prompt="p",
                    sampling=SamplingParams(max_tokens=1),
                )
                for _ in range(n)
            ]
            await broker.queue.enqueue_many(specs)

    async def consume(i: int) -> None:
        nonlocal done
        while done < jobs:
            leases: list[Lease] = await broker.queue.claim(model, f"c{i}", 32, block_s=0.05)
            if leases:
                await broker.queue.complete_many([(lease, result) for lease in leases])
                done += len(leases)

    started = time.perf_counter()
    await asyncio.gather(produce(), *(consume(i) for i in range(consumers)))
    elapsed = time.perf_counter() - started
    await broker.close()
    return elapsed


def _child(args: tuple[str, str, str, int, int]) -> float:
    return asyncio.run(_run_model(*args))


def run_layout(cluster: Cluster, shards: list[int], jobs: int, consumers: int) -> dict[str, Any]:
    prefix = f"b{uuid.uuid4().hex[:6]}"
    models = models_on(cluster, prefix, shards)
    work = [(cluster.url, prefix, m, jobs, consumers) for m in models]
    started = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(len(models)) as pool:
        per_model = pool.map(_child, work)
    wall = time.perf_counter() - started
    total = jobs * len(models)
    return {
        "models": models,
        "shards": shards,
        "jobs": total,
        "jobs_per_s": round(total / max(per_model), 1),
        "per_model_s": [round(t, 3) for t in per_model],
        "wall_s_with_startup": round(wall, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=2000, help="jobs per model")
    p.add_argument("--consumers", type=int, default=2, help="claiming tasks per model")
    args = p.parse_args()
    with running_cluster(3) as cluster:
        one = run_layout(cluster, [0, 0, 0], args.jobs, args.consumers)
        spread = run_layout(cluster, [0, 1, 2], args.jobs, args.consumers)
    print(
        json.dumps(
            {
                "benchmark": "cluster_shards",
                "one_shard": one,
                "three_shards": spread,
                "speedup": round(spread["jobs_per_s"] / one["jobs_per_s"], 2),
                "cpus": multiprocessing.cpu_count(),
                "loadavg": loadavg(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
