"""Overload: offered load at a multiple of the fleet's capacity; does shedding hold the SLO?

Starts a private Valkey, a gateway subprocess with its default settings (its default
`TOKENYARD_GATEWAY_QUEUE_SLO_S`, unless --slo names another) and one sim-engine worker
subprocess. Capacity is measured first (closed loop, --max-seqs requests in
flight: completions per second and the unloaded latency, which is also the warm-up the gateway
needs to measure the worker's service rate). Then open-loop arrivals at --factor x capacity for
--duration seconds: every answer is counted (200, 429 with Retry-After and an OpenAI-shaped
body, any 5xx), admitted latencies give p50/p99 against the SLO (queue wait <= SLO, so latency <=
SLO + one job's unloaded service time), and the gateway's RSS is sampled throughout.
With --compare (default) the same load runs again for --compare-s seconds on a fresh stack
with shedding off, to show what the SLO would have been without it. Prints one JSON document.

    python -m bench.overload [--factor 10] [--duration 60] [--slo S] [--max-seqs 4]
        [--tokens 64] [--fixed-tokens] [--compare-s 5] [--no-compare] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.common import loadavg, percentile
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.fleet.launch import Launcher, Processes, free_port, wait_ready
from tokenyard.gateway.settings import gateway_settings

MODEL = "sim-overload"


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


@dataclass
class Tally:
    """Every answer of the overload phase."""

    admitted: list[float] = field(default_factory=list)  # latency of each 200, seconds
    jobs: list[str] = field(default_factory=list)  # the job id of each 200
    refused: int = 0  # 429
    refused_ok: int = 0  # ... with Retry-After and an OpenAI-shaped rate_limit_error body
    retry_after: list[int] = field(default_factory=list)
    codes: dict[str, int] = field(default_factory=dict)
    server_errors: int = 0  # 5xx
    other: dict[str, int] = field(default_factory=dict)  # any other status or client error

    def add(self, latency: float, reply: httpx.Response | BaseException) -> None:
        if isinstance(reply, BaseException):
            key = type(reply).__name__
            self.other[key] = self.other.get(key, 0) + 1
        elif reply.status_code == 200:
            self.admitted.append(latency)
            self.jobs.append(reply.json()["id"].removeprefix("cmpl-"))
        elif reply.status_code == 429:
            self.refused += 1
            error = reply.json().get("error", {})
            code = str(error.get("code"))
            self.codes[code] = self.codes.get(code, 0) + 1
            after = reply.headers.get("retry-after", "")
            if after.isdigit() and error.get("type") == "rate_limit_error" and error.get("message"):
                self.refused_ok += 1
                self.retry_after.append(int(after))
        elif reply.status_code >= 500:
            self.server_errors += 1
        else:
            key = str(reply.status_code)
            self.other[key] = self.other.get(key, 0) + 1


async def _measure_capacity(
    client: httpx.AsyncClient, body: Callable[[], dict[str, Any]], concurrency: int, seconds: float
) -> tuple[float, list[float]]:
    """Completions per second with `concurrency` requests in flight, and their latencies."""
    latencies: list[float] = []
    stop = time.monotonic() + seconds

    async def loop() -> None:
        while time.monotonic() < stop:
            t0 = time.monotonic()
            reply = await client.post("/v1/completions", json=body())
            reply.raise_for_status()
            latencies.append(time.monotonic() - t0)

    start = time.monotonic()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return len(latencies) / (time.monotonic() - start), latencies


async def _queue_waits(client: httpx.AsyncClient, jobs: list[str]) -> list[float]:
    """Each admitted job's queue wait as its record has it (enqueued to started)."""
    limit = asyncio.Semaphore(32)

    async def one(job_id: str) -> float | None:
        async with limit:
            reply = await client.get(f"/v1/jobs/{job_id}")
        return reply.json()["timings"]["queue_time"] if reply.status_code == 200 else None

    waits = await asyncio.gather(*(one(j) for j in jobs))
    return [w for w in waits if w is not None]


async def _offer(
    client: httpx.AsyncClient,
    body: Callable[[], dict[str, Any]],
    rate: float,
    seconds: float,
    pid: int,
) -> tuple[Tally, list[float], float]:
    """Open-loop arrivals; the tally, the gateway's RSS samples (MB), the achieved rate."""
    tally, rss, done = Tally(), [], asyncio.Event()

    async def one() -> None:
        t0 = time.monotonic()
        try:
            reply: httpx.Response | BaseException = await client.post(
                "/v1/completions", json=body()
            )
        except httpx.HTTPError as exc:
            reply = exc
        tally.add(time.monotonic() - t0, reply)

    async def sample() -> None:
        while not done.is_set():
            if (mb := _rss_mb(pid)) is not None:
                rss.append(mb)
            await asyncio.sleep(0.25)

    sampler = asyncio.create_task(sample())
    tasks = []
    start = time.monotonic()
    n = int(rate * seconds)
    for i in range(n):
        await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        tasks.append(asyncio.create_task(one()))
    sent_s = time.monotonic() - start
    await asyncio.gather(*tasks)
    done.set()
    await sampler
    return tally, rss, n / sent_s


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 1)


async def _run_stack(
    args: argparse.Namespace, url: str, tmp: Path, slo_s: float | None, seconds: float, name: str
) -> dict[str, Any]:
    """One stack under the load; `slo_s` None: the gateway's default SLO."""
    procs = Processes(tmp / f"logs-{name}")
    port = free_port()
    prefix = f"ov{uuid.uuid4().hex[:8]}"
    common = ["--model", MODEL, "--engine", "sim"]
    env_before = dict(os.environ)
    if slo_s is None:
        os.environ.pop("TOKENYARD_GATEWAY_QUEUE_SLO_S", None)
        slo_s = gateway_settings().queue_slo_s
    else:
        os.environ["TOKENYARD_GATEWAY_QUEUE_SLO_S"] = str(slo_s)
    os.environ["TOKENYARD_GATEWAY_TOKENIZER"] = "sim"
    if args.heartbeat_s is not None:
        os.environ["TOKENYARD_WORKER_HEARTBEAT_S"] = str(args.heartbeat_s)
    rng = random.Random(0)
    low, high = (
        (args.tokens, args.tokens)
        if args.fixed_tokens
        else (args.tokens // 2, args.tokens * 3 // 2)
    )

    def body() -> dict[str, Any]:
        # lengths vary as real requests do (mean --tokens); --fixed-tokens runs every job in
        # lockstep, where a job's start lags the mean-field estimate by up to one job's time
        return {"model": MODEL, "prompt": "overload", "max_tokens": rng.randint(low, high)}

    try:
        launcher = Launcher(procs, url, prefix)
        launcher.worker(*common, "--max-seqs", str(args.max_seqs))
        gateway = launcher.gateway(port, *common)
        base = f"http://127.0.0.1:{port}"
        await asyncio.to_thread(wait_ready, f"{base}/readyz", procs)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=1000)
        async with httpx.AsyncClient(base_url=base, timeout=600.0, limits=limits) as client:
            capacity, unloaded = await _measure_capacity(client, body, args.max_seqs, args.warmup_s)
            rss_start = _rss_mb(gateway.pid)
            offered = args.factor * capacity
            tally, rss, achieved = await _offer(client, body, offered, seconds, gateway.pid)
            await asyncio.sleep(1.0)
            rss_end = _rss_mb(gateway.pid)
            queued = await _queue_waits(client, tally.jobs)
        service_p99 = percentile(unloaded, 99) or 0.0
        p99 = percentile(tally.admitted, 99)
        bound = slo_s + service_p99
        wait_p99 = percentile(queued, 99)
        return {
            "queue_slo_s": slo_s,
            "duration_s": seconds,
            "capacity_jobs_per_s": round(capacity, 2),
            "offered_per_s": round(offered, 2),
            "achieved_offered_per_s": round(achieved, 2),
            "requests": int(offered * seconds),
            "admitted": len(tally.admitted),
            "admitted_per_s": round(len(tally.admitted) / seconds, 2),
            "refused_429": tally.refused,
            "refused_429_with_retry_after_and_openai_body": tally.refused_ok,
            "refusal_codes": tally.codes,
            "retry_after_s": {
                "min": min(tally.retry_after, default=None),
                "max": max(tally.retry_after, default=None),
            },
            "server_errors_5xx": tally.server_errors,
            "other": tally.other,
            "unloaded_latency_ms": {"p50": _ms(percentile(unloaded, 50)), "p99": _ms(service_p99)},
            "admitted_latency_ms": {
                "p50": _ms(percentile(tally.admitted, 50)),
                "p99": _ms(p99),
                "max": _ms(max(tally.admitted, default=None)),
            },
            # the SLO itself: each admitted job's wait from its record (enqueued to started)
            "admitted_queue_wait_ms": {
                "p50": _ms(percentile(queued, 50)),
                "p99": _ms(wait_p99),
                "max": _ms(max(queued, default=None)),
                "jobs": len(queued),
            },
            "queue_wait_within_slo": (wait_p99 is not None and wait_p99 <= slo_s)
            if slo_s > 0
            else None,
            # queue wait <= SLO, then the job's own service time
            "latency_bound_ms": _ms(bound) if slo_s > 0 else None,
            "within_slo": (p99 is not None and p99 <= bound) if slo_s > 0 else None,
            "gateway_rss_mb": {
                "start": rss_start and round(rss_start, 1),
                "peak": round(max(rss), 1) if rss else None,
                "end": rss_end and round(rss_end, 1),
            },
        }
    finally:
        procs.stop()
        os.environ.clear()
        os.environ.update(env_before)


async def run(args: argparse.Namespace, url: str, tmp: Path) -> dict[str, Any]:
    report: dict[str, Any] = {"benchmark": "overload", "factor": args.factor}
    report["shedding"] = await _run_stack(args, url, tmp, args.slo, args.duration, "shed")
    if args.compare:
        # the same load with shedding off, shorter: its queue only drains at capacity
        without = await _run_stack(args, url, tmp, 0.0, args.compare_s, "noshed")
        without["latency_bound_ms"] = report["shedding"]["latency_bound_ms"]
        p99 = without["admitted_latency_ms"]["p99"]
        without["within_slo"] = p99 is not None and p99 <= (without["latency_bound_ms"] or 0)
        report["without_shedding"] = without
    report["settings"] = vars(args)
    report["loadavg"] = loadavg()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factor", type=float, default=10.0, help="offered load / capacity")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of overload")
    parser.add_argument(
        "--slo",
        type=float,
        help="TOKENYARD_GATEWAY_QUEUE_SLO_S (default: the gateway's own default)",
    )
    parser.add_argument("--max-seqs", type=int, default=4, help="the worker's slots")
    parser.add_argument("--tokens", type=int, default=64, help="mean max_tokens of a request")
    parser.add_argument(
        "--fixed-tokens", action="store_true", help="every request --tokens (default: 0.5-1.5x)"
    )
    parser.add_argument("--warmup-s", type=float, default=5.0, help="capacity measurement")
    parser.add_argument("--heartbeat-s", type=float, help="TOKENYARD_WORKER_HEARTBEAT_S")
    parser.add_argument("--compare-s", type=float, default=5.0, help="seconds without shedding")
    parser.add_argument("--no-compare", dest="compare", action="store_false")
    parser.add_argument("--quick", action="store_true", help="smoke sizes (and --slo 2)")
    args = parser.parse_args()
    if args.quick:
        args.factor, args.duration, args.warmup_s, args.compare_s = 5.0, 4.0, 3.0, 3.0
        # 4 s at 5x capacity queue ~16 s of work: a smoke run needs an SLO it reaches
        args.slo = 2.0 if args.slo is None else args.slo
    with tempfile.TemporaryDirectory() as tmp, EmbeddedServer() as valkey:
        report = asyncio.run(run(args, valkey.url, Path(tmp)))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
