"""A batch survives its gateway and a worker being killed for real (SIGKILL) mid-run, on
Valkey and on NATS."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import openai
import pytest
import redis
from redis.cluster import RedisCluster

from tests.conftest import kinds, session_urls
from tokenyard.broker.nats.names import Names
from tokenyard.broker.redis.connection import CLUSTER_SCHEME
from tokenyard.broker.redis.keys import Keys
from tokenyard.fleet.launch import Launcher, Processes, free_port, wait_ready

pytestmark = [pytest.mark.fault, pytest.mark.slow]

MODEL = "sim-batch"
N = 300


class Procs:
    """Real gateway and worker processes on one Valkey; everything is killed at the end."""

    def __init__(self, url: str, files_dir: Path, tables_url: str = "") -> None:
        self.url = url
        self.tables_url = tables_url  # RabbitMQ lanes' tables
        self.prefix = f"bf{uuid.uuid4().hex[:8]}"
        self.files_dir = files_dir
        self.processes = Processes(files_dir / "logs")
        self.launcher = Launcher(self.processes, url, self.prefix, tables_url)

    def gateway(self, port: int) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "TOKENYARD_GATEWAY_FILES_DIR": str(self.files_dir),
            "TOKENYARD_GATEWAY_BATCH_LEASE_S": "1.0",
            "TOKENYARD_GATEWAY_BATCH_MAX_IN_FLIGHT": "16",
        }
        proc = self.launcher.gateway(port, "--model", MODEL, "--engine", "sim", env=env)
        wait_ready(f"http://127.0.0.1:{port}/healthz", proc, timeout_s=30)
        return proc

    def worker(self) -> subprocess.Popen[bytes]:
        return self.launcher.worker(
            "--model", MODEL, "--engine", "sim", "--max-seqs", "4", "--lease-s", "1.0"
        )

    def stop_all(self) -> None:
        self.processes.stop(timeout_s=10, sig=signal.SIGKILL)


@pytest.fixture(params=kinds())
def procs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Procs]:
    url, tables = session_urls(request, request.param)
    pool = Procs(url, tmp_path, tables)
    try:
        yield pool
    finally:
        pool.stop_all()


def _rows() -> bytes:
    rows: list[dict[str, Any]] = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": f"p{i}", "max_tokens": 8, "ignore_eos": True},
        }
        for i in range(N)
    ]
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def test_gateway_and_worker_killed_mid_batch(procs: Procs) -> None:
    port = free_port()
    gateway = procs.gateway(port)
    doomed = procs.worker()
    procs.worker()
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    up = c.files.create(file=("in.jsonl", io.BytesIO(_rows())), purpose="batch")
    batch = c.batches.create(
        input_file_id=up.id, endpoint="/v1/completions", completion_window="24h"
    )
    give_up = time.monotonic() + 60
    while True:
        now = c.batches.retrieve(batch.id)
        assert now.request_counts is not None
        if now.request_counts.completed >= N // 5:
            break
        assert now.status in ("validating", "in_progress") and time.monotonic() < give_up
        time.sleep(0.05)
    assert now.request_counts.completed < N, "the batch finished before the kill"
    gateway.send_signal(signal.SIGKILL)
    doomed.send_signal(signal.SIGKILL)
    gateway.wait(10)
    doomed.wait(10)
    procs.worker()
    port = free_port()
    procs.gateway(port)
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    give_up = time.monotonic() + 90
    while (done := c.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < give_up, done
        time.sleep(0.1)
    assert done.status == "completed", done
    assert done.request_counts is not None
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (N, N, 0)
    out = [json.loads(x) for x in c.files.content(done.output_file_id or "").text.splitlines()]
    ids = [x["custom_id"] for x in out]
    assert sorted(ids) == sorted(f"c{i}" for i in range(N))  # each exactly once
    assert all(x["response"]["status_code"] == 200 for x in out)
    # one job per request: a resubmit after the restart found the same job
    assert len({x["response"]["request_id"] for x in out}) == N
    assert _job_records(procs) == N


def _job_records(procs: Procs) -> int:
    """How many job records the broker holds under the test's prefix."""
    if procs.url.startswith("nats://"):
        return asyncio.run(_nats_job_records(procs))
    url = procs.tables_url or procs.url
    client: redis.Redis | RedisCluster = (
        RedisCluster.from_url("redis://" + url.removeprefix(CLUSTER_SCHEME))  # every primary
        if url.startswith(CLUSTER_SCHEME)
        else redis.Redis.from_url(url)
    )
    pattern = Keys(procs.prefix).job_prefix(MODEL) + "*"
    try:
        return len(list(client.scan_iter(match=pattern, count=1000)))
    finally:
        client.close()


async def _nats_job_records(procs: Procs) -> int:
    nc = await nats.connect(procs.url)
    try:
        bucket = Names(procs.prefix).jobs_bucket
        info = await nc.jetstream().stream_info(f"KV_{bucket}", subjects_filter=f"$KV.{bucket}.j.*")
        return len(info.state.subjects or {})
    finally:
        await nc.close()
