"""Interactive latency while an offline batch runs: does the batch lane yield?

Starts a private Valkey, a gateway subprocess and worker subprocesses on the sim engine, then
measures sequential interactive /v1/completions latency twice: on the idle system, and while
a --batch-requests batch (/v1/batches) runs. Reports p50/p99 of both, their ratio (goal: p99
within 2x of idle), and the batch's throughput. Prints one JSON document.

    python -m bench.batch_interactive [--batch-requests 10000] [--interactive 300]
        [--batch-in-flight 512] [--batch-share F] [--workers 2] [--max-seqs 64] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from bench.common import loadavg, percentile
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.fleet.launch import Launcher, Processes, free_port, wait_ready

MODEL = "sim-bench"


def _batch_file(n: int, max_tokens: int) -> bytes:
    rows = (
        {
            "custom_id": f"b{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": f"batch {i}", "max_tokens": max_tokens},
        }
        for i in range(n)
    )
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


async def _interactive(client: httpx.AsyncClient, n: int, max_tokens: int) -> list[float]:
    latencies = []
    for i in range(n):
        started = time.perf_counter()
        r = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": f"live {i}", "max_tokens": max_tokens},
        )
        r.raise_for_status()
        latencies.append(time.perf_counter() - started)
    return latencies


def _summary(values: list[float]) -> dict[str, Any]:
    return {
        "count": len(values),
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
    }


async def run(args: argparse.Namespace, url: str, tmp: Path) -> dict[str, Any]:
    procs = Processes(tmp / "logs")
    port = free_port()
    prefix = f"bb{uuid.uuid4().hex[:8]}"
    common = ["--model", MODEL, "--engine", "sim"]
    os.environ["TOKENYARD_GATEWAY_FILES_DIR"] = str(tmp / "files")
    # the batch's share of the workers' slots: the knob between its throughput and the
    # interactive latency (each decode step slows with the sequences it carries)
    os.environ["TOKENYARD_GATEWAY_BATCH_MAX_IN_FLIGHT"] = str(args.batch_in_flight)
    # the batch lane's share of each worker's slots (None: the workers' default)
    if args.batch_share is not None:
        os.environ["TOKENYARD_WORKER_BATCH_SHARE"] = str(args.batch_share)
    try:
        launcher = Launcher(procs, url, prefix)
        for _ in range(args.workers):
            launcher.worker(*common, "--max-seqs", str(args.max_seqs))
        launcher.gateway(port, *common)
        base = f"http://127.0.0.1:{port}"
        await asyncio.to_thread(wait_ready, f"{base}/readyz", procs)
        async with httpx.AsyncClient(base_url=base, timeout=120.0) as client:
            await _interactive(client, 10, args.tokens)  # warm-up
            idle = await _interactive(client, args.interactive, args.tokens)
            up = await client.post(
                "/v1/files",
                files={"file": ("b.jsonl", _batch_file(args.batch_requests, args.tokens))},
                data={"purpose": "batch"},
            )
            up.raise_for_status()
            created = await client.post(
                "/v1/batches",
                json={
                    "input_file_id": up.json()["id"],
                    "endpoint": "/v1/completions",
                    "completion_window": "24h",
                },
            )
            created.raise_for_status()
            batch_id = created.json()["id"]
            started = time.monotonic()
            # let the batch fill the lanes before measuring
            while (await client.get(f"/v1/batches/{batch_id}")).json()["status"] == "validating":
                await asyncio.sleep(0.05)
            busy: list[float] = []
            while True:
                batch = (await client.get(f"/v1/batches/{batch_id}")).json()
                if batch["status"] in ("completed", "failed", "cancelled", "expired"):
                    break
                busy += await _interactive(client, 10, args.tokens)
            took = time.monotonic() - started
        counts = batch["request_counts"]
        idle_s, busy_s = _summary(idle), _summary(busy)
        ratio = busy_s["p99"] / idle_s["p99"] if busy_s["p99"] and idle_s["p99"] else None
        return {
            "benchmark": "batch_interactive",
            "batch": {
                "status": batch["status"],
                "requests": counts,
                "seconds": round(took, 3),
                "requests_per_s": round(counts["total"] / took, 1) if took else None,
            },
            "interactive_idle_s": idle_s,
            "interactive_during_batch_s": busy_s,
            "p99_ratio": ratio,
            "goal_p99_ratio_max": 2.0,
            "settings": vars(args),
            "loadavg": loadavg(),
        }
    finally:
        procs.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-requests", type=int, default=10_000)
    parser.add_argument("--interactive", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-seqs", type=int, default=64)
    parser.add_argument("--batch-in-flight", type=int, default=512)
    parser.add_argument("--batch-share", type=float, help="TOKENYARD_WORKER_BATCH_SHARE")
    parser.add_argument("--quick", action="store_true", help="smoke sizes")
    args = parser.parse_args()
    if args.quick:
        args.batch_requests, args.interactive = 300, 20
    with tempfile.TemporaryDirectory() as tmp, EmbeddedServer() as valkey:
        report = asyncio.run(run(args, valkey.url, Path(tmp)))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
