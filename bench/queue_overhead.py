"""Queue overhead: no-op jobs through tokenyard and through arq, taskiq, RQ, Celery, Dramatiq.

Every system runs on one private Valkey (AOF, appendfsync everysec), each in its own database,
flushed between systems; one consumer process per system, the producer in this process. Every
system is driven through its single-job API, the same way:

  one_at_a_time  the producer awaits each enqueue before the next, while the consumer runs
  in_flight      --in-flight enqueues outstanding at once (async tasks; a thread pool of that
                 size for the peers whose client is synchronous)
  latency        enqueue -> done of single jobs at light load

For each throughput mode: live jobs/s (first enqueue until the last job is done), the enqueue
rate, CPU per job of the consumer and of the server, and Valkey commands per job (INFO
commandstats deltas; scripts' inner commands count, the benchmark's own polls do not).
tokenyard also reports `enqueue_many` (--batch jobs per call) as a separate, labelled row, and
`tokenyard-http` runs a real gateway + worker (zero-cost sim engine) and drives it over HTTP:
POST /v1/jobs and POST /v1/completions with max_tokens 1, one at a time and in flight, plus
commands per generated token with --tokens-per-job tokens. Ratios are against the best peer of
the same run. Prints one JSON document.

    python -m bench.queue_overhead --jobs 5000 [--systems tokenyard,arq,...] [--profile DIR]

Peers are a benchmark extra (`pip install -e .[bench-peers]`), each adapted in a module of its
own under bench/peers/ (settings, producer, consumer); a peer that is missing or fails is
reported with its error and the run goes on. A peer job marks itself done with one RPUSH of
its id onto a list; tokenyard's done is its terminal record (complete.lua removes the lane
entry in the same script, so the lanes' depth counts what is not done).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import functools
import io
import json
import logging
import os
import platform
import pstats
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import redis

from bench.common import command_calls, loadavg, percentile, proc_cpu_s, server_version
from bench.peers import PEERS
from bench.peers.base import PREFIX, Producer, in_flight, peer
from tokenyard.broker import Backend, connect, new_job_id, wait_until_ready
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.engines.sim import SimEngine
from tokenyard.fleet.launch import Launcher, Processes, free_port, wait_ready
from tokenyard.messages import (
    Finished,
    FinishReason,
    JobResult,
    JobSpec,
    JobStatus,
    SamplingParams,
)
from tokenyard.worker.run import run_worker
from tokenyard.worker.worker import Worker

TOKENYARD = ("tokenyard", "tokenyard-broker")
HTTP = "tokenyard-http"
SYSTEMS = (*TOKENYARD, HTTP, *PEERS)
GOAL = 3.0  # tokenyard's target: at least this many times the best peer, single-job API
HTTP_GOAL = 1.0  # through HTTP: at least the best peer's queue-only figure
MODEL = "noop"
WARMUP_JOBS = 20
POLL_S = 0.002
QUEUE_MODES = ("one_at_a_time", "in_flight")
HTTP_MODES = (
    "jobs_one_at_a_time",
    "jobs_in_flight",
    "completions_one_at_a_time",
    "completions_in_flight",
)
# commands that are not the work of a job: the benchmark's probe and connection set-up
NOT_WORK = ("info", "hello", "client|setinfo", "select", "ping", "flushall")

# What each consumer process is given: the best reasonable settings for a no-op job on 2 cores.
SETTINGS: dict[str, dict[str, Any]] = {
    "tokenyard": {
        "consumer": "tokenyard.worker.Worker + SimEngine with every cost 0, one process",
        "max_seqs": 256,
        "max_tokens": 1,
        "claim_block_s": 0.5,
        "producer": "queue.enqueue (enqueue_many in its own row)",
        "done": "terminal record + Finished event, written by complete.lua",
    },
    "tokenyard-broker": {
        "consumer": "queue.claim + complete_many loop, no worker or engine, one process",
        "slots": 256,
        "claim_block_s": 0.5,
        "producer": "queue.enqueue (enqueue_many in its own row)",
        "done": "terminal record + Finished event, written by complete.lua",
    },
    "tokenyard-http": {
        "consumer": "`tokenyard gateway` + the tokenyard worker above, one process each",
        "max_seqs": 256,
        "max_tokens": 1,
        "claim_block_s": 0.5,
        "producer": "aiohttp.ClientSession: POST /v1/jobs, POST /v1/completions",
        "done": "/v1/jobs: terminal record; /v1/completions: the response",
    },
}

SETTINGS.update({name: p.settings for name, p in PEERS.items()})  # the same dicts: --set edits them

DISTRIBUTIONS = {
    "tokenyard": ["tokenyard"],
    "tokenyard-broker": ["tokenyard"],
    "tokenyard-http": ["tokenyard", "uvicorn", "fastapi", "aiohttp"],
    **{name: p.distributions for name, p in PEERS.items()},
}


def db_url(base: str, db: int) -> str:
    """The server's URL for database `db`."""
    return f"{base.rsplit('/', 1)[0]}/{db}"


def ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def noop_spec(job_id: str, max_tokens: int = 1) -> JobSpec:
    return JobSpec(
        id=job_id,
        model=MODEL,
        tenant="bench",
        prompt="x",
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


class TokenyardProducer(Producer):
    """queue.enqueue; done = no longer in a lane (complete.lua XDELs with the record)."""

    poll_commands = 3  # depth(): XLEN of each lane, pipelined

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.broker = connect(BrokerSettings(url=url, prefix=PREFIX, max_queue_depth=1_000_000))
        self.enqueued = 0
        self.job_ids: dict[str, str] = {}  # bench id -> tokenyard job id

    async def open(self) -> None:
        await wait_until_ready(self.broker)

    def _spec(self, bench_id: str) -> JobSpec:
        spec = noop_spec(new_job_id(MODEL))
        self.job_ids[bench_id] = spec.id
        self.enqueued += 1
        return spec

    async def enqueue(self, job_id: str) -> None:
        await self.broker.queue.enqueue(self._spec(job_id))

    async def enqueue_batched(self, ids: Sequence[str], batch: int) -> None:
        specs = [self._spec(i) for i in ids]
        for k in range(0, len(specs), batch):
            await self.broker.queue.enqueue_many(specs[k : k + batch])

    async def wait_done(self, job_id: str, timeout_s: float) -> None:
        await finished(self.broker, self.job_ids[job_id], timeout_s)

    async def done_count(self) -> int:
        return self.enqueued - await self.broker.queue.depth(MODEL)

    async def verify(self, ids: Sequence[str]) -> int:
        return await succeeded(self.broker, [self.job_ids[i] for i in ids])

    async def reset(self) -> None:
        self.job_ids.clear()

    async def close(self) -> None:
        await self.broker.close()
        await super().close()


async def finished(broker: Backend, job_id: str, timeout_s: float) -> None:
    """Follow a job's events until its Finished event."""
    give_up = time.monotonic() + timeout_s
    after = "0"
    while (left := give_up - time.monotonic()) > 0:
        for event_id, event in await broker.queue.read_events(job_id, after, block_s=left):
            after = event_id
            if isinstance(event, Finished):
                return
    raise TimeoutError(f"job {job_id} not done after {timeout_s} s")


async def succeeded(broker: Backend, job_ids: Sequence[str]) -> int:
    count = 0
    for k in range(0, len(job_ids), 64):
        records = await asyncio.gather(*(broker.queue.record(j) for j in job_ids[k : k + 64]))
        count += sum(r is not None and r.status is JobStatus.SUCCEEDED for r in records)
    return count


def make_producer(system: str, url: str) -> Producer:
    if system in TOKENYARD:
        return TokenyardProducer(url)
    return PEERS[system].producer(url)


class HttpProducer(TokenyardProducer):
    """tokenyard through its gateway: POST /v1/jobs (done: the terminal record) or POST
    /v1/completions (done: the response)."""

    def __init__(self, url: str, base: str, max_tokens: int = 1) -> None:
        super().__init__(url)
        aiohttp = peer("aiohttp")
        # aiohttp, not httpx: httpx's async connection pool, not the gateway, was the limit
        # at ~100 requests/s with 64 in flight (the same gateway served 1,000/s to aiohttp)
        self.http = aiohttp.ClientSession(
            base,
            timeout=aiohttp.ClientTimeout(total=120.0),
            connector=aiohttp.TCPConnector(limit=0),
        )
        self.max_tokens = max_tokens
        self.body = {"model": MODEL, "prompt": "x", "temperature": 0.0, "ignore_eos": True}
        self.tokens = 0  # completion tokens the /v1/completions answers reported

    async def submit(self, job_id: str) -> None:
        async with self.http.post("/v1/jobs", json={**self.body, "max_tokens": 1}) as reply:
            if reply.status != 202:
                raise RuntimeError(f"POST /v1/jobs: {reply.status} {await reply.text()}")
            self.job_ids[job_id] = (await reply.json())["id"]
        self.enqueued += 1

    async def complete(self, job_id: str) -> None:
        body = {**self.body, "max_tokens": self.max_tokens}
        async with self.http.post("/v1/completions", json=body) as reply:
            if reply.status != 200:
                raise RuntimeError(f"POST /v1/completions: {reply.status} {await reply.text()}")
            self.tokens += int((await reply.json())["usage"]["completion_tokens"])

    async def enqueue(self, job_id: str) -> None:
        await self.submit(job_id)

    async def close(self) -> None:
        await self.http.close()
        await super().close()


# -- consumers (run with --serve in their own process) -------------------------------------


def consumer_settings(url: str, tables_url: str) -> BrokerSettings:
    """A consumer's broker; `tables_url`: the tables' Redis URL beside amqp:// lanes."""
    return BrokerSettings(url=url, tables_url=tables_url, prefix=PREFIX, max_queue_depth=1_000_000)


def serve_tokenyard(
    url: str, profile: str | None, settings: dict[str, Any], tables_url: str = ""
) -> None:
    """The real worker on a SimEngine whose every cost is 0."""

    async def main() -> None:
        broker = connect(consumer_settings(url, tables_url))
        await wait_until_ready(broker)
        engine = SimEngine(
            max_seqs=settings["max_seqs"],
            prefill_base=0.0,
            prefill_per_token=0.0,
            decode_base=0.0,
            decode_per_seq=0.0,
        )
        worker_settings = WorkerSettings(
            model=MODEL,
            engine="sim",
            max_seqs=settings["max_seqs"],
            claim_block_s=settings["claim_block_s"],
        )
        await run_worker(broker, Worker(broker, engine, worker_settings, freeze_heap=True))

    _profiled(main, profile)


def serve_tokenyard_broker(url: str, profile: str | None, tables_url: str = "") -> None:
    settings = SETTINGS["tokenyard-broker"]
    result = JobResult(
        status=JobStatus.SUCCEEDED, finish_reason=FinishReason.LENGTH, worker="bench"
    )

    async def main() -> None:
        broker = connect(consumer_settings(url, tables_url))
        await wait_until_ready(broker)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        consumer = f"bench:{os.getpid()}"
        while not stop.is_set():
            leases = await broker.queue.claim(
                MODEL, consumer, settings["slots"], block_s=settings["claim_block_s"]
            )
            if leases:
                await broker.queue.complete_many([(lease, result) for lease in leases])
        await broker.close()

    _profiled(main, profile)


def _profiled(main: Callable[[], Any], profile: str | None) -> None:
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    try:
        asyncio.run(main())
    finally:
        if profiler is not None and profile is not None:
            profiler.disable()
            profiler.dump_stats(profile)


def serve(system: str, url: str, profile: str | None, tables_url: str = "") -> None:
    """Entry point of a consumer process."""
    logging.basicConfig(level=logging.WARNING)
    if system in ("tokenyard", HTTP):
        serve_tokenyard(url, profile, SETTINGS[system], tables_url)
    elif system == "tokenyard-broker":
        serve_tokenyard_broker(url, profile, tables_url)
    else:
        PEERS[system].serve(url)


# -- the measurement -----------------------------------------------------------------------


class Stack:
    """One system's processes: its consumer, and for tokenyard-http the gateway in front."""

    def __init__(self, system: str, url: str, profile: str | None, log_dir: Path) -> None:
        self.processes = Processes(log_dir / system)
        argv = [sys.executable, "-m", "bench.queue_overhead", "--serve", system, "--url", url]
        argv += ["--settings-json", json.dumps(SETTINGS[system])]
        if profile:
            argv += ["--profile-out", profile]
        # the consumer's own session, so a stop reaches the children some peers fork
        self.processes.start("consumer", argv, new_session=True)
        self.base = ""
        if system == HTTP:
            port = free_port()
            self.base = f"http://127.0.0.1:{port}"
            launcher = Launcher(self.processes, url, PREFIX)
            launcher.gateway(port, "--model", MODEL, "--engine", "sim")

    def check_alive(self) -> None:
        self.processes.check()

    def cpu_s(self) -> float:
        """CPU seconds of the system's processes (consumer, gateway) so far."""
        return sum(proc_cpu_s(pid) for pid in self.processes.pids().values())

    def log_tail(self) -> str:
        return "\n".join(self.processes.log_tail(name) for name in self.processes.procs)

    def stop(self) -> None:
        self.processes.stop(timeout_s=15.0)


class ServerProbe:
    """Server CPU and command counts, for per-job deltas."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def snapshot(self) -> tuple[float, dict[str, int]]:
        cpu: dict[str, Any] = self.client.info("cpu")
        return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), command_calls(self.client)


def work_commands(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Commands run between two snapshots, without the probe's and connection set-up."""
    delta = {name: n - before.get(name, 0) for name, n in after.items() if name not in NOT_WORK}
    return {name: n for name, n in delta.items() if n > 0}


async def wait_count(
    producer: Producer, stack: Stack, target: int, timeout_s: float
) -> tuple[float, int, int]:
    """Poll until `target` jobs are done; returns (monotonic time seen, done, polls)."""
    give_up = time.monotonic() + timeout_s
    polls = 0
    while True:
        done = await producer.done_count()
        polls += 1
        now = time.monotonic()
        if done >= target or now > give_up:
            return now, done, polls
        if polls % 250 == 0:
            stack.check_alive()
        await asyncio.sleep(POLL_S)


async def phase(
    producer: Producer,
    stack: Stack,
    probe: ServerProbe,
    ids: Sequence[str],
    send: Callable[[], Awaitable[None]],
    poll: bool = True,
) -> dict[str, Any]:
    """One throughput phase: `send()` enqueues `ids`; then, if `poll`, wait until all are done.
    Counts per job: wall time, CPU of the system's processes and of the server, commands."""
    n = len(ids)
    before = await producer.done_count() if poll else 0
    cpu0, (server0, calls0) = stack.cpu_s(), probe.snapshot()
    started = time.monotonic()
    await send()
    enqueued = finished_at = time.monotonic()
    polls = 0
    if poll:
        timeout = max(120.0, n / 50)
        finished_at, _, polls = await wait_count(producer, stack, before + n, timeout)
    cpu1, (server1, calls1) = stack.cpu_s(), probe.snapshot()
    completed = await producer.verify(ids) if poll else n
    wall = finished_at - started
    commands = work_commands(calls0, calls1)
    total = sum(commands.values()) - polls * producer.poll_commands
    row: dict[str, Any] = {
        "jobs_per_s": round(n / wall, 1) if completed == n else None,
        "enqueue_jobs_per_s": round(n / max(enqueued - started, 1e-9), 1) if poll else None,
        "wall_s": round(wall, 3),
        "completed": completed,
        "all_done": completed == n,
        "system_cpu_us_per_job": round((cpu1 - cpu0) * 1e6 / n, 1),
        "server_cpu_us_per_job": round((server1 - server0) * 1e6 / n, 1),
        "server_commands_per_job": round(total / n, 2),
        "commands_per_job_by_name": {
            name: round(c / n, 2)
            for name, c in sorted(commands.items(), key=lambda kv: -kv[1])
            if c / n >= 0.01
        },
    }
    if poll:  # the polls are this benchmark's, not the system's
        row["benchmark_poll_commands"] = polls * producer.poll_commands
    if completed != n:
        row["error"] = f"only {completed} of {n} jobs done after {wall:.1f} s"
    return row


async def latency(
    run_one: Callable[[str], Awaitable[None]], jobs: int, gap_ms: float
) -> dict[str, Any]:
    """One job at a time, a random pause of 0..2·gap between jobs: enqueue → done."""
    rng = random.Random(7)
    samples: list[float] = []
    for i in range(jobs):
        t0 = time.monotonic()
        await run_one(f"l{i}")
        samples.append((time.monotonic() - t0) * 1000)
        await asyncio.sleep(rng.uniform(0, 2 * gap_ms) / 1000)
    return {
        "p50_ms": ms(percentile(samples, 50)),
        "p99_ms": ms(percentile(samples, 99)),
        "mean_ms": ms(statistics.fmean(samples)),
    }


async def settle(producer: Producer) -> None:
    await producer.reset()
    await asyncio.sleep(0.2)


async def measure_queue(
    system: str, producer: Producer, stack: Stack, probe: ServerProbe, args: argparse.Namespace
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    await producer.open()
    # warm-up: the consumer is up, scripts are loaded, groups exist
    warm = [f"w{i}" for i in range(WARMUP_JOBS)]
    for job_id in warm:
        await producer.enqueue(job_id)
    _, done, _ = await wait_count(producer, stack, WARMUP_JOBS, args.start_timeout_s)
    if done < WARMUP_JOBS:
        stack.check_alive()
        raise TimeoutError(f"warm-up: {done} of {WARMUP_JOBS} done\n{stack.log_tail()}")
    await settle(producer)

    async def one_at_a_time(ids: Sequence[str]) -> None:
        for job_id in ids:
            await producer.enqueue(job_id)

    sends: dict[str, Callable[[Sequence[str]], Awaitable[None]]] = {
        "one_at_a_time": one_at_a_time,
        "in_flight": lambda ids: producer.enqueue_concurrently(ids, args.in_flight),
    }
    if isinstance(producer, TokenyardProducer):
        batch = args.batch
        sends["enqueue_many"] = lambda ids: producer.enqueue_batched(ids, batch)
    for mode, send in sends.items():
        ids = [f"{mode}:{i}" for i in range(args.jobs)]
        out[mode] = await phase(producer, stack, probe, ids, functools.partial(send, ids))
        if "error" in out[mode]:
            out["error"] = f"{mode}: {out[mode]['error']}"
            return out
        await settle(producer)

    async def run_one(job_id: str) -> None:
        await producer.enqueue(job_id)
        await producer.wait_done(job_id, 30.0)

    out["latency"] = await latency(run_one, args.latency_jobs, args.gap_ms)
    return out


async def measure_http(
    producer: HttpProducer, stack: Stack, probe: ServerProbe, args: argparse.Namespace
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    await producer.open()
    await asyncio.to_thread(
        wait_ready, f"{stack.base}/readyz", stack.processes, timeout_s=args.start_timeout_s
    )
    for i in range(WARMUP_JOBS):
        await producer.complete(f"w{i}")
        await producer.submit(f"wj{i}")
    _, done, _ = await wait_count(producer, stack, WARMUP_JOBS, args.start_timeout_s)
    if done < WARMUP_JOBS:
        raise TimeoutError(f"warm-up: {done} of {WARMUP_JOBS} jobs done\n{stack.log_tail()}")
    await settle(producer)

    async def one_at_a_time(call: Callable[[str], Awaitable[None]], ids: Sequence[str]) -> None:
        for job_id in ids:
            await call(job_id)

    width = args.in_flight
    n = args.http_jobs
    plans: dict[str, tuple[Callable[[Sequence[str]], Awaitable[None]], bool]] = {
        "jobs_one_at_a_time": (lambda ids: one_at_a_time(producer.submit, ids), True),
        "jobs_in_flight": (lambda ids: in_flight(ids, width, producer.submit), True),
        "completions_one_at_a_time": (lambda ids: one_at_a_time(producer.complete, ids), False),
        "completions_in_flight": (lambda ids: in_flight(ids, width, producer.complete), False),
    }
    for mode, (send, poll) in plans.items():
        ids = [f"{mode}:{i}" for i in range(n)]
        out[mode] = await phase(producer, stack, probe, ids, functools.partial(send, ids), poll)
        if "error" in out[mode]:
            out["error"] = f"{mode}: {out[mode]['error']}"
            return out
        await settle(producer)
    out["latency"] = await latency(producer.complete, args.latency_jobs, args.gap_ms)

    # Valkey commands per generated token: longer completions, in flight
    producer.max_tokens, producer.tokens = args.tokens_per_job, 0
    ids = [f"tokens:{i}" for i in range(max(1, n // 4))]
    row = await phase(
        producer, stack, probe, ids, lambda: in_flight(ids, width, producer.complete), False
    )
    tokens = max(producer.tokens, 1)
    commands = row["server_commands_per_job"] * len(ids)
    out["tokens"] = {
        "max_tokens": args.tokens_per_job,
        "requests": len(ids),
        "tokens": producer.tokens,
        "tokens_per_s": round(tokens / row["wall_s"], 1),
        "server_commands_per_token": round(commands / tokens, 2),
        "server_commands_per_request": row["server_commands_per_job"],
        "commands_per_request_by_name": row["commands_per_job_by_name"],
    }
    producer.max_tokens = 1
    return out


def versions(system: str) -> dict[str, str]:
    found = {}
    for dist in DISTRIBUTIONS[system]:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[dist] = metadata.version(dist)
    return found


async def run_system(
    system: str, base_url: str, db: int, args: argparse.Namespace, log_dir: Path
) -> dict[str, Any]:
    entry: dict[str, Any] = {"settings": SETTINGS[system], "versions": versions(system)}
    url = db_url(base_url, db)
    admin = redis.Redis.from_url(url)
    admin.flushall()
    profile = None
    if args.profile and system in (*TOKENYARD, HTTP):
        profile = f"{args.profile}/{system}.pstats"
    stack = Stack(system, url, profile, log_dir)
    producer: Producer | None = None
    try:
        probe = ServerProbe(admin)
        if system == HTTP:
            producer = http = HttpProducer(url, stack.base)
            entry.update(await measure_http(http, stack, probe, args))
        else:
            producer = make_producer(system, url)
            entry.update(await measure_queue(system, producer, stack, probe, args))
    except Exception as exc:  # a peer that fails is reported, not fatal
        entry["error"] = f"{type(exc).__name__}: {exc}"
        tail = stack.log_tail()
        if tail and tail not in entry["error"]:
            entry["consumer_log_tail"] = tail[-3000:]
    finally:
        if producer is not None:
            with contextlib.suppress(Exception):
                await producer.close()
        stack.stop()
        admin.flushall()
        admin.close()
    entry["all_done"] = "error" not in entry
    return entry


def _rate(row: dict[str, Any], mode: str) -> float | None:
    value = row.get(mode, {}).get("jobs_per_s")
    return float(value) if value else None


def comparison(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """tokenyard's rows against the best peer of the same run: > 1 means tokenyard is better."""
    out: dict[str, Any] = {"goal": GOAL, "http_goal": HTTP_GOAL}
    peers = {k: v for k, v in results.items() if k in PEERS and "error" not in v}
    if not peers:
        out["note"] = "no peer finished; nothing to compare"
        return out
    for mode in QUEUE_MODES:
        rates = {k: r for k, v in peers.items() if (r := _rate(v, mode))}
        if not rates:
            continue
        best = max(rates, key=lambda k: rates[k])
        cell: dict[str, Any] = {"best_peer": best, "best_peer_jobs_per_s": rates[best]}
        for name in TOKENYARD:
            if (mine := _rate(results.get(name, {}), mode)) is not None:
                cell[f"{name}_ratio"] = round(mine / rates[best], 2)
        if (batched := _rate(results.get("tokenyard", {}), "enqueue_many")) is not None:
            cell["tokenyard_enqueue_many_ratio (batched, not single-job)"] = round(
                batched / rates[best], 2
            )
        for http_mode in (f"jobs_{mode}", f"completions_{mode}"):
            if (mine := _rate(results.get(HTTP, {}), http_mode)) is not None:
                cell[f"http_{http_mode}_ratio"] = round(mine / rates[best], 2)
        ratio = cell.get("tokenyard_ratio")
        cell["tokenyard_meets_goal"] = ratio is not None and ratio >= GOAL
        http_ratio = cell.get(f"http_completions_{mode}_ratio")
        cell["http_meets_goal"] = http_ratio is not None and http_ratio >= HTTP_GOAL
        out[mode] = cell
    lat = {k: v["latency"] for k, v in peers.items() if v.get("latency")}
    if lat:
        best50 = min(lat, key=lambda k: lat[k]["p50_ms"])
        best99 = min(lat, key=lambda k: lat[k]["p99_ms"])
        cell = {"best_peer_p50": best50, "best_peer_p99": best99}
        for name in (*TOKENYARD, HTTP):
            mine = results.get(name, {}).get("latency")
            if mine:
                cell[f"{name}_p50_ratio"] = round(lat[best50]["p50_ms"] / mine["p50_ms"], 2)
                cell[f"{name}_p99_ratio"] = round(lat[best99]["p99_ms"] / mine["p99_ms"], 2)
        out["latency"] = cell
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, dict[str, Any]] = {}
    report: dict[str, Any] = {
        "jobs": args.jobs,
        "http_jobs": args.http_jobs,
        "in_flight": args.in_flight,
        "enqueue_many_batch": args.batch,
        "latency_jobs": args.latency_jobs,
        "latency_gap_ms": args.gap_ms,
        "appendfsync": "everysec",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "redis_py": redis.__version__,
        "loadavg_before": loadavg(),
    }
    with (
        EmbeddedServer(appendfsync="everysec") as server,
        tempfile.TemporaryDirectory(prefix="queue-overhead-") as tmp,
    ):
        admin = redis.Redis.from_url(server.url)
        report["server"] = server_version(admin)
        admin.close()
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
        # round-robin over systems, so slow drift of the machine touches every system alike
        for repeat in range(args.repeats):
            for system in args.systems:
                db = SYSTEMS.index(system) + 1
                tag = f"[queue_overhead] {system} ({repeat + 1}/{args.repeats})"
                print(f"{tag} ...", file=sys.stderr, flush=True)
                row = await run_system(system, server.url, db, args, Path(tmp) / str(repeat))
                runs[system].append(row)
                print(f"{tag}: {row.get('error') or headline(row)}", file=sys.stderr, flush=True)
    for system, rows in runs.items():
        results[system] = combine(rows)
    report["loadavg_after"] = loadavg()
    report["repeats"] = args.repeats
    report["systems"] = results
    report["tokenyard_vs_best_peer"] = comparison(results)
    return report


def headline(row: dict[str, Any]) -> dict[str, Any]:
    return {
        mode: row[mode].get("jobs_per_s")
        for mode in (*QUEUE_MODES, "enqueue_many", *HTTP_MODES)
        if mode in row
    }


def combine(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's row from its repeats: the median of each number over the clean runs."""
    if len(rows) == 1:
        return rows[0]
    clean = [r for r in rows if "error" not in r]
    out: dict[str, Any] = {"settings": rows[0]["settings"], "versions": rows[0]["versions"]}
    errors = [r["error"] for r in rows if "error" in r]
    if not clean:
        return {**out, "error": errors[0], "errors": errors, "all_done": False}

    def median_of(cells: list[dict[str, Any]]) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for key, first in cells[0].items():
            values = [c[key] for c in cells if c.get(key) is not None]
            if isinstance(first, bool) or not isinstance(first, int | float):
                merged[key] = first if all(v == first for v in values) else values
            else:
                merged[key] = round(statistics.median(values), 3) if values else None
        return merged

    for key, value in clean[0].items():
        if isinstance(value, dict) and key not in ("settings", "versions"):
            out[key] = median_of([r[key] for r in clean if isinstance(r.get(key), dict)])
    out["all_done"] = not errors
    out["runs"] = [headline(r) for r in clean]
    if errors:
        out["errors"] = errors
    return out


def top_functions(path: Path, n: int = 25) -> str:
    out = io.StringIO()
    pstats.Stats(str(path), stream=out).sort_stats("tottime").print_stats(n)
    return out.getvalue()


def parse_systems(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown systems {unknown}; choose from {SYSTEMS}")
    return names


def apply_override(item: str) -> None:
    """Apply one SYSTEM.KEY=VALUE override to SETTINGS."""
    target, sep, raw = item.partition("=")
    system, dot, key = target.partition(".")
    if not sep or not dot or system not in SETTINGS or key not in SETTINGS[system]:
        raise ValueError(f"--set {item!r}: expected SYSTEM.KEY=VALUE with a known key")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    SETTINGS[system][key] = value


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--jobs", type=int, default=5000, help="jobs in each throughput phase")
    p.add_argument("--http-jobs", type=int, default=2000, help="requests per HTTP phase")
    p.add_argument("--in-flight", type=int, default=64, help="outstanding enqueues, every system")
    p.add_argument("--latency-jobs", type=int, default=200, help="jobs in the latency phase")
    p.add_argument("--gap-ms", type=float, default=5.0, help="mean pause between latency jobs")
    p.add_argument(
        "--batch", type=int, default=500, help="jobs per call in tokenyard's batched row"
    )
    p.add_argument("--tokens-per-job", type=int, default=16, help="max_tokens of the tokens row")
    p.add_argument("--systems", type=parse_systems, default=list(SYSTEMS), help=",".join(SYSTEMS))
    p.add_argument("--repeats", type=int, default=1, help="runs per system; medians reported")
    p.add_argument("--start-timeout-s", type=float, default=60.0, help="consumer start-up limit")
    p.add_argument("--profile", metavar="DIR", help="cProfile the tokenyard consumer processes")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SYSTEM.KEY=VALUE",
        help="override a consumer setting, e.g. celery.pool=threads (VALUE parsed as JSON)",
    )
    p.add_argument("--serve", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--settings-json", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--tables", default="", help=argparse.SUPPRESS)
    p.add_argument("--profile-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        SETTINGS[args.serve].update(json.loads(args.settings_json or "{}"))
        serve(args.serve, args.url, args.profile_out, args.tables)
        return 0
    sizes = (args.jobs, args.http_jobs, args.in_flight, args.latency_jobs, args.batch)
    if min(*sizes, args.repeats, args.tokens_per_job) < 1:
        p.error("sizes, --repeats and --tokens-per-job must be >= 1")
    for item in args.set:
        try:
            apply_override(item)
        except ValueError as exc:
            p.error(str(exc))
    for name in TOKENYARD:
        SETTINGS[name]["enqueue_many_batch"] = args.batch
    if args.profile:
        args.profile = str(Path(args.profile).resolve())
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    report = asyncio.run(run(args))
    print(json.dumps(report, indent=2), flush=True)
    if args.profile:
        for system in (*TOKENYARD, HTTP):
            path = Path(args.profile) / f"{system}.pstats"
            if path.exists():
                print(f"=== {system} ===\n{top_functions(path)}", file=sys.stderr)
    ours = [report["systems"][s] for s in args.systems if s in (*TOKENYARD, HTTP)]
    return 0 if all(r.get("all_done") and "error" not in r for r in ours) else 1


if __name__ == "__main__":
    sys.exit(main())
