"""A 3-node NATS JetStream cluster across hosts: each nats-server in its own Linux network
namespace, streams and KV buckets with 3 replicas, two `tokenyard worker --engine sim` hosts
and this process as the client. Under load, three times, the node that leads one of the
backend's streams dies (every process in its namespace, SIGKILL): the job records' (KV), then
the lane's, then the events'; each comes back on its store before the next kill, so two of
three always hold a quorum. The run still finishes with every accepted job answered once,
token for token."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import TypeVar, cast

import nats.errors
import pytest

from tests.faults.test_netns_hosts import Hosts
from tests.faults.test_netns_hosts import hosts as hosts  # the fixture
from tokenyard.broker import Backend, connect, new_job_id
from tokenyard.broker.nats.connection import NatsConnection
from tokenyard.broker.nats.names import Names
from tokenyard.config import BrokerSettings
from tokenyard.errors import BrokerUnavailable
from tokenyard.messages import (
    Finished,
    JobRecord,
    JobSpec,
    JobStatus,
    Priority,
    SamplingParams,
    TokenChunk,
)

pytestmark = [pytest.mark.slow, pytest.mark.fault]

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny"
JOBS = 300
TOKENS = 24
_T = TypeVar("_T")


async def retried(call: Callable[[], Awaitable[_T]], within_s: float = 60.0) -> _T:
    """What a client does with a 503: try again, the same request, until it goes through."""
    give_up = time.monotonic() + within_s
    while True:
        try:
            return await call()
        except BrokerUnavailable:
            if time.monotonic() > give_up:
                raise
            await asyncio.sleep(0.2)


async def leader(conn: NatsConnection, stream: str, within_s: float = 30.0) -> str:
    """The server name of `stream`'s leader, from JetStream's stream info (`cluster.leader`);
    asked again while an election is on, and while the API does not answer (a node that just
    came back, on a loaded box, can leave a stream info unanswered past its 5 s)."""
    give_up = time.monotonic() + within_s
    while True:
        try:
            info = await (await conn.js()).stream_info(stream)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            assert time.monotonic() < give_up, f"{stream}: no answer to stream info"
            continue
        if info.cluster is not None and info.cluster.leader:
            return info.cluster.leader
        assert time.monotonic() < give_up, f"{stream}: no leader"
        await asyncio.sleep(0.2)


def wait_for_line(log: Path, word: str, within_s: float) -> None:
    give_up = time.monotonic() + within_s
    while not (log.exists() and any(line.startswith(word) for line in log.read_text().split("\n"))):
        assert time.monotonic() < give_up, f"{log.name}: no {word!r} line\n{log.read_text()}"
        time.sleep(0.1)


async def test_a_nats_node_dies_under_load_and_nothing_is_lost_or_doubled(
    hosts: Hosts, tmp_path: Path
) -> None:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")}
    env["PYTHONPATH"] = path
    py = [sys.executable, "-m"]
    nodes = [hosts.add(f"n{i}") for i in range(3)]

    def start_node(i: int, run: int) -> Path:
        """Node i in its namespace, on its store (kept across a kill); its log."""
        ns, addr = nodes[i]
        routes = [f"nats-route://{a}:6222" for j, (_, a) in enumerate(nodes) if j != i]
        store = tmp_path / f"n{i}"
        store.mkdir(exist_ok=True)
        log = tmp_path / f"n{i}.{run}.log"
        hosts.run(
            ns, [*py, "tests.faults.nats_node", "--dir", str(store), "--host", addr,
                 "--name", f"n{i}", *(arg for r in routes for arg in ("--route", r))],
            log, env,
        )  # fmt: skip
        return log

    for log in [start_node(i, 0) for i in range(3)]:
        wait_for_line(log, "ready", within_s=120)
    url = "nats://" + ",".join(f"{addr}:4222" for _, addr in nodes) + "?replicas=3"
    prefix = f"c{os.getpid()}"
    env |= {
        "TOKENYARD_BROKER_URL": url,
        "TOKENYARD_BROKER_PREFIX": prefix,
        "TOKENYARD_BROKER_LEASE_S": "2",
    }
    workers = []
    for i in range(2):
        ns, _ = hosts.add(f"wk{i}")
        hosts.run(
            ns, [*py, "tokenyard", "worker", "--model", MODEL, "--engine", "sim",
                 "--max-seqs", "16", "--lease-s", "2"],
            tmp_path / f"worker{i}.log", env,
        )  # fmt: skip
        workers.append(ns)

    broker = connect(BrokerSettings(url=url, prefix=prefix, lease_s=2.0))
    try:
        await run_load(broker, hosts, nodes, workers, tmp_path, start_node)
    finally:
        await broker.close()


async def run_load(
    broker: Backend,
    hosts: Hosts,
    nodes: list[tuple[str, str]],
    workers: list[str],
    logs: Path,
    start_node: Callable[[int, int], Path],
) -> None:
    give_up = time.monotonic() + 120
    while len(await retried(lambda: broker.registry.workers(MODEL))) < 2:
        assert time.monotonic() < give_up, "workers never registered:\n" + (
            (logs / "worker0.log").read_text()
        )
        await asyncio.sleep(0.2)

    jobs = [
        JobSpec(
            id=new_job_id(MODEL),
            model=MODEL,
            prompt=f"cluster job {i} on lane {i % 5}",
            sampling=SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True),
        )
        for i in range(JOBS)
    ]
    accepted: list[str] = []
    unavailable = 0

    async def produce(batches: list[JobSpec]) -> None:
        nonlocal unavailable
        for start in range(0, len(batches), 10):
            batch = batches[start : start + 10]
            while True:
                try:
                    results = await broker.queue.enqueue_many(batch)
                    break
                except BrokerUnavailable:
                    unavailable += 1
                    await asyncio.sleep(0.2)
            accepted.extend(r.job_id for r in results)
            await asyncio.sleep(0.05)

    names = Names(broker.settings.prefix)
    streams = {
        "records": Names.kv_stream(names.jobs_bucket),
        "lane": names.lane_stream(MODEL, Priority.NORMAL, 0),
        "events": names.events.stream,
    }
    conn = cast(NatsConnection, broker.connection)
    third = JOBS // len(streams)
    killed: dict[str, str] = {}
    for k, (what, stream) in enumerate(streams.items()):
        # a third of the jobs each round; the kill lands while they are being enqueued and run
        phase = jobs[k * third : JOBS if k == len(streams) - 1 else (k + 1) * third]
        producer = asyncio.create_task(produce(phase))
        while len(accepted) < k * third + len(phase) // 2:
            await asyncio.sleep(0.02)
        # the node that leads this stream: its death forces that stream's leader election
        victim = int((await leader(conn, stream)).removeprefix("n"))
        killed[what] = nodes[victim][0]
        assert hosts.kill_host(nodes[victim][0]) >= 1
        await asyncio.wait_for(producer, 120)
        # back on its store, caught up (healthy) before the next kill takes another node
        log = await asyncio.to_thread(start_node, victim, k + 1)
        await asyncio.to_thread(wait_for_line, log, "ready", 120)

    assert sorted(accepted) == sorted(j.id for j in jobs)
    give_up = time.monotonic() + 240
    records: list[JobRecord | None] = []
    while True:
        records = await retried(lambda: broker.queue.records(accepted))
        if all(r is not None and r.status.terminal for r in records):
            break
        if time.monotonic() > give_up:
            stuck = [
                (j, r.status if r else None)
                for j, r in zip(accepted, records, strict=True)
                if r is None or not r.status.terminal
            ]
            pytest.fail(f"{len(stuck)} jobs never ended, e.g. {stuck[:5]}")
        await asyncio.sleep(0.5)

    odd = [
        (j, r.status, r.result and (r.result.finish_reason, r.result.worker, r.result.error))
        for j, r in zip(accepted, records, strict=True)
        if r is not None and r.status is not JobStatus.SUCCEEDED
    ]
    assert not odd, f"{len(odd)} jobs did not succeed: {odd[:5]}"
    for job_id, record in zip(accepted, records, strict=True):
        assert record is not None and record.result is not None
        events = [
            e for _, e in await retried(partial(broker.queue.read_events, job_id, count=10_000))
        ]
        streamed = "".join(e.text for e in events if isinstance(e, TokenChunk))
        assert sum(isinstance(e, Finished) for e in events) == 1, job_id
        assert len(record.result.text) == TOKENS, job_id  # nothing lost, no token twice
        assert streamed == record.result.text, job_id
    for ns, _ in nodes:
        assert hosts.pids(ns), f"{ns} is up again"
    for ns in workers:
        assert hosts.pids(ns), f"worker host {ns} is still up"
    print(
        f"killed the leaders {killed}; {unavailable} enqueue batches met BrokerUnavailable and "
        "were resent"
    )
