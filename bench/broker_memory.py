"""Valkey memory per job, for sizing the broker: `used_memory` deltas on a private Valkey.

Prints one JSON object: bytes per waiting job (enqueued, prompt as token ids) and per finished
job (its record and result, kept `TOKENYARD_BROKER_RECORD_TTL_S`), at the prompt and output
lengths given, with the audit trail's entries (receipt + terminal state) counted in.

    python -m bench.broker_memory --jobs 20000 --prompt-tokens 512 --output-tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
from typing import Any

import redis

from bench.common import server_version
from tokenyard.broker import connect, new_job_id, wait_until_ready
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings
from tokenyard.messages import FinishReason, JobResult, JobSpec, JobStatus, SamplingParams

MODEL = "bench"


def used(client: redis.Redis) -> int:
    info: dict[str, Any] = client.info("memory")
    return int(info["used_memory"])


async def measure(url: str, jobs: int, prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    broker = connect(BrokerSettings(url=url, prefix="mem", max_queue_depth=jobs + 1))
    await wait_until_ready(broker)
    client = redis.Redis.from_url(url)
    specs = [
        JobSpec(
            id=new_job_id(MODEL),
            model=MODEL,
            tenant="bench",
            prompt_token_ids=[1000 + (i + t) % 30000 for t in range(prompt_tokens)],
            sampling=SamplingParams(max_tokens=output_tokens, temperature=0.0),
            stream=False,
        )
        for i in range(jobs)
    ]
    await broker.queue.claim(MODEL, "mem", 1, block_s=0)  # creates the lane's group
    base = used(client)
    for i in range(0, jobs, 500):
        await broker.queue.enqueue_many(specs[i : i + 500])
    waiting = used(client)
    result = JobResult(
        status=JobStatus.SUCCEEDED,
        finish_reason=FinishReason.LENGTH,
        text="x" * (4 * output_tokens),  # ~4 characters a token
        token_ids=list(range(output_tokens)),
        prompt_tokens=prompt_tokens,
        completion_tokens=output_tokens,
        worker="mem",
    )
    done = 0
    while done < jobs:
        leases = await broker.queue.claim(MODEL, "mem", 500, block_s=0.5)
        done += sum(await broker.queue.complete_many([(lease, result) for lease in leases]))
    finished = used(client)
    await broker.close()
    return {
        "jobs": jobs,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "bytes_per_waiting_job": round((waiting - base) / jobs),
        "bytes_per_finished_job": round((finished - base) / jobs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=256)
    args = parser.parse_args()
    with EmbeddedServer() as valkey:
        report = asyncio.run(measure(valkey.url, args.jobs, args.prompt_tokens, args.output_tokens))
        report["server"] = server_version(redis.Redis.from_url(valkey.url))
    report["python"] = platform.python_version()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
