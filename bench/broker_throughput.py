"""Broker throughput: enqueue → claim → complete through Redis with one consumer process.

Prints one JSON object: the full-cycle rate (first enqueue to last completion), the
enqueue-only rate, Redis commands per job from INFO commandstats deltas (commands run inside
Lua scripts included), and CPU per job for each process.

    python -m bench.broker_throughput --jobs 50000 --slots 256 --batch 500 [--profile DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import multiprocessing as mp
import os
import platform
import pstats
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import redis

from bench.common import server_version
from tokenyard.broker import connect, new_job_id, wait_until_ready
from tokenyard.broker.core import Lease, Leases, Producer
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings
from tokenyard.messages import (
    FinishReason,
    JobResult,
    JobSpec,
    JobStatus,
    SamplingParams,
)

MODEL = "bench"
TARGET_JOBS_PER_S = 10_000
RESULT = JobResult(
    status=JobStatus.SUCCEEDED,
    finish_reason=FinishReason.STOP,
    text="four small tokens",
    token_ids=[11, 12, 13, 14],
    prompt_tokens=8,
    completion_tokens=4,
    worker="bench",
)


def make_specs(n: int) -> list[JobSpec]:
    # Built before timing starts: building requests is the gateway's cost, not the broker's.
    return [
        JobSpec(
            id=new_job_id(MODEL),
            model=MODEL,
            tenant="bench",
            prompt=f"Say something about the number {i}.",
            sampling=SamplingParams(max_tokens=4, temperature=0.0),
        )
        for i in range(n)
    ]


def settings(url: str, prefix: str, jobs: int) -> BrokerSettings:
    # The lane bound must not refuse the benchmark's own backlog.
    return BrokerSettings(url=url, prefix=prefix, max_queue_depth=max(100_000, jobs + 1))


async def enqueue_all(broker: Producer, specs: Sequence[JobSpec], batch: int) -> None:
    for i in range(0, len(specs), batch):
        await broker.queue.enqueue_many(specs[i : i + batch])


async def consume(
    broker: Leases, consumer: str, jobs: int, slots: int, idle_s: float
) -> tuple[int, int]:
    """Claim in batches, complete each batch in one call; returns (completed, batches)."""
    done = batches = 0
    idle_since = time.monotonic()
    while done < jobs:
        leases: list[Lease] = await broker.queue.claim(MODEL, consumer, slots, block_s=0.5)
        if not leases:
            if time.monotonic() - idle_since > idle_s:
                break
            continue
        idle_since = time.monotonic()
        batches += 1
        accepted = await broker.queue.complete_many([(lease, RESULT) for lease in leases])
        done += sum(accepted)
    return done, batches


# -- the consumer process ------------------------------------------------------------------


def consumer_process(
    url: str, prefix: str, jobs: int, slots: int, conn: Connection, profile: str | None
) -> None:
    """Entry point of the consumer process; reports "ready", then its totals, on `conn`."""
    profiler = cProfile.Profile() if profile else None
    try:
        report = asyncio.run(_consumer(url, prefix, jobs, slots, conn, profiler))
    except BaseException as exc:  # the parent must hear why, not just wait out its timeout
        conn.send({"error": repr(exc)})
        raise
    if profiler is not None and profile is not None:
        profiler.dump_stats(profile)
    conn.send(report)


async def _consumer(
    url: str,
    prefix: str,
    jobs: int,
    slots: int,
    conn: Connection,
    profiler: cProfile.Profile | None,
) -> dict[str, Any]:
    broker = connect(settings(url, prefix, jobs))
    name = f"bench:{os.getpid()}"
    await wait_until_ready(broker)
    # Load the claim script and create the consumer groups before timing starts.
    await broker.queue.claim(MODEL, name, slots)
    conn.send("ready")
    cpu = time.process_time()
    if profiler is not None:
        profiler.enable()
    done, batches = await consume(broker, name, jobs, slots, idle_s=30.0)
    end = time.monotonic()
    if profiler is not None:
        profiler.disable()
    report = {
        "completed": done,
        "end": end,
        "cpu_s": time.process_time() - cpu,
        "batches": batches,
    }
    await broker.close()
    return report


# -- measurements --------------------------------------------------------------------------


# Commands a client sends itself; every other command in a phase runs inside a Lua script.
_CLIENT_COMMANDS = frozenset(
    {"evalsha", "eval", "info", "xread", "sadd", "hello", "ping", "flushall", "select"}
    | {"script|exists", "script|load", "client|setinfo"}
)


class ServerCounters:
    """INFO commandstats and server CPU, so a phase's cost is the delta of two snapshots."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.calls: dict[str, int] = {}
        self.usec: dict[str, int] = {}
        self.cpu_s = 0.0

    def snapshot(self) -> ServerCounters:
        snap = ServerCounters(self.client)
        stats: dict[str, dict[str, Any]] = self.client.info("commandstats")
        for key, row in stats.items():
            name = key.removeprefix("cmdstat_")
            snap.calls[name] = int(row["calls"])
            snap.usec[name] = int(row["usec"])
        cpu: dict[str, Any] = self.client.info("cpu")
        snap.cpu_s = float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
        return snap

    def since(self, before: ServerCounters, jobs: int) -> dict[str, Any]:
        # `info` is the benchmark's own probe, not the broker's traffic.
        calls = {
            name: n - before.calls.get(name, 0)
            for name, n in self.calls.items()
            if name != "info" and n - before.calls.get(name, 0) > 0
        }
        scripts = calls.get("evalsha", 0) + calls.get("eval", 0)
        script_usec = (
            self.usec.get("evalsha", 0)
            - before.usec.get("evalsha", 0)
            + self.usec.get("eval", 0)
            - before.usec.get("eval", 0)
        )
        usec = {name: n - before.usec.get(name, 0) for name, n in self.usec.items()}
        # EVALSHA's time includes the commands its script ran; the rest is the script's own.
        inner = sum(t for name, t in usec.items() if name not in _CLIENT_COMMANDS)
        return {
            "commands_per_job": round(sum(calls.values()) / jobs, 2),
            "script_calls_per_job": round(scripts / jobs, 2),
            "commands_per_job_by_name": {
                name: round(n / jobs, 3) for name, n in sorted(calls.items(), key=lambda kv: -kv[1])
            },
            "server_script_us_per_job": round(script_usec / jobs, 1),
            "server_script_overhead_us_per_job": round((script_usec - inner) / jobs, 1),
            "server_us_per_job_by_name": {
                name: round(t / jobs, 2)
                for name, t in sorted(usec.items(), key=lambda kv: -kv[1])
                if t > 0 and name not in ("evalsha", "eval", "info")
            },
            "server_cpu_us_per_job": round((self.cpu_s - before.cpu_s) * 1e6 / jobs, 1),
        }


def rate(n: int, seconds: float) -> float:
    return round(n / seconds, 1) if seconds > 0 else 0.0


async def run_redis(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with EmbeddedServer(appendfsync="everysec") as server:
        admin = redis.Redis.from_url(server.url)
        counters = ServerCounters(admin)
        out["server"] = server_version(admin)

        # Enqueue only: nobody consumes, so the producer has the machine to itself.
        specs = make_specs(args.jobs)
        broker = connect(settings(server.url, "enq", args.jobs))
        await broker.queue.enqueue_many(specs[:1])  # loads the script and creates the lane
        before = counters.snapshot()
        started = time.monotonic()
        await enqueue_all(broker, specs[1:], args.batch)
        wall = time.monotonic() - started
        enq = counters.snapshot().since(before, args.jobs - 1)
        out["enqueue_only_jobs_per_s"] = rate(args.jobs - 1, wall)
        out["enqueue_commands_per_job"] = enq["commands_per_job"]
        out["enqueue_server_cpu_us_per_job"] = enq["server_cpu_us_per_job"]
        await broker.close()
        admin.flushall()

        # Full cycle: this process enqueues while one consumer process claims and completes.
        specs = make_specs(args.jobs)
        broker = connect(settings(server.url, "cyc", args.jobs))
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        profile = str(Path(args.profile) / "consumer.pstats") if args.profile else None
        proc = ctx.Process(
            target=consumer_process,
            args=(server.url, "cyc", args.jobs, args.slots, child, profile),
            daemon=True,
        )
        proc.start()
        child.close()
        try:
            if not parent.poll(60) or parent.recv() != "ready":
                raise RuntimeError("the consumer process did not start")
            await wait_until_ready(broker)
            before = counters.snapshot()
            producer_profile = cProfile.Profile() if args.profile else None
            cpu = time.process_time()
            started = time.monotonic()
            if producer_profile is not None:
                producer_profile.enable()
            await enqueue_all(broker, specs, args.batch)
            if producer_profile is not None:
                producer_profile.disable()
            enqueued_at = time.monotonic()
            producer_cpu = time.process_time() - cpu
            # Generous: a slow machine should report a slow rate, not a timeout.
            if not parent.poll(max(120.0, args.jobs / 200)):
                raise RuntimeError("the consumer process did not finish")
            report: dict[str, Any] = parent.recv()
            if "error" in report:
                raise RuntimeError(f"the consumer process failed: {report['error']}")
            cycle = counters.snapshot().since(before, args.jobs)
            stats = await broker.queue.stats(MODEL)
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
            await broker.close()
            admin.close()

    # CLOCK_MONOTONIC is one clock for every process on the machine, so the two subtract.
    wall = report["end"] - started
    leftover = sum(lane.waiting + lane.in_flight for lane in stats.lanes)
    out.update(
        cycle_jobs_per_s=rate(report["completed"], wall),
        cycle_wall_s=round(wall, 3),
        completed=report["completed"],
        all_completed=report["completed"] == args.jobs and leftover == 0,
        enqueue_in_cycle_jobs_per_s=rate(args.jobs, enqueued_at - started),
        claimed_batches=report["batches"],
        avg_claim_batch=round(report["completed"] / max(1, report["batches"]), 1),
        commands_per_job=cycle["commands_per_job"],
        script_calls_per_job=cycle["script_calls_per_job"],
        commands_per_job_by_name=cycle["commands_per_job_by_name"],
        server_script_us_per_job=cycle["server_script_us_per_job"],
        server_script_overhead_us_per_job=cycle["server_script_overhead_us_per_job"],
        server_us_per_job_by_name=cycle["server_us_per_job_by_name"],
        cpu_us_per_job={
            "producer": round(producer_cpu * 1e6 / args.jobs, 1),
            "consumer": round(report["cpu_s"] * 1e6 / args.jobs, 1),
            "server": cycle["server_cpu_us_per_job"],
        },
    )
    if producer_profile is not None:
        producer_profile.dump_stats(str(Path(args.profile) / "producer.pstats"))
    return out


def top_functions(path: Path, n: int = 20) -> str:
    out = io.StringIO()
    pstats.Stats(str(path), stream=out).sort_stats("tottime").print_stats(n)
    return out.getvalue()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--jobs", type=int, default=50_000, help="jobs per phase")
    p.add_argument("--slots", type=int, default=256, help="jobs claimed per claim call")
    p.add_argument("--batch", type=int, default=500, help="jobs per enqueue_many call")
    p.add_argument("--profile", metavar="DIR", help="write cProfile stats of both processes")
    args = p.parse_args(argv)
    if args.jobs < 2 or args.slots < 1 or args.batch < 1:
        p.error("--jobs must be >= 2, --slots and --batch >= 1")
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)

    result: dict[str, Any] = {
        "jobs": args.jobs,
        "slots": args.slots,
        "batch": args.batch,
        "appendfsync": "everysec",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    result.update(asyncio.run(run_redis(args)))
    result["target_jobs_per_s"] = TARGET_JOBS_PER_S
    result["meets_target"] = result["cycle_jobs_per_s"] >= TARGET_JOBS_PER_S
    print(json.dumps(result, indent=2), flush=True)
    if args.profile:
        for name in ("producer", "consumer"):
            path = Path(args.profile) / f"{name}.pstats"
            if path.exists():
                print(f"=== {name} ===\n{top_functions(path)}", file=sys.stderr)
    return 0 if result["all_completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
