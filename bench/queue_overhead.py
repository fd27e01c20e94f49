"""Queue overhead: one no-op job through tokenyard and through arq, taskiq, RQ, Celery, Dramatiq.

Every system runs on one private Valkey (AOF, appendfsync everysec), each in its own database,
flushed between systems; one consumer process per system, the producer in this process.
For each: throughput (enqueue N jobs as fast as the framework allows, time until all are done)
and enqueue→done latency of single jobs at light load. Prints one JSON document.

    python bench/queue_overhead.py --jobs 5000 [--systems tokenyard,arq,...] [--profile DIR]

Peers are a benchmark extra (`pip install -e .[bench-peers]`); a peer that is missing or fails
is reported with its error and the run goes on. A peer job marks itself done with one RPUSH of
its id onto a list; tokenyard's done is its terminal record and Finished event (complete.lua).
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import cProfile
import importlib
import io
import json
import logging
import os
import platform
import pstats
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

# Runnable from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis
import redis.asyncio as aioredis

from tokenyard.broker.embedded import EmbeddedServer
from tokenyard.broker.keys import new_job_id
from tokenyard.broker.redis import RedisBroker, wait_until_ready
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.engines.sim import SimEngine
from tokenyard.messages import (
    Finished,
    FinishReason,
    JobResult,
    JobSpec,
    JobStatus,
    Priority,
    SamplingParams,
)
from tokenyard.worker.run import run_worker

PEERS = ("arq", "taskiq", "rq", "celery", "dramatiq")
TOKENYARD = ("tokenyard", "tokenyard-broker")
SYSTEMS = (*TOKENYARD, *PEERS)
GOAL = 3.0  # tokenyard's target: at least this many times the best peer
MODEL = "noop"
DONE_KEY = "qo:done"  # peers RPUSH each finished job's id here
QUEUE = "qo"
PREFIX = "qo"
WARMUP_JOBS = 20
POLL_S = 0.002

# What each consumer process is given: the best reasonable settings for a no-op job on 2 cores.
SETTINGS: dict[str, dict[str, Any]] = {
    "tokenyard": {
        "consumer": "tokenyard.worker.Worker + SimEngine with every cost 0, one process",
        "max_seqs": 256,
        "max_tokens": 1,
        "claim_block_s": 0.5,
        "producer": "RedisBroker.enqueue_many, --batch jobs per call",
        "done": "terminal record + Finished event, written by complete.lua",
    },
    "tokenyard-broker": {
        "consumer": "RedisBroker.claim + complete_many loop, no worker or engine, one process",
        "slots": 256,
        "claim_block_s": 0.5,
        "producer": "RedisBroker.enqueue_many, --batch jobs per call",
        "done": "terminal record + Finished event, written by complete.lua",
    },
    "arq": {
        "consumer": "arq.worker.Worker, one process (asyncio)",
        "max_jobs": 100,
        "poll_delay_s": 0.005,
        "keep_result_s": 0,
        "note": "arq polls its queue; poll_delay lowered from the 0.5 s default",
        "producer": "ArqRedis.enqueue_job, 64 concurrent",
        "done": "job does RPUSH",
    },
    "taskiq": {
        "consumer": "taskiq receiver on taskiq_redis.RedisStreamBroker, one process (asyncio)",
        "max_async_tasks": 100,
        "xread_count": 100,
        "result_backend": None,
        "producer": "task.kiq, 64 concurrent",
        "done": "job does RPUSH",
    },
    "rq": {
        "consumer": "rq.SimpleWorker (no fork per job), one process",
        "result_ttl": 0,
        "enqueue_batch": 500,
        "producer": "Queue.enqueue_many, one pipeline per enqueue_batch jobs",
        "done": "job does RPUSH",
    },
    "celery": {
        "consumer": "celery worker, one process",
        "pool": "solo",
        "concurrency": 1,
        "prefetch_multiplier": 64,
        "flags": ["--without-gossip", "--without-mingle", "--without-heartbeat"],
        "result_backend": None,
        "producer": "app.send_task, one by one",
        "done": "job does RPUSH",
    },
    "dramatiq": {
        "consumer": "dramatiq.Worker, one process",
        "threads": 8,
        "prefetch": 64,
        "worker_timeout_ms": 10,
        "note": "idle polls back off up to worker_timeout (default 1000 ms); prefetch default 2x",
        "result_backend": None,
        "producer": "actor.send, one by one",
        "done": "job does RPUSH",
    },
}

DISTRIBUTIONS = {
    "tokenyard": ["tokenyard"],
    "tokenyard-broker": ["tokenyard"],
    "arq": ["arq"],
    "taskiq": ["taskiq", "taskiq-redis"],
    "rq": ["rq"],
    "celery": ["celery", "kombu"],
    "dramatiq": ["dramatiq"],
}


def peer(module: str) -> Any:
    """Import a peer's module; peers are an optional extra, untyped to this file."""
    return importlib.import_module(module)


def db_url(base: str, db: int) -> str:
    """The server's URL for database `db`."""
    return f"{base.rsplit('/', 1)[0]}/{db}"


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process (Linux /proc), else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- producers -----------------------------------------------------------------------------


class Producer(abc.ABC):
    """The benchmark's side of one system: enqueue jobs and observe them done."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.done_client = aioredis.Redis.from_url(url)

    async def open(self) -> None:
        """Connect; called once before any enqueue."""
        await self.done_client.ping()

    @abc.abstractmethod
    async def enqueue(self, ids: Sequence[str]) -> None:
        """Enqueue one no-op job per id, as fast as the framework allows."""

    async def wait_done(self, job_id: str, timeout_s: float) -> None:
        """Return once `job_id` is done; raise TimeoutError after `timeout_s`."""
        reply: Any = await self.done_client.blpop([DONE_KEY], timeout=timeout_s)
        if reply is None:
            raise TimeoutError(f"job {job_id} not done after {timeout_s} s")
        if reply[1] != job_id.encode():
            raise RuntimeError(f"waited for {job_id}, {reply[1]!r} finished")

    async def done_count(self) -> int:
        """How many jobs are done since the last reset."""
        return int(await self.done_client.llen(DONE_KEY))

    async def verify(self, ids: Sequence[str]) -> int:
        """How many of `ids` are observably done."""
        raw = await self.done_client.lrange(DONE_KEY, 0, -1)
        done = {x.decode() if isinstance(x, bytes) else x for x in raw}
        return len(done & set(ids))

    async def reset(self) -> None:
        """Forget done markers before the next phase."""
        await self.done_client.delete(DONE_KEY)

    async def close(self) -> None:
        await self.done_client.aclose()


async def gather_chunks(ids: Sequence[str], width: int, send: Callable[[str], Any]) -> None:
    """Await `send(id)` for every id with at most `width` in flight."""
    for i in range(0, len(ids), width):
        await asyncio.gather(*(send(j) for j in ids[i : i + width]))


def noop_spec(job_id: str) -> JobSpec:
    return JobSpec(
        id=job_id,
        model=MODEL,
        tenant="bench",
        prompt="x",
        sampling=SamplingParams(max_tokens=1, temperature=0.0),
    )


class TokenyardProducer(Producer):
    """enqueue_many; done = the lane is empty (complete.lua writes the record and XDELs at once)."""

    def __init__(self, url: str, batch: int) -> None:
        super().__init__(url)
        self.broker = RedisBroker(BrokerSettings(url=url, prefix=PREFIX, max_queue_depth=1_000_000))
        self.batch = batch
        self.lane = self.broker.keys.lane(MODEL, Priority.NORMAL)
        self.enqueued = 0
        self.job_ids: dict[str, str] = {}  # bench id -> tokenyard job id

    async def open(self) -> None:
        await wait_until_ready(self.broker)

    async def enqueue(self, ids: Sequence[str]) -> None:
        specs = []
        for i in ids:
            spec = noop_spec(new_job_id(MODEL))
            self.job_ids[i] = spec.id
            specs.append(spec)
        for k in range(0, len(specs), self.batch):
            await self.broker.enqueue_many(specs[k : k + self.batch])
        self.enqueued += len(specs)

    async def wait_done(self, job_id: str, timeout_s: float) -> None:
        give_up = time.monotonic() + timeout_s
        after = "0"
        while (left := give_up - time.monotonic()) > 0:
            events = await self.broker.read_events(self.job_ids[job_id], after, block_s=left)
            for event_id, event in events:
                after = event_id
                if isinstance(event, Finished):
                    return
        raise TimeoutError(f"job {job_id} not done after {timeout_s} s")

    async def done_count(self) -> int:
        return self.enqueued - int(await self.broker.redis.xlen(self.lane))

    async def verify(self, ids: Sequence[str]) -> int:
        pipe = self.broker.redis.pipeline(transaction=False)
        for i in ids:
            pipe.hget(self.broker.keys.job(self.job_ids[i]), "status")
        statuses = await pipe.execute()
        return sum(s == JobStatus.SUCCEEDED.value.encode() for s in statuses)

    async def reset(self) -> None:
        self.job_ids.clear()

    async def close(self) -> None:
        await self.broker.close()
        await super().close()


class ArqProducer(Producer):
    async def open(self) -> None:
        await super().open()
        settings = peer("arq.connections").RedisSettings.from_dsn(self.url)
        self.pool = await peer("arq").create_pool(settings)

    async def enqueue(self, ids: Sequence[str]) -> None:
        await gather_chunks(ids, 64, lambda i: self.pool.enqueue_job("qo_noop", i))

    async def close(self) -> None:
        await self.pool.aclose()
        await super().close()


class TaskiqProducer(Producer):
    async def open(self) -> None:
        await super().open()
        self.broker = peer("taskiq_redis").RedisStreamBroker(self.url, queue_name=QUEUE)
        self.task = self.broker.register_task(_taskiq_stub, task_name="qo_noop")
        await self.broker.startup()

    async def enqueue(self, ids: Sequence[str]) -> None:
        await gather_chunks(ids, 64, self.task.kiq)

    async def close(self) -> None:
        await self.broker.shutdown()
        await super().close()


async def _taskiq_stub(job_id: str) -> None:
    """The producer's handle on the worker's task; never runs here."""


class RqProducer(Producer):
    async def open(self) -> None:
        await super().open()
        self.client = redis.Redis.from_url(self.url)
        self.queue = peer("rq").Queue(QUEUE, connection=self.client)

    async def enqueue(self, ids: Sequence[str]) -> None:
        Queue = peer("rq").Queue
        batch, ttl = SETTINGS["rq"]["enqueue_batch"], SETTINGS["rq"]["result_ttl"]
        for k in range(0, len(ids), batch):
            with self.client.pipeline() as pipe:
                datas = [
                    Queue.prepare_data("queue_overhead.rq_noop", args=(i,), result_ttl=ttl)
                    for i in ids[k : k + batch]
                ]
                self.queue.enqueue_many(datas, pipeline=pipe)
                pipe.execute()

    async def close(self) -> None:
        self.client.close()
        await super().close()


class CeleryProducer(Producer):
    async def open(self) -> None:
        await super().open()
        self.app = celery_app(self.url)

    async def enqueue(self, ids: Sequence[str]) -> None:
        for i in ids:
            self.app.send_task("qo_noop", args=[i], ignore_result=True)

    async def close(self) -> None:
        self.app.close()
        await super().close()


class DramatiqProducer(Producer):
    async def open(self) -> None:
        await super().open()
        self.broker, self.actor = dramatiq_actor(self.url, _dramatiq_stub)

    async def enqueue(self, ids: Sequence[str]) -> None:
        for i in ids:
            self.actor.send(i)

    async def close(self) -> None:
        self.broker.close()
        await super().close()


def _dramatiq_stub(job_id: str) -> None:
    """The producer's handle on the worker's actor; never runs here."""


def make_producer(system: str, url: str, batch: int) -> Producer:
    if system in TOKENYARD:
        return TokenyardProducer(url, batch)
    kinds: dict[str, type[Producer]] = {
        "arq": ArqProducer,
        "taskiq": TaskiqProducer,
        "rq": RqProducer,
        "celery": CeleryProducer,
        "dramatiq": DramatiqProducer,
    }
    return kinds[system](url)


def celery_app(url: str) -> Any:
    """The Celery app both sides use: Redis broker, no result backend."""
    app = peer("celery").Celery("qo", broker=url)
    app.conf.update(
        task_ignore_result=True,
        task_default_queue=QUEUE,
        worker_prefetch_multiplier=SETTINGS["celery"]["prefetch_multiplier"],
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    return app


def dramatiq_actor(url: str, fn: Callable[[str], None]) -> tuple[Any, Any]:
    """A Redis broker and the no-op actor declared on it."""
    dramatiq = peer("dramatiq")
    broker = peer("dramatiq.brokers.redis").RedisBroker(url=url, namespace=PREFIX)
    dramatiq.set_broker(broker)
    actor = dramatiq.actor(fn, actor_name="qo_noop", queue_name=QUEUE, max_retries=0, broker=broker)
    return broker, actor


# -- consumers (run with --serve in their own process) -------------------------------------


def rq_noop(job_id: str) -> None:
    """RQ's job: imported by path in the worker process."""
    job = peer("rq").get_current_job()
    assert job is not None
    job.connection.rpush(DONE_KEY, job_id)


def _stop_on_sigterm() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def serve_tokenyard(url: str, profile: str | None) -> None:
    settings = SETTINGS["tokenyard"]

    async def main() -> None:
        broker = RedisBroker(BrokerSettings(url=url, prefix=PREFIX, max_queue_depth=1_000_000))
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
        await run_worker(broker, engine, worker_settings)

    _profiled(main, profile)


def serve_tokenyard_broker(url: str, profile: str | None) -> None:
    settings = SETTINGS["tokenyard-broker"]
    result = JobResult(
        status=JobStatus.SUCCEEDED, finish_reason=FinishReason.LENGTH, worker="bench"
    )

    async def main() -> None:
        broker = RedisBroker(BrokerSettings(url=url, prefix=PREFIX, max_queue_depth=1_000_000))
        await wait_until_ready(broker)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        consumer = f"bench:{os.getpid()}"
        while not stop.is_set():
            leases = await broker.claim(
                MODEL, consumer, settings["slots"], block_s=settings["claim_block_s"]
            )
            if leases:
                await broker.complete_many([(lease, result) for lease in leases])
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


def serve_arq(url: str) -> None:
    arq_worker = peer("arq.worker")
    settings = SETTINGS["arq"]

    async def qo_noop(ctx: dict[str, Any], job_id: str) -> None:
        await ctx["redis"].rpush(DONE_KEY, job_id)

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    worker = arq_worker.Worker(
        functions=[arq_worker.func(qo_noop, name="qo_noop")],
        redis_settings=peer("arq.connections").RedisSettings.from_dsn(url),
        max_jobs=settings["max_jobs"],
        poll_delay=settings["poll_delay_s"],
        keep_result=settings["keep_result_s"],
        log_results=False,
    )
    worker.run()


def serve_taskiq(url: str) -> None:
    settings = SETTINGS["taskiq"]
    broker = peer("taskiq_redis").RedisStreamBroker(
        url, queue_name=QUEUE, xread_count=settings["xread_count"]
    )
    client = aioredis.Redis.from_url(url)

    async def qo_noop(job_id: str) -> None:
        await client.rpush(DONE_KEY, job_id)

    broker.register_task(qo_noop, task_name="qo_noop")

    async def main() -> None:
        await broker.startup()
        await peer("taskiq.api").run_receiver_task(
            broker, max_async_tasks=settings["max_async_tasks"]
        )

    asyncio.run(main())


def serve_rq(url: str) -> None:
    rq = peer("rq")
    client = redis.Redis.from_url(url)
    worker = rq.SimpleWorker([rq.Queue(QUEUE, connection=client)], connection=client)
    worker.work(logging_level="WARNING")


def serve_celery(url: str) -> None:
    settings = SETTINGS["celery"]
    app = celery_app(url)
    client = redis.Redis.from_url(url)

    def qo_noop(job_id: str) -> None:
        client.rpush(DONE_KEY, job_id)

    app.task(name="qo_noop")(qo_noop)

    app.worker_main(
        [
            "worker",
            f"--pool={settings['pool']}",
            f"--concurrency={settings['concurrency']}",
            "--loglevel=WARNING",
            *settings["flags"],
        ]
    )


def serve_dramatiq(url: str) -> None:
    settings = SETTINGS["dramatiq"]
    # read once when dramatiq.worker is imported; its default is 2 x threads
    os.environ["dramatiq_queue_prefetch"] = str(settings["prefetch"])  # noqa: SIM112
    dramatiq = peer("dramatiq")
    client = redis.Redis.from_url(url)

    def qo_noop(job_id: str) -> None:
        client.rpush(DONE_KEY, job_id)

    broker, _ = dramatiq_actor(url, qo_noop)
    stop = _stop_on_sigterm()
    worker = dramatiq.Worker(
        broker, worker_threads=settings["threads"], worker_timeout=settings["worker_timeout_ms"]
    )
    worker.start()
    stop.wait()
    worker.stop()


def serve(system: str, url: str, profile: str | None) -> None:
    """Entry point of a consumer process."""
    logging.basicConfig(level=logging.WARNING)
    if system == "tokenyard":
        serve_tokenyard(url, profile)
    elif system == "tokenyard-broker":
        serve_tokenyard_broker(url, profile)
    else:
        {
            "arq": serve_arq,
            "taskiq": serve_taskiq,
            "rq": serve_rq,
            "celery": serve_celery,
            "dramatiq": serve_dramatiq,
        }[system](url)


# -- the measurement -----------------------------------------------------------------------


class ConsumerProcess:
    """One consumer process in its own session, its output in a log file."""

    def __init__(self, system: str, url: str, profile: str | None, log_dir: Path) -> None:
        self.log_path = log_dir / f"{system}.log"
        argv = [sys.executable, str(Path(__file__).resolve()), "--serve", system, "--url", url]
        argv += ["--settings-json", json.dumps(SETTINGS[system])]
        if profile:
            argv += ["--profile-out", profile]
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=Path(__file__).resolve().parent,
            )

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"consumer exited with code {self.proc.returncode}\n{self.log_tail()}"
            )

    def cpu_s(self) -> float | None:
        return process_cpu_s(self.proc.pid)

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the consumer's process group; SIGKILL it if it lingers."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class ServerProbe:
    """Server CPU and command counts, for per-job deltas."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def snapshot(self) -> tuple[float, int]:
        cpu: dict[str, Any] = self.client.info("cpu")
        stats: dict[str, dict[str, Any]] = self.client.info("commandstats")
        calls = sum(int(row["calls"]) for key, row in stats.items() if key != "cmdstat_info")
        return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), calls


async def wait_count(
    producer: Producer, consumer: ConsumerProcess, target: int, timeout_s: float
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
            consumer.check_alive()
        await asyncio.sleep(POLL_S)


async def measure(
    system: str,
    producer: Producer,
    consumer: ConsumerProcess,
    probe: ServerProbe,
    args: argparse.Namespace,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    await producer.open()

    # Warm-up: the consumer is up, scripts are loaded, groups exist.
    warm = [f"w{i}" for i in range(WARMUP_JOBS)]
    await producer.enqueue(warm)
    _, done, _ = await wait_count(producer, consumer, WARMUP_JOBS, args.start_timeout_s)
    if done < WARMUP_JOBS:
        consumer.check_alive()
        raise TimeoutError(f"warm-up: {done} of {WARMUP_JOBS} done\n{consumer.log_tail()}")
    await producer.reset()
    await asyncio.sleep(0.2)

    # Throughput: enqueue N as fast as possible, time until all are done.
    ids = [f"t{i}" for i in range(args.jobs)]
    before = done = await producer.done_count()
    cpu0, cpu_server0, calls0 = consumer.cpu_s(), *probe.snapshot()
    started = time.monotonic()
    await producer.enqueue(ids)
    enqueued = time.monotonic()
    timeout = max(120.0, args.jobs / 50)
    finished, done, polls = await wait_count(producer, consumer, before + args.jobs, timeout)
    cpu1, cpu_server1, calls1 = consumer.cpu_s(), *probe.snapshot()
    completed = await producer.verify(ids)
    wall = finished - started
    out.update(
        jobs_per_s=round(args.jobs / wall, 1) if completed == args.jobs else None,
        wall_s=round(wall, 3),
        enqueue_jobs_per_s=round(args.jobs / max(enqueued - started, 1e-9), 1),
        completed=completed,
        all_done=completed == args.jobs,
        worker_cpu_us_per_job=(
            round((cpu1 - cpu0) * 1e6 / args.jobs, 1)
            if cpu0 is not None and cpu1 is not None
            else None
        ),
        server_cpu_us_per_job=round((cpu_server1 - cpu_server0) * 1e6 / args.jobs, 1),
        # every command the server ran (inside scripts too) except this benchmark's polls
        server_commands_per_job=round((calls1 - calls0 - polls) / args.jobs, 2),
    )
    if completed != args.jobs:
        out["error"] = f"only {completed} of {args.jobs} jobs done after {wall:.1f} s"
        return out
    await producer.reset()
    await asyncio.sleep(0.2)

    # Latency at light load: one job at a time, a random pause of 0..2·gap between jobs.
    rng = random.Random(7)
    samples: list[float] = []
    for i in range(args.latency_jobs):
        job_id = f"l{i}"
        t0 = time.monotonic()
        await producer.enqueue([job_id])
        await producer.wait_done(job_id, 30.0)
        samples.append((time.monotonic() - t0) * 1000)
        await asyncio.sleep(rng.uniform(0, 2 * args.gap_ms) / 1000)
    out.update(
        latency_p50_ms=round(percentile(samples, 50), 3),
        latency_p99_ms=round(percentile(samples, 99), 3),
        latency_mean_ms=round(sum(samples) / len(samples), 3),
    )
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
    if args.profile and system in TOKENYARD:
        profile = f"{args.profile}/{system}.pstats"
    consumer = ConsumerProcess(system, url, profile, log_dir)
    producer: Producer | None = None
    try:
        producer = make_producer(system, url, args.batch)
        entry.update(await measure(system, producer, consumer, ServerProbe(admin), args))
    except Exception as exc:  # a peer that fails is reported, not fatal
        entry["error"] = f"{type(exc).__name__}: {exc}"
        tail = consumer.log_tail()
        if tail and tail not in entry["error"]:
            entry["consumer_log_tail"] = tail
    finally:
        if producer is not None:
            with contextlib.suppress(Exception):
                await producer.close()
        consumer.stop()
        admin.flushall()
        admin.close()
    return entry


def comparison(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """tokenyard rows against the best peer: >1 means tokenyard is better."""
    peers = {k: v for k, v in results.items() if k in PEERS and v.get("jobs_per_s")}
    out: dict[str, Any] = {"goal": GOAL}
    if not peers:
        out["note"] = "no peer finished; nothing to compare"
        return out
    best_tp = max(peers, key=lambda k: peers[k]["jobs_per_s"])
    best_p50 = min(peers, key=lambda k: peers[k]["latency_p50_ms"])
    best_p99 = min(peers, key=lambda k: peers[k]["latency_p99_ms"])
    out["best_peer"] = {
        "throughput": best_tp,
        "latency_p50": best_p50,
        "latency_p99": best_p99,
    }
    for name in TOKENYARD:
        row = results.get(name)
        if not row or not row.get("jobs_per_s"):
            continue
        tp = row["jobs_per_s"] / peers[best_tp]["jobs_per_s"]
        out[name] = {
            "throughput_ratio": round(tp, 2),
            "latency_p50_ratio": round(
                peers[best_p50]["latency_p50_ms"] / row["latency_p50_ms"], 2
            ),
            "latency_p99_ratio": round(
                peers[best_p99]["latency_p99_ms"] / row["latency_p99_ms"], 2
            ),
            "meets_goal_throughput": tp >= GOAL,
        }
    return out


def server_version(client: redis.Redis) -> str:
    info: dict[str, Any] = client.info("server")
    if "valkey_version" in info:
        return f"valkey {info['valkey_version']}"
    return f"redis {info['redis_version']}"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, dict[str, Any]] = {}
    report: dict[str, Any] = {
        "jobs": args.jobs,
        "latency_jobs": args.latency_jobs,
        "latency_gap_ms": args.gap_ms,
        "appendfsync": "everysec",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "redis_py": redis.__version__,
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
                row = await run_system(system, server.url, db, args, Path(tmp))
                runs[system].append(row)
                summary = {k: row.get(k) for k in ("jobs_per_s", "latency_p50_ms")}
                print(f"{tag}: {row.get('error') or summary}", file=sys.stderr, flush=True)
    for system, rows in runs.items():
        results[system] = combine(rows)
    report["repeats"] = args.repeats
    report["systems"] = results
    report["tokenyard_vs_best_peer"] = comparison(results)
    return report


MEASURES = (
    "jobs_per_s",
    "wall_s",
    "enqueue_jobs_per_s",
    "worker_cpu_us_per_job",
    "server_cpu_us_per_job",
    "server_commands_per_job",
    "latency_p50_ms",
    "latency_p99_ms",
    "latency_mean_ms",
)


def combine(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's row from its repeats: the median of each measure over the clean runs."""
    if len(rows) == 1:
        return rows[0]
    clean = [r for r in rows if "error" not in r]
    out: dict[str, Any] = {"settings": rows[0]["settings"], "versions": rows[0]["versions"]}
    errors = [r["error"] for r in rows if "error" in r]
    if not clean:
        out["error"] = errors[0]
        out["errors"] = errors
        return out
    for key in MEASURES:
        values = [r[key] for r in clean if r.get(key) is not None]
        out[key] = round(statistics.median(values), 3) if values else None
    out["completed"] = min(r["completed"] for r in clean)
    out["all_done"] = all(r.get("all_done") for r in rows)
    out["runs"] = [{k: r.get(k) for k in ("jobs_per_s", "latency_p50_ms")} for r in clean]
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
    p.add_argument("--jobs", type=int, default=5000, help="jobs in the throughput phase")
    p.add_argument("--latency-jobs", type=int, default=200, help="jobs in the latency phase")
    p.add_argument("--gap-ms", type=float, default=5.0, help="mean pause between latency jobs")
    p.add_argument("--batch", type=int, default=500, help="jobs per tokenyard enqueue_many")
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
    p.add_argument("--profile-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        SETTINGS[args.serve].update(json.loads(args.settings_json or "{}"))
        serve(args.serve, args.url, args.profile_out)
        return 0
    if min(args.jobs, args.latency_jobs, args.batch, args.repeats) < 1:
        p.error("--jobs, --latency-jobs, --batch and --repeats must be >= 1")
    for item in args.set:
        try:
            apply_override(item)
        except ValueError as exc:
            p.error(str(exc))
    for name in TOKENYARD:
        SETTINGS[name]["enqueue_batch"] = args.batch
    if args.profile:
        args.profile = str(Path(args.profile).resolve())
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    report = asyncio.run(run(args))
    print(json.dumps(report, indent=2), flush=True)
    if args.profile:
        for system in TOKENYARD:
            path = Path(args.profile) / f"{system}.pstats"
            if path.exists():
                print(f"=== {system} ===\n{top_functions(path)}", file=sys.stderr)
    tokenyard_rows = [report["systems"][s] for s in args.systems if s in TOKENYARD]
    return 0 if all(r.get("all_done") and "error" not in r for r in tokenyard_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
