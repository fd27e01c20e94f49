"""NATS JetStream vs Valkey, one run side by side: queue overhead and the HTTP path.

Every (broker, system) gets a fresh private server on a free TCP port (EmbeddedNats, the
embedded Valkey; both fsync about once a second). Queue systems, driven from this process as in
bench/queue_overhead.py (whose consumer processes and job specs it reuses):

  tokenyard-broker  queue.enqueue here; a consumer process running queue.claim + complete_many
                    (no worker, no engine), on each broker
  nats-py           plain nats-py on the same nats-server (bench/peers/nats_py.py): await
                    js.publish, pull fetch + msg.ack(); the loop a NATS user would write instead

  one_at_a_time  each enqueue awaited before the next, the consumer running meanwhile
  in_flight      --in-flight enqueues outstanding at once
  latency        enqueue -> done of single jobs at light load

`tokenyard-http` runs `tokenyard gateway` + a tokenyard worker (zero-cost sim engine) on each
broker and sends POST /v1/completions sync and streamed, one at a time and in flight.

Per job: server CPU, consumer CPU and messages: on NATS the server's in/out message counts
(/varz) and the producer's own client counters (messages it sent per enqueue: each JetStream
request is one round trip), the benchmark's depth polls taken out (they go through a client of
their own); on Valkey the server's socket reads (round trips) and commands. Prints one JSON.

    python -m bench.nats_vs_valkey [--broker nats|valkey|both] [--jobs 2000] [--http-requests 300]
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
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import redis

from bench.common import command_calls, loadavg, percentile, proc_cpu_s
from bench.peers import nats_py
from bench.peers.base import PREFIX, in_flight
from bench.queue_overhead import MODEL, NOT_WORK, SETTINGS, finished, noop_spec, succeeded
from tokenyard.broker import Backend, connect, new_job_id, wait_until_ready
from tokenyard.broker.nats.embedded import EmbeddedNats
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings
from tokenyard.fleet.launch import Launcher, Processes, free_port, wait_ready

BROKERS = ("valkey", "nats")
QUEUE_MODES = ("one_at_a_time", "in_flight")
HTTP_MODES = ("sync_one_at_a_time", "sync_in_flight", "stream_one_at_a_time", "stream_in_flight")
GOAL = 0.8  # tokenyard on NATS: at least this share of plain nats-py's rate on the same server
WARMUP = 20
POLL_S = 0.01  # the benchmark's depth polls: each is several stream-info requests on NATS


def ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def per(value: float, n: int, digits: int = 2) -> float:
    return round(value / max(n, 1), digits)


# -- servers ---------------------------------------------------------------------------------


@dataclass
class Snapshot:
    cpu_s: float
    counters: dict[str, int]  # NATS: in_msgs, out_msgs; Valkey: reads, commands


class Server(Protocol):
    url: str

    def snapshot(self) -> Snapshot: ...


class ValkeyServer:
    def __init__(self, server: EmbeddedServer) -> None:
        self.server = server
        self.url = server.url.rsplit("/", 1)[0] + "/1"
        self.admin = redis.Redis.from_url(self.url)

    def snapshot(self) -> Snapshot:
        stats: dict[str, Any] = self.admin.info("stats")
        calls = command_calls(self.admin)
        commands = sum(n for name, n in calls.items() if name not in NOT_WORK)
        reads = int(stats["total_reads_processed"])
        return Snapshot(proc_cpu_s(self.server.pid), {"reads": reads, "commands": commands})

    def version(self) -> str:
        info: dict[str, Any] = self.admin.info("server")
        return f"valkey {info.get('valkey_version', info['redis_version'])}"


class NatsServer:
    def __init__(self, server: EmbeddedNats) -> None:
        self.server = server
        self.url = server.url

    def varz(self) -> dict[str, Any]:
        assert self.server.monitor_url is not None
        with urllib.request.urlopen(f"{self.server.monitor_url}/varz", timeout=5) as reply:
            found: dict[str, Any] = json.load(reply)
        return found

    def snapshot(self) -> Snapshot:
        varz = self.varz()
        counters = {"in_msgs": int(varz["in_msgs"]), "out_msgs": int(varz["out_msgs"])}
        return Snapshot(proc_cpu_s(self.server.pid), counters)

    def version(self) -> str:
        return f"nats-server {self.varz()['version']}"


@contextlib.contextmanager
def server(broker: str) -> Iterator[ValkeyServer | NatsServer]:
    """A fresh private server of `broker` on a free TCP port, torn down after."""
    if broker == "valkey":
        with EmbeddedServer(appendfsync="everysec") as valkey:
            wrapped = ValkeyServer(valkey)
            try:
                yield wrapped
            finally:
                wrapped.admin.close()
    else:
        with EmbeddedNats(sync="everysec") as nats_server:
            yield NatsServer(nats_server)


# -- producers -------------------------------------------------------------------------------


def nats_stats(backend: Backend) -> dict[str, int] | None:
    """The NATS client counters under a NATS backend's queue (None on Valkey or unopened)."""
    conn = getattr(backend.queue, "conn", None)
    client = getattr(conn, "_nc", None)
    return None if client is None else nats_py.client_stats(client)


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

    def __init__(self, url: str) -> None:
        settings = BrokerSettings(url=url, prefix=PREFIX, max_queue_depth=1_000_000)
        self.broker = connect(settings)
        self.poller = connect(settings)
        self.enqueued = 0
        self.polls = 0
        self.job_ids: dict[str, str] = {}

    async def open(self) -> None:
        await wait_until_ready(self.broker)
        await wait_until_ready(self.poller)

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
        stats = nats_stats(self.broker)
        return None if stats is None else stats["out_msgs"]

    def poll_messages(self) -> tuple[int, int]:
        """(sent, received) by the poller on NATS; on Valkey (polls, 3 XLENs each)."""
        stats = nats_stats(self.poller)
        if stats is None:
            return self.polls, 3 * self.polls
        return stats["out_msgs"], stats["in_msgs"]

    async def close(self) -> None:
        await self.broker.close()
        await self.poller.close()


class NatsPyProducer(nats_py.NatsPyProducer):
    def poll_messages(self) -> tuple[int, int]:
        return 0, 0  # done ids are pushed to it


# -- consumer processes ----------------------------------------------------------------------


def start_consumer(system: str, url: str, log_dir: Path) -> tuple[Processes, str]:
    """The system's processes (consumer; for tokenyard-http a worker and a gateway) and the
    gateway's base URL ("" without one)."""
    processes = Processes(log_dir / system)
    base = ""
    if system == "nats-py":
        argv = [sys.executable, "-m", "bench.nats_vs_valkey", "--serve-nats-py", "--url", url]
    else:
        argv = [sys.executable, "-m", "bench.queue_overhead", "--serve", system, "--url", url]
        argv += ["--settings-json", json.dumps(SETTINGS[system])]
    processes.start("consumer", argv, new_session=True)
    if system == "tokenyard-http":
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        Launcher(processes, url, PREFIX).gateway(port, "--model", MODEL, "--engine", "sim")
    return processes, base


def cpu_s(processes: Processes) -> float:
    return sum(proc_cpu_s(pid) for pid in processes.pids().values())


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


def message_counts(
    broker: str,
    before: Snapshot,
    after: Snapshot,
    sent: tuple[int | None, int | None],
    polled: tuple[tuple[int, int], tuple[int, int]],
    n: int,
) -> dict[str, Any]:
    """Per job: the server's counters, the benchmark's polls taken out; on NATS also what the
    producer sent (one message per JetStream request) and the rest (the consumer's)."""
    d = {k: after.counters[k] - before.counters[k] for k in after.counters}
    (p_out0, p_in0), (p_out1, p_in1) = polled
    p_out, p_in = p_out1 - p_out0, p_in1 - p_in0
    if broker == "valkey":  # p_out: polls (one pipelined read each), p_in: their XLENs
        return {
            "server_round_trips_per_job": per(d["reads"] - p_out, n),
            "server_commands_per_job": per(d["commands"] - p_in, n),
        }
    row = {
        "server_in_msgs_per_job": per(d["in_msgs"] - p_out, n),
        "server_out_msgs_per_job": per(d["out_msgs"] - p_in, n),
    }
    if sent[0] is not None and sent[1] is not None:
        producer = sent[1] - sent[0]
        row["producer_msgs_per_job"] = per(producer, n)
        row["consumer_msgs_per_job"] = per(d["in_msgs"] - p_out - producer, n)
    return row


async def queue_phase(
    broker: str,
    producer: QueueProducer,
    srv: Server,
    processes: Processes,
    ids: Sequence[str],
    send: Callable[[], Awaitable[None]],
) -> dict[str, Any]:
    n = len(ids)
    base = await producer.done_count()
    polled0, sent0 = producer.poll_messages(), producer.messages_sent()
    cpu0, snap0 = cpu_s(processes), srv.snapshot()
    started = time.monotonic()
    await send()
    enqueued = time.monotonic()
    finished_at, _ = await wait_count(producer, processes, base + n, max(120.0, n / 20))
    cpu1, snap1 = cpu_s(processes), srv.snapshot()
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
        "server_cpu_us_per_job": round((snap1.cpu_s - snap0.cpu_s) * 1e6 / n, 1),
    }
    row.update(message_counts(broker, snap0, snap1, (sent0, sent1), (polled0, polled1), n))
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
    broker: str, system: str, srv: Server, args: argparse.Namespace, log_dir: Path
) -> dict[str, Any]:
    producer: QueueProducer = (
        NatsPyProducer(srv.url) if system == "nats-py" else TokenyardProducer(srv.url)
    )
    processes, _ = start_consumer(system, srv.url, log_dir)
    settings = nats_py.SETTINGS if system == "nats-py" else SETTINGS[system]
    out: dict[str, Any] = {"settings": settings}
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
            row = await queue_phase(broker, producer, srv, processes, ids, partial(send, ids))
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
    broker: str,
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

    cpu0, snap0 = cpu_s(processes), srv.snapshot()
    started = time.monotonic()
    await in_flight([str(i) for i in range(n)], width, one)
    wall = time.monotonic() - started
    cpu1, snap1 = cpu_s(processes), srv.snapshot()
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
    row["server_cpu_us_per_request"] = round((snap1.cpu_s - snap0.cpu_s) * 1e6 / n, 1)
    for key, value in message_counts(broker, snap0, snap1, (None, None), ((0, 0),) * 2, n).items():
        row[key.replace("_per_job", "_per_request")] = value
    return row


async def measure_http(
    broker: str, srv: Server, args: argparse.Namespace, log_dir: Path
) -> dict[str, Any]:
    processes, base = start_consumer("tokenyard-http", srv.url, log_dir)
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
            out[mode] = await http_phase(broker, srv, processes, call, args.http_requests, width)
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


def ratios(queue: dict[str, dict[str, Any]], http: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """> 1: the first named is faster."""
    out: dict[str, Any] = {}
    ty_nats = queue.get("nats", {}).get("tokenyard-broker", {})
    ty_valkey = queue.get("valkey", {}).get("tokenyard-broker", {})
    plain = queue.get("nats", {}).get("nats-py", {})
    if ty_nats and ty_valkey:
        out["tokenyard_nats_over_valkey"] = {m: ratio(rate(ty_nats, m), rate(ty_valkey, m))
                                             for m in QUEUE_MODES}  # fmt: skip
    if ty_nats and plain:
        cell: dict[str, Any] = {m: ratio(rate(ty_nats, m), rate(plain, m)) for m in QUEUE_MODES}
        lat_ty, lat_plain = ty_nats.get("latency"), plain.get("latency")
        if lat_ty and lat_plain:
            cell["latency_p50 (plain/tokenyard)"] = ratio(lat_plain["p50_ms"], lat_ty["p50_ms"])
        cell["goal"] = GOAL
        cell["met"] = all((cell[m] or 0) >= GOAL for m in QUEUE_MODES)
        out["tokenyard_nats_over_plain_nats_py"] = cell
    h_nats, h_valkey = http.get("nats", {}), http.get("valkey", {})
    if h_nats and h_valkey:
        out["http_nats_over_valkey"] = {
            m: ratio(rate(h_nats, m, "requests_per_s"), rate(h_valkey, m, "requests_per_s"))
            for m in HTTP_MODES
        }
    return out


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for dist in ("tokenyard", "nats-py", "redis", "aiohttp"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[dist] = metadata.version(dist)
    return found


async def run(args: argparse.Namespace) -> dict[str, Any]:
    brokers = BROKERS if args.broker == "both" else (args.broker,)
    report: dict[str, Any] = {
        "benchmark": "nats_vs_valkey",
        "config": {
            "brokers": list(brokers),
            "jobs": args.jobs,
            "in_flight": args.in_flight,
            "latency_jobs": args.latency_jobs,
            "http_requests": args.http_requests,
            "max_tokens": args.tokens,
            "fsync": "Valkey appendfsync everysec; JetStream sync_interval 1s",
        },
        "cpus": os.cpu_count(),
        "versions": versions(),
        "loadavg_before": loadavg(),
        "servers": {},
    }
    if args.note:
        report["note"] = args.note
    queue: dict[str, dict[str, Any]] = {}
    http: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="nats-vs-valkey-") as tmp:
        for broker in brokers:
            systems = ["tokenyard-broker", *(["nats-py"] if broker == "nats" else [])]
            queue[broker] = {}
            for system in systems:
                print(f"[nats_vs_valkey] {broker} {system} ...", file=sys.stderr, flush=True)
                with server(broker) as srv:
                    report["servers"][broker] = srv.version()
                    row = await measure_queue(broker, system, srv, args, Path(tmp) / broker)
                queue[broker][system] = row
            if args.http_requests:
                print(f"[nats_vs_valkey] {broker} tokenyard-http ...", file=sys.stderr, flush=True)
                with server(broker) as srv:
                    http[broker] = await measure_http(broker, srv, args, Path(tmp) / broker)
    report["loadavg_after"] = loadavg()
    report["queue"] = queue
    report["http"] = http
    report["ratios"] = ratios(queue, http)
    errors = [f"{b} {s}" for b, row in queue.items() for s, c in row.items() if "error" in c]
    errors += [f"{b} http" for b, c in http.items() if "error" in c]
    report["all_done"] = not errors
    if errors:
        report["errors"] = errors
    return report


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--broker", choices=(*BROKERS, "both"), default="both")
    p.add_argument("--jobs", type=int, default=2000, help="jobs per queue phase")
    p.add_argument("--in-flight", type=int, default=64, help="outstanding enqueues / requests")
    p.add_argument("--latency-jobs", type=int, default=100, help="single jobs, enqueue -> done")
    p.add_argument(
        "--http-requests", type=int, default=300, help="requests per HTTP phase; 0: none"
    )
    p.add_argument("--tokens", type=int, default=8, help="max_tokens of the HTTP requests")
    p.add_argument("--note", default="", help="free text copied into the report")
    p.add_argument("--serve-nats-py", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_nats_py:
        nats_py.serve(args.url, nats_py.SETTINGS)
        return 0
    if min(args.jobs, args.in_flight, args.latency_jobs, args.tokens) < 1:
        p.error("sizes must be >= 1")
    report = asyncio.run(run(args))
    print(json.dumps(report, indent=2), flush=True)
    return 0 if report["all_done"] else 1


if __name__ == "__main__":
    sys.exit(main())
