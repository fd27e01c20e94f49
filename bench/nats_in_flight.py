"""tokenyard's queue on NATS alone, one phase: `--jobs` enqueues with `--in-flight` outstanding
while a consumer process claims and completes them (bench.nats_vs_valkey's in-flight phase,
without plain nats-py's run around it), on a fresh private nats-server; the CPU per job of the
producer (this process), the consumer and the server. Prints one JSON.

To set two trees side by side, run this file with the other tree first on PYTHONPATH (its
`bench` and `tokenyard` are imported, its consumer started), alternating:

    PYTHONPATH=/path/to/other/tree python /path/to/this/bench/nats_in_flight.py
    python -m bench.nats_in_flight [--jobs 10000] [--in-flight 64] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import broker_compare as bc
from bench import nats_vs_valkey as nv
from bench.peers.base import in_flight

WARMUP = 300


async def measure(srv: bc.Server, jobs: int, width: int, rounds: int) -> list[dict[str, Any]]:
    processes, _ = bc.start_consumer("tokenyard-broker", srv, Path(tempfile.mkdtemp()))
    producer = nv.TokenyardProducer(srv)
    rows: list[dict[str, Any]] = []
    try:
        await producer.open()
        for i in range(WARMUP):
            await producer.enqueue(f"w{i}")
        done = WARMUP
        await bc.wait_count(producer, processes, done, 60.0)
        for r in range(rounds):
            await producer.reset()
            ids = [f"r{r}:{i}" for i in range(jobs)]
            before = srv.snapshot(before=True)
            consumer0, producer0, t0 = bc.cpu_s(processes), time.process_time(), time.monotonic()
            await in_flight(ids, width, producer.enqueue)
            enqueued = time.monotonic()
            finished, _ = await bc.wait_count(producer, processes, done + jobs, 120.0)
            after = srv.snapshot(before=False)
            consumer1, producer1 = bc.cpu_s(processes), time.process_time()
            completed = await producer.verify(ids)
            done += jobs
            server = after.cpu_s["server"] - before.cpu_s["server"]
            rows.append(
                {
                    "jobs_per_s": round(jobs / (finished - t0), 1) if completed == jobs else None,
                    "enqueue_jobs_per_s": round(jobs / (enqueued - t0), 1),
                    "completed": completed,
                    "consumer_cpu_us_per_job": round((consumer1 - consumer0) * 1e6 / jobs, 1),
                    "server_cpu_us_per_job": round(server * 1e6 / jobs, 1),
                    "producer_cpu_us_per_job": round((producer1 - producer0) * 1e6 / jobs, 1),
                    "loadavg": [round(x, 2) for x in os.getloadavg()],
                }
            )
    finally:
        await producer.close()
        processes.stop(timeout_s=15.0)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=10000)
    p.add_argument("--in-flight", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args(argv)
    load0 = [round(x, 2) for x in os.getloadavg()]
    with nv.nats_server() as srv:
        rows = asyncio.run(measure(srv, args.jobs, args.in_flight, args.rounds))
    tree = Path(nv.__file__).resolve().parents[1]
    report = {
        "benchmark": "nats_in_flight",
        "tree": str(tree),
        "config": {"jobs": args.jobs, "in_flight": args.in_flight},
        "loadavg_before": load0,
        "rounds": rows,
        "all_done": all(row["completed"] == args.jobs for row in rows),
    }
    print(json.dumps(report, indent=2))
    return 0 if report["all_done"] else 1


if __name__ == "__main__":
    sys.exit(main())
