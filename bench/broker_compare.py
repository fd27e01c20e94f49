"""One broker against Valkey, side by side in one run: what every such benchmark shares.

A script (bench/nats_vs_valkey.py, bench/rabbitmq_vs_valkey.py) names its broker in a `Broker`:
how to start a fresh private server of it, and the plain client a user of that broker would
write instead of tokenyard (its producer here, its consumer in a process of its own). This
module runs the phases on Valkey and on the broker, times them, takes the CPU of every process
and server, counts what the servers saw, and puts the ratios side by side:

  queue         tokenyard-broker (queue.enqueue here; a consumer process running queue.claim +
                complete_many, no worker or engine) on each broker, and the plain client on the
                broker: one_at_a_time, in_flight (--in-flight outstanding), latency (enqueue ->
                done of single jobs at light load)
  http          `tokenyard gateway` + a tokenyard worker (zero-cost sim engine) on each broker:
                POST /v1/completions sync and streamed, one at a time and in flight
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import redis

from bench.common import command_calls, loadavg, percentile, proc_cpu_s
from bench.peers.base import PREFIX, in_flight
from bench.queue_overhead import MODEL, NOT_WORK, SETTINGS, finished, noop_spec, succeeded
from tokenyard.broker import connect, new_job_id, wait_until_ready
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings
from tokenyard.fleet.launch import Launcher, Processes, free_port, wait_ready

QUEUE_MODES = ("one_at_a_time", "in_flight")
HTTP_MODES = ("sync_one_at_a_time", "sync_in_flight", "stream_one_at_a_time", "stream_in_flight")
WARMUP = 20
POLL_S = 0.01  # the benchmark's depth polls (through a client of their own)


def ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def per(value: float, n: int, digits: int = 2) -> float:
    return round(value / max(n, 1), digits)


# -- servers ---------------------------------------------------------------------------------


@dataclass
class Snapshot:
    cpu_s: dict[str, float]  # "server" (the broker); "tables" (the Valkey beside amqp lanes)
    counters: dict[str, int]


class Server(Protocol):
    url: str
    tables_url: str  # "" but for a broker whose tables live on a Redis URL of their own

    def snapshot(self, before: bool) -> Snapshot:
        """`before`: at the start of a measured window (a costly probe goes first, its CPU
        outside the window); otherwise at the end (CPU first)."""
        ...

    def version(self) -> str: ...

    def valkey_commands(self) -> int | None:
        """Commands the Valkey that depth polls reach has run (None: polls reach no Valkey)."""
        ...

    def counts(
        self, d: dict[str, int], sent: int | None, polled: tuple[int, int], n: int
    ) -> dict[str, Any]:
        """Per job, from the counters' deltas `d`: the producer's `sent` messages (None where
        not known) and the benchmark's polls (`polled`: as its producer reports them) out."""
        ...


def valkey_counts(label: str, d: dict[str, int], polls: tuple[int, int], n: int) -> dict[str, Any]:
    """Round trips (socket reads) and commands per job, `polls` (reads, commands) taken out."""
    return {
        f"{label}_round_trips_per_job": per(d["reads"] - polls[0], n),
        f"{label}_commands_per_job": per(d["commands"] - polls[1], n),
    }


class ValkeyServer:
    """The embedded Valkey: tokenyard's lanes and tables, or the tables beside amqp lanes."""

    tables_url = ""

    def __init__(self, server: EmbeddedServer) -> None:
        self.server = server
        self.url = server.url.rsplit("/", 1)[0] + "/1"
        self.admin = redis.Redis.from_url(self.url)

    def counters(self) -> dict[str, int]:
        stats: dict[str, Any] = self.admin.info("stats")
        calls = command_calls(self.admin)
        commands = sum(n for name, n in calls.items() if name not in NOT_WORK)
        return {"reads": int(stats["total_reads_processed"]), "commands": commands}

    def cpu_s(self) -> float:
        return proc_cpu_s(self.server.pid)

    def snapshot(self, before: bool) -> Snapshot:
        return Snapshot({"server": self.cpu_s()}, self.counters())

    def valkey_commands(self) -> int | None:
        return self.counters()["commands"]

    def version(self) -> str:
        info: dict[str, Any] = self.admin.info("server")
        return f"valkey {info.get('valkey_version', info['redis_version'])}"

    def counts(
        self, d: dict[str, int], sent: int | None, polled: tuple[int, int], n: int
    ) -> dict[str, Any]:
        return valkey_counts("server", d, polled, n)

    def close(self) -> None:
        self.admin.close()


@contextlib.contextmanager
def valkey_server() -> Iterator[ValkeyServer]:
    """A fresh private Valkey (AOF everysec) on a free TCP port, torn down after."""
    with EmbeddedServer(appendfsync="everysec") as valkey:
        wrapped = ValkeyServer(valkey)
        try:
            yield wrapped
        finally:
            wrapped.close()


# -- producers -------------------------------------------------------------------------------


class QueueProducer(Protocol):
    async def open(self) -> None: ...
    async def enqueue(self, job_id: str) -> None: ...
    async def wait_done(self, job_id: str, timeout_s: float) -> None: ...
    async def done_count(self) -> int: ...
    async def verify(self, ids: Sequence[str]) -> int: ...
    async def reset(self) -> None: ...
    async def close(self) -> None: ...
    def messages_sent(self) -> int | None: ...
    def poll_messages(self) -> tuple[int, int]: ...


class TokenyardProducer:
    """queue.enqueue; done = gone from the lanes (depth), polled through a second backend so
    its requests can be told from the producer's."""

    def __init__(self, srv: Server) -> None:
        settings = BrokerSettings(
            url=srv.url, tables_url=srv.tables_url, prefix=PREFIX, max_queue_depth=1_000_000
        )
        self.broker = connect(settings)
        self.poller = connect(settings)
        self.srv = srv
        self.depth_commands = 0
        self.enqueued = 0
        self.polls = 0
        self.job_ids: dict[str, str] = {}

    async def open(self) -> None:
        await wait_until_ready(self.broker)
        await wait_until_ready(self.poller)
        await self.calibrate()

    async def calibrate(self) -> None:
        """Count the Valkey commands one depth poll sends, to take them out: the fewest of a few
        tries (the consumer may send some of its own meanwhile)."""
        seen: list[int] = []
        for _ in range(3):
            before = self.srv.valkey_commands()
            await self.poller.queue.depth(MODEL)
            after = self.srv.valkey_commands()
            if before is None or after is None:
                return
            seen.append(after - before)
        self.depth_commands = min(seen)

    async def enqueue(self, job_id: str) -> None:
        spec = noop_spec(new_job_id(MODEL))
        self.job_ids[job_id] = spec.id
        self.enqueued += 1
        await self.broker.queue.enqueue(spec)

    async def wait_done(self, job_id: str, timeout_s: float) -> None:
        await finished(self.broker, self.job_ids[job_id], timeout_s)

    async def done_count(self) -> int:
        self.polls += 1
        return self.enqueued - await self.poller.queue.depth(MODEL)

    async def verify(self, ids: Sequence[str]) -> int:
        return await succeeded(self.broker, [self.job_ids[i] for i in ids])

    async def reset(self) -> None:
        self.job_ids.clear()

    def messages_sent(self) -> int | None:
        return None

    def poll_messages(self) -> tuple[int, int]:
        """(round trips, commands) of the polls on Valkey: one pipeline each."""
        return self.polls, self.depth_commands * self.polls

    async def close(self) -> None:
        await self.broker.close()
        await self.poller.close()


@dataclass(frozen=True)
class Plain:
    """The plain client a user of the broker would write instead of tokenyard."""

    name: str  # its system name in the report, e.g. "nats-py"
    settings: dict[str, Any]
    producer: Callable[[Server], QueueProducer]
    consumer_argv: Callable[[Server], list[str]]  # its consumer process


@dataclass(frozen=True)
class Broker:
    """What a script names: its broker, the server it runs, the plain peer on it."""

    name: str  # "nats", "rabbitmq"
    benchmark: str  # the report's "benchmark" and the script's module under bench/
    server: Callable[[], contextlib.AbstractContextManager[Server]]
    plain: Plain
    fsync: str
    distributions: tuple[str, ...]  # reported versions
    goal: float | None = None  # tokenyard on the broker: at least this share of plain's rate
    producer: Callable[[Server], QueueProducer] = TokenyardProducer


# -- consumer processes ----------------------------------------------------------------------


def start_consumer(
    system: str, srv: Server, log_dir: Path, plain: Plain | None = None
) -> tuple[Processes, str]:
    """The system's processes (consumer; for tokenyard-http a worker and a gateway) and the
    gateway's base URL ("" without one)."""
    processes = Processes(log_dir / system)
    base = ""
    if plain is not None and system == plain.name:
        argv = plain.consumer_argv(srv)
    else:
        argv = [sys.executable, "-m", "bench.queue_overhead", "--serve", system, "--url", srv.url]
        argv += ["--settings-json", json.dumps(SETTINGS[system])]
        if srv.tables_url:
            argv += ["--tables", srv.tables_url]
    processes.start("consumer", argv, new_session=True)
    if system == "tokenyard-http":
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        launcher = Launcher(processes, srv.url, PREFIX, tables_url=srv.tables_url)
        launcher.gateway(port, "--model", MODEL, "--engine", "sim")
    return processes, base


def cpu_s(processes: Processes) -> float:
    return sum(proc_cpu_s(pid) for pid in processes.pids().values())


def cpu_rows(before: Snapshot, after: Snapshot, n: int, unit: str) -> dict[str, float]:
    return {
        f"{name}_cpu_us_per_{unit}": round((after.cpu_s[name] - before.cpu_s[name]) * 1e6 / n, 1)
        for name in after.cpu_s
    }


def deltas(before: Snapshot, after: Snapshot) -> dict[str, int]:
    return {k: after.counters[k] - before.counters[k] for k in after.counters}


# -- queue phases ----------------------------------------------------------------------------


async def wait_count(
    producer: QueueProducer, processes: Processes, target: int, timeout_s: float
) -> tuple[float, int]:
    give_up = time.monotonic() + timeout_s
    polls = 0
    while True:
        done = await producer.done_count()
        now = time.monotonic()
        if done >= target or now > give_up:
            return now, done
        polls += 1
        if polls % 100 == 0:
            processes.check()
        await asyncio.sleep(POLL_S)


async def queue_phase(
    producer: QueueProducer,
    srv: Server,
    processes: Processes,
    ids: Sequence[str],
    send: Callable[[], Awaitable[None]],
) -> dict[str, Any]:
    n = len(ids)
    base = await producer.done_count()
    snap0 = srv.snapshot(before=True)
    polled0, sent0 = producer.poll_messages(), producer.messages_sent()
    cpu0 = cpu_s(processes)
    started = time.monotonic()
    await send()
    enqueued = time.monotonic()
    finished_at, _ = await wait_count(producer, processes, base + n, max(120.0, n / 20))
    cpu1, snap1 = cpu_s(processes), srv.snapshot(before=False)
    polled1, sent1 = producer.poll_messages(), producer.messages_sent()
    completed = await producer.verify(ids)
    wall = finished_at - started
    row: dict[str, Any] = {
        "jobs_per_s": round(n / wall, 1) if completed == n else None,
        "enqueue_jobs_per_s": round(n / max(enqueued - started, 1e-9), 1),
        "wall_s": round(wall, 3),
        "completed": completed,
        "all_done": completed == n,
        "consumer_cpu_us_per_job": round((cpu1 - cpu0) * 1e6 / n, 1),
        **cpu_rows(snap0, snap1, n, "job"),
    }
    sent = None if sent0 is None or sent1 is None else sent1 - sent0
    polled = (polled1[0] - polled0[0], polled1[1] - polled0[1])
    row.update(srv.counts(deltas(snap0, snap1), sent, polled, n))
    if completed != n:
        row["error"] = f"only {completed} of {n} jobs done after {wall:.1f} s"
    return row


async def latency(run_one: Callable[[str], Awaitable[None]], jobs: int) -> dict[str, Any]:
    samples: list[float] = []
    for i in range(jobs):
        t0 = time.monotonic()
        await run_one(f"l{i}")
        samples.append((time.monotonic() - t0) * 1000)
        await asyncio.sleep(0.005)
    return {
        "p50_ms": ms(percentile(samples, 50)),
        "p99_ms": ms(percentile(samples, 99)),
        "mean_ms": ms(statistics.fmean(samples)),
    }


async def measure_queue(
    broker: Broker, system: str, srv: Server, args: argparse.Namespace, log_dir: Path
) -> dict[str, Any]:
    plain = broker.plain if system == broker.plain.name else None
    producer = plain.producer(srv) if plain is not None else broker.producer(srv)
    processes, _ = start_consumer(system, srv, log_dir, broker.plain)
    out: dict[str, Any] = {"settings": plain.settings if plain is not None else SETTINGS[system]}
    try:
        await producer.open()
        for i in range(WARMUP):
            await producer.enqueue(f"w{i}")
        _, done = await wait_count(producer, processes, WARMUP, 60.0)
        if done < WARMUP:
            raise TimeoutError(f"warm-up: {done} of {WARMUP}\n{processes.log_tail('consumer')}")
        await producer.reset()

        async def one_at_a_time(ids: Sequence[str]) -> None:
            for job_id in ids:
                await producer.enqueue(job_id)

        sends: dict[str, Callable[[Sequence[str]], Awaitable[None]]] = {
            "one_at_a_time": one_at_a_time,
            "in_flight": lambda ids: in_flight(ids, args.in_flight, producer.enqueue),
        }
        for mode, send in sends.items():
            ids = [f"{mode}:{i}" for i in range(args.jobs)]
            row = await queue_phase(producer, srv, processes, ids, partial(send, ids))
            out[mode] = row
            if "error" in row:
                out["error"] = f"{mode}: {row['error']}"
                return out
            await producer.reset()
            await asyncio.sleep(0.2)

        async def run_one(job_id: str) -> None:
            await producer.enqueue(job_id)
            await producer.wait_done(job_id, 30.0)

        out["latency"] = await latency(run_one, args.latency_jobs)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["log_tail"] = processes.log_tail("consumer")[-2000:]
    finally:
        with contextlib.suppress(Exception):
            await producer.close()
        processes.stop(timeout_s=15.0)
    return out


# -- HTTP ------------------------------------------------------------------------------------


class Client:
    """aiohttp, as in bench/queue_overhead.py: POST /v1/completions sync or streamed (SSE)."""

    def __init__(self, base: str, max_tokens: int) -> None:
        self.http = aiohttp.ClientSession(
            base,
            timeout=aiohttp.ClientTimeout(total=60.0),
            connector=aiohttp.TCPConnector(limit=0),
        )
        self.body = {
            "model": MODEL,
            "prompt": "x",
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        self.max_tokens = max_tokens

    async def sync(self) -> tuple[float, float | None]:
        t0 = time.monotonic()
        async with self.http.post("/v1/completions", json=self.body) as reply:
            if reply.status != 200:
                raise RuntimeError(f"/v1/completions: {reply.status} {await reply.text()}")
            tokens = int((await reply.json())["usage"]["completion_tokens"])
        if tokens != self.max_tokens:
            raise RuntimeError(f"{tokens} tokens, asked {self.max_tokens}")
        return time.monotonic() - t0, None

    async def stream(self) -> tuple[float, float | None]:
        t0 = time.monotonic()
        first: float | None = None
        done = False
        async with self.http.post("/v1/completions", json={**self.body, "stream": True}) as reply:
            if reply.status != 200:
                raise RuntimeError(f"/v1/completions: {reply.status} {await reply.text()}")
            async for line in reply.content:
                if not line.startswith(b"data:"):
                    continue
                if line[5:].strip() == b"[DONE]":
                    done = True
                elif first is None:
                    first = time.monotonic() - t0
        if not done:
            raise RuntimeError("stream ended without [DONE]")
        return time.monotonic() - t0, first

    async def close(self) -> None:
        await self.http.close()


async def http_phase(
    srv: Server,
    processes: Processes,
    call: Callable[[], Awaitable[tuple[float, float | None]]],
    n: int,
    width: int,
) -> dict[str, Any]:
    e2e: list[float] = []
    ttft: list[float] = []

    async def one(_: str) -> None:
        took, first = await call()
        e2e.append(took * 1000)
        if first is not None:
            ttft.append(first * 1000)

    snap0 = srv.snapshot(before=True)
    cpu0 = cpu_s(processes)
    started = time.monotonic()
    await in_flight([str(i) for i in range(n)], width, one)
    wall = time.monotonic() - started
    cpu1, snap1 = cpu_s(processes), srv.snapshot(before=False)
    row: dict[str, Any] = {
        "requests_per_s": round(n / wall, 1),
        "wall_s": round(wall, 3),
        "completed": len(e2e),
        "e2e_p50_ms": ms(percentile(e2e, 50)),
        "e2e_p99_ms": ms(percentile(e2e, 99)),
    }
    if ttft:
        row["ttft_p50_ms"] = ms(percentile(ttft, 50))
        row["ttft_p99_ms"] = ms(percentile(ttft, 99))
    row["gateway_worker_cpu_us_per_request"] = round((cpu1 - cpu0) * 1e6 / n, 1)
    row.update(cpu_rows(snap0, snap1, n, "request"))
    for key, value in srv.counts(deltas(snap0, snap1), None, (0, 0), n).items():
        row[key.replace("_per_job", "_per_request")] = value
    return row


async def measure_http(srv: Server, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    processes, base = start_consumer("tokenyard-http", srv, log_dir)
    settings = {k: v for k, v in SETTINGS["tokenyard-http"].items() if k != "max_tokens"}
    out: dict[str, Any] = {"settings": settings, "max_tokens": args.tokens}
    client = Client(base, args.tokens)
    try:
        await asyncio.to_thread(wait_ready, f"{base}/readyz", processes, timeout_s=60.0)
        for _ in range(WARMUP):
            await client.sync()
            await client.stream()
        plans = {
            "sync_one_at_a_time": (client.sync, 1),
            "sync_in_flight": (client.sync, args.in_flight),
            "stream_one_at_a_time": (client.stream, 1),
            "stream_in_flight": (client.stream, args.in_flight),
        }
        for mode, (call, width) in plans.items():
            out[mode] = await http_phase(srv, processes, call, args.http_requests, width)
            await asyncio.sleep(0.2)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["log_tail"] = "\n".join(processes.log_tail(p) for p in processes.procs)[-2000:]
    finally:
        await client.close()
        processes.stop(timeout_s=15.0)
    return out


# -- the run ---------------------------------------------------------------------------------


def rate(cell: dict[str, Any], mode: str, key: str = "jobs_per_s") -> float | None:
    value = cell.get(mode, {}).get(key)
    return float(value) if value else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def ratios(
    broker: Broker, queue: dict[str, dict[str, Any]], http: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """> 1: the first named is faster."""
    name, plain_name = broker.name, broker.plain.name
    out: dict[str, Any] = {}
    ty_broker = queue.get(name, {}).get("tokenyard-broker", {})
    ty_valkey = queue.get("valkey", {}).get("tokenyard-broker", {})
    plain = queue.get(name, {}).get(plain_name, {})
    if ty_broker and ty_valkey:
        out[f"tokenyard_{name}_over_valkey"] = {
            m: ratio(rate(ty_broker, m), rate(ty_valkey, m)) for m in QUEUE_MODES
        }
    if ty_broker and plain:
        cell: dict[str, Any] = {m: ratio(rate(ty_broker, m), rate(plain, m)) for m in QUEUE_MODES}
        lat_ty, lat_plain = ty_broker.get("latency"), plain.get("latency")
        if lat_ty and lat_plain:
            cell["latency_p50 (plain/tokenyard)"] = ratio(lat_plain["p50_ms"], lat_ty["p50_ms"])
        if broker.goal is not None:
            cell["goal"] = broker.goal
            cell["met"] = all((cell[m] or 0) >= broker.goal for m in QUEUE_MODES)
        out[f"tokenyard_{name}_over_plain_{plain_name.replace('-', '_')}"] = cell
    h_broker, h_valkey = http.get(name, {}), http.get("valkey", {})
    if h_broker and h_valkey:
        out[f"http_{name}_over_valkey"] = {
            m: ratio(rate(h_broker, m, "requests_per_s"), rate(h_valkey, m, "requests_per_s"))
            for m in HTTP_MODES
        }
    return out


def versions(distributions: Sequence[str]) -> dict[str, str]:
    found = {"python": platform.python_version()}
    for dist in ("tokenyard", *distributions, "redis", "aiohttp"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[dist] = metadata.version(dist)
    return found


async def run(broker: Broker, args: argparse.Namespace) -> dict[str, Any]:
    every = ("valkey", broker.name)
    brokers = every if args.broker == "both" else (args.broker,)
    servers: dict[str, Callable[[], contextlib.AbstractContextManager[Server]]] = {
        "valkey": valkey_server,
        broker.name: broker.server,
    }
    report: dict[str, Any] = {
        "benchmark": broker.benchmark,
        "config": {
            "brokers": list(brokers),
            "jobs": args.jobs,
            "in_flight": args.in_flight,
            "latency_jobs": args.latency_jobs,
            "http_requests": args.http_requests,
            "max_tokens": args.tokens,
            "fsync": broker.fsync,
        },
        "cpus": os.cpu_count(),
        "versions": versions(broker.distributions),
        "loadavg_before": loadavg(),
        "servers": {},
    }
    if args.note:
        report["note"] = args.note
    queue: dict[str, dict[str, Any]] = {}
    http: dict[str, dict[str, Any]] = {}
    tag = f"[{broker.benchmark}]"
    with tempfile.TemporaryDirectory(prefix=f"{broker.benchmark}-") as tmp:
        for name in brokers:
            systems = ["tokenyard-broker", *([broker.plain.name] if name == broker.name else [])]
            queue[name] = {}
            for system in systems:
                print(f"{tag} {name} {system} ...", file=sys.stderr, flush=True)
                with servers[name]() as srv:
                    report["servers"][name] = srv.version()
                    row = await measure_queue(broker, system, srv, args, Path(tmp) / name)
                queue[name][system] = row
            if args.http_requests:
                print(f"{tag} {name} tokenyard-http ...", file=sys.stderr, flush=True)
                with servers[name]() as srv:
                    http[name] = await measure_http(srv, args, Path(tmp) / name)
    report["loadavg_after"] = loadavg()
    report["queue"] = queue
    report["http"] = http
    report["ratios"] = ratios(broker, queue, http)
    errors = [f"{b} {s}" for b, row in queue.items() for s, c in row.items() if "error" in c]
    errors += [f"{b} http" for b, c in http.items() if "error" in c]
    report["all_done"] = not errors
    if errors:
        report["errors"] = errors
    return report


def parser(broker_name: str, doc: str | None) -> argparse.ArgumentParser:
    """The options every such script takes; a script adds its hidden consumer entry point."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--broker", choices=("valkey", broker_name, "both"), default="both")
    p.add_argument("--jobs", type=int, default=2000, help="jobs per queue phase")
    p.add_argument("--in-flight", type=int, default=64, help="outstanding enqueues / requests")
    p.add_argument("--latency-jobs", type=int, default=100, help="single jobs, enqueue -> done")
    p.add_argument(
        "--http-requests", type=int, default=300, help="requests per HTTP phase; 0: none"
    )
    p.add_argument("--tokens", type=int, default=8, help="max_tokens of the HTTP requests")
    p.add_argument("--note", default="", help="free text copied into the report")
    return p


def main(broker: Broker, p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run the benchmark; print its JSON; 0 when every cell finished."""
    if min(args.jobs, args.in_flight, args.latency_jobs, args.tokens) < 1:
        p.error("sizes must be >= 1")
    report = asyncio.run(run(broker, args))
    print(json.dumps(report, indent=2), flush=True)
    return 0 if report["all_done"] else 1
