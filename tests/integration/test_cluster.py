"""tokenyard unchanged on a 3-shard Valkey cluster: gateway and workers of three models, one per
shard, over `redis+cluster://`; every answer complete (the conformance suite runs there too)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid

import httpx
import pytest
from redis.crc import key_slot

from tests.servers import Cluster
from tokenyard.broker.redis.keys import Keys
from tokenyard.fleet.launch import Launcher, Processes, free_port, wait_ready
from tokenyard.fleet.launch import tokenyard_command as tokenyard

pytestmark = pytest.mark.slow


def models_on_shards(cluster: Cluster, prefix: str, shards: list[int]) -> list[str]:
    """Model names whose keys hash to each of `shards`, in order (found by trying names)."""
    keys = Keys(prefix)
    found: list[str] = []
    for shard in shards:
        n = 0
        while True:
            name = f"m{n}"
            slot = key_slot(keys.counters(name).encode())  # every key of a model: one slot
            if cluster.shard_of_slot(slot) == shard and name not in found:
                found.append(name)
                break
            n += 1
    return found


def test_gateway_and_workers_serve_three_models_across_three_shards(
    valkey_cluster: Cluster, procs: Processes
) -> None:
    prefix = f"c{uuid.uuid4().hex[:8]}"
    models = models_on_shards(valkey_cluster, prefix, [0, 1, 2])
    launcher = Launcher(procs, valkey_cluster.url, prefix)
    shared = launcher.broker_args
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")}
    launcher.gateway(port, "--engine", "sim", "--model", ",".join(models), env=env)
    for m in models:
        launcher.worker("--engine", "sim", "--model", m, "--max-seqs", "8", env=env)
    wait_ready(f"{base}/readyz", procs, timeout_s=120)

    async def ask(client: httpx.AsyncClient, i: int) -> None:
        model = models[i % 3]
        body = {"model": model, "prompt": f"q{i}", "max_tokens": 16, "stream": i % 2 == 0}
        if body["stream"]:
            async with client.stream("POST", "/v1/completions", json=body) as reply:
                assert reply.status_code == 200
                lines = [line async for line in reply.aiter_lines() if line.startswith("data:")]
            assert lines[-1] == "data: [DONE]"
        else:
            reply = await client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 16

    async def load() -> None:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            await asyncio.gather(*(ask(client, i) for i in range(60)))

    asyncio.run(load())
    status = subprocess.run(
        tokenyard("status", *shared), capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0, status.stderr
    for model in models:
        assert f"live workers of {model}" in status.stdout


def test_shard_layout_benchmark_smoke() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.cluster_shards", "--jobs", "60", "--consumers", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["one_shard"]["jobs"] == report["three_shards"]["jobs"] == 180
    assert len(set(report["three_shards"]["models"])) == 3
    assert report["speedup"] > 0
