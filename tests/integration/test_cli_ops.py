"""`tokenyard dlq list|requeue` and `tokenyard drain WORKER` through subprocess, on Valkey:
exit codes, output, and their effects on the broker and on a running worker."""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid
from collections.abc import AsyncIterator

import pytest

from tokenyard.broker import Backend, connect, new_job_id
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.engines.sim import SimEngine
from tokenyard.fleet.launch import tokenyard_command as tokenyard
from tokenyard.messages import JobSpec, JobStatus
from tokenyard.worker.worker import Worker

pytestmark = pytest.mark.slow
MODEL = "ops-model"


@pytest.fixture
async def broker(valkey: EmbeddedServer) -> AsyncIterator[Backend]:
    backend = connect(BrokerSettings(url=valkey.url, prefix=f"ops{uuid.uuid4().hex[:8]}"))
    try:
        yield backend
    finally:
        await backend.close()


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")}


async def cli(broker: Backend, *args: str) -> subprocess.CompletedProcess[str]:
    where = ("--broker", broker.settings.url, "--prefix", broker.settings.prefix)
    proc = await asyncio.create_subprocess_exec(
        *tokenyard(*args, *where),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env(),
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    done = subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())
    assert "Traceback" not in done.stderr, done.stderr
    return done


async def dead_job(broker: Backend, prompt: str) -> str:
    spec = JobSpec(id=new_job_id(MODEL), model=MODEL, tenant="acme", prompt=prompt)
    await broker.queue.enqueue(spec)
    [lease] = await broker.queue.claim(MODEL, "w-test", slots=1)
    assert await broker.queue.dead_letter(lease, "poison_pill", "tokenizer exploded")
    return spec.id


async def test_dlq_lists_dead_letters_and_requeues_them_once(broker: Backend) -> None:
    job = await dead_job(broker, "poison")
    first = await cli(broker, "dlq", "requeue", job)
    assert first.returncode == 0, first.stderr
    old, arrow, new = first.stdout.split()
    assert (old, arrow) == (job, "->") and new != job
    record = await broker.queue.record(new)
    assert record is not None and record.status is JobStatus.QUEUED
    assert record.spec.prompt == "poison" and record.spec.tenant == "acme"
    unknown = new_job_id(MODEL)
    again, listed = await asyncio.gather(
        cli(broker, "dlq", "requeue", job, unknown, new),
        cli(broker, "dlq", "list", "--model", MODEL),
    )
    assert again.returncode == 1
    assert f"{job} -> {new} (requeued before)" in again.stdout
    assert f"no job {unknown}" in again.stderr and f"{new} is queued" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1  # one line, no traceback
    assert listed.returncode == 0
    head, *rows = [line.split("\t") for line in listed.stdout.splitlines()]
    assert head == ["job", "model", "reason", "deliveries", "at", "requeued_as", "error"]
    [row] = rows
    assert row[:4] == [job, MODEL, "poison_pill", "1"] and row[5:] == [new, "tokenizer exploded"]
    [lease] = await broker.queue.claim(MODEL, "w-test", slots=5)  # one new job, not two
    assert lease.spec.id == new


async def test_drain_stops_a_running_worker_by_its_name(broker: Backend) -> None:
    settings = WorkerSettings(model=MODEL, engine="sim", heartbeat_s=0.2, claim_block_s=0.2)
    worker_broker = connect(broker.settings)
    worker = Worker(worker_broker, SimEngine(), settings, consumer=f"ops-{uuid.uuid4().hex[:6]}")
    running = asyncio.create_task(worker.run())
    try:
        # while it starts: what a fresh broker answers
        nobody, empty = await asyncio.gather(
            cli(broker, "drain", "no-such-worker"), cli(broker, "dlq", "list")
        )
        assert nobody.returncode == 1
        assert nobody.stderr.strip() == "tokenyard: no live worker named 'no-such-worker'"
        assert empty.returncode == 0 and empty.stdout.strip() == "no dead letters"
        assert [w.consumer for w in await broker.registry.workers(MODEL)] == [worker.consumer]
        drained = await cli(broker, "drain", worker.consumer)
        assert drained.returncode == 0, drained.stderr
        assert drained.stdout.strip() == f"draining {worker.consumer} (model {MODEL})"
        # it reads the request at its next heartbeat, drains and returns (a process exits)
        await asyncio.wait_for(running, 20)
        assert await broker.registry.workers(MODEL) == []
    finally:
        worker.drain()
        await asyncio.wait_for(running, 20)
        await worker_broker.close()
