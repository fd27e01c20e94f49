"""`tokenyard serve --workers auto`: the supervisor scales worker processes up under load and
drains them back down, and no accepted request is lost on the way."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.fleet.launch import Processes, free_port, wait_ready
from tokenyard.fleet.launch import tokenyard_command as tokenyard

pytestmark = pytest.mark.slow

FAST = {
    # the policy on a short clock, so the whole cycle fits in a test
    "TOKENYARD_AUTOSCALE_TICK_S": "0.25",
    "TOKENYARD_AUTOSCALE_SLO_QUEUE_S": "1",
    "TOKENYARD_AUTOSCALE_UP_COOLDOWN_S": "1",
    "TOKENYARD_AUTOSCALE_DOWN_COOLDOWN_S": "1.5",
    "TOKENYARD_AUTOSCALE_DOWN_WINDOW_S": "1.5",
    "TOKENYARD_AUTOSCALE_RATE_HALFLIFE_S": "1",
    "TOKENYARD_AUTOSCALE_DEFAULT_SERVICE_RATE": "2",
    "TOKENYARD_WORKER_HEARTBEAT_S": "0.3",
    "TOKENYARD_WORKER_CLAIM_AHEAD": "1",
}


def gauge(text: str, name: str) -> float:
    match = re.search(rf'^{name}\{{model="tiny"\}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else -1.0


def test_serve_auto_scales_up_under_load_and_back_down_losing_nothing(
    tmp_path: Path, procs: Processes
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")} | FAST
    serve = procs.start(
        "serve",
        tokenyard("serve", "--engine", "sim", "--model", "tiny", "--port", str(port),
                  "--workers", "auto", "--min", "1", "--max", "3", "--max-seqs", "2",
                  "--data-dir", str(tmp_path / "valkey")),
        env=env,
    )  # fmt: skip
    wait_ready(f"{base}/readyz", procs, timeout_s=120)
    seen: list[tuple[float, float, float]] = []  # (live workers, desired, current)

    async def watch(client: httpx.AsyncClient, until: asyncio.Event) -> None:
        while not until.is_set():
            text = (await client.get("/metrics")).text
            seen.append(
                (
                    gauge(text, "tokenyard_live_workers"),
                    gauge(text, "tokenyard_desired_workers"),
                    gauge(text, "tokenyard_autoscale_current_workers"),
                )
            )
            await asyncio.sleep(0.2)

    async def ask(client: httpx.AsyncClient, i: int) -> str:
        reply = await client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": f"job {i}", "max_tokens": 60, "temperature": 0},
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["usage"]["completion_tokens"] == 60
        return str(body["choices"][0]["text"])

    async def load() -> list[str]:
        done = asyncio.Event()
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            watcher = asyncio.create_task(watch(client, done))
            # a burst: 2 slots per worker, ~0.7 s a job, far more than one worker keeps up with
            burst = [asyncio.create_task(ask(client, i)) for i in range(48)]
            answers = await asyncio.gather(*burst)
            # then a trickle one worker serves while the others drain around it
            give_up = time.monotonic() + 60
            trickle = []
            while time.monotonic() < give_up:
                trickle.append(asyncio.create_task(ask(client, 1000 + len(trickle))))
                await asyncio.sleep(0.5)
                if seen and seen[-1][0] == 1 and len(trickle) >= 6:
                    break
            answers += await asyncio.gather(*trickle)
            done.set()
            await watcher
            return answers

    answers = asyncio.run(load())
    assert len(answers) >= 54 and all(answers)  # every accepted request answered in full
    live = [w for w, _, _ in seen]
    assert max(live) >= 2, seen  # it scaled up under the burst ...
    assert live[-1] == 1, seen  # ... and drained back to the warm pool afterwards
    assert max(d for _, d, _ in seen) >= 2
    serve.send_signal(signal.SIGINT)
    assert serve.wait(90) == 0


def test_autoscale_exports_the_gauges_and_worker_ready_probes_the_heartbeat(
    valkey: EmbeddedServer, procs: Processes
) -> None:
    shared = ["--broker", valkey.url, "--prefix", f"x{uuid.uuid4().hex[:8]}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")} | FAST

    def ready() -> int:
        probe = subprocess.run(tokenyard("worker-ready", *shared), env=env, timeout=60)
        return probe.returncode

    assert ready() == 1  # no worker yet
    port = free_port()
    exporter = procs.start(
        "autoscale",
        tokenyard("autoscale", *shared, "--model", "tiny", "--min", "2", "--max", "5",
                  "--host", "127.0.0.1", "--port", str(port)),
        env=env,
    )  # fmt: skip
    procs.start(
        "worker", tokenyard("worker", *shared, "--engine", "sim", "--max-seqs", "2"), env=env
    )
    give_up = time.monotonic() + 60
    while ready() != 0:
        assert time.monotonic() < give_up, "the worker never showed as ready"
        time.sleep(0.3)
    while True:
        with contextlib.suppress(httpx.TransportError):
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            if gauge(text, "tokenyard_autoscale_current_workers") == 1:
                break
        assert time.monotonic() < give_up, "the exporter never saw the worker"
        time.sleep(0.3)
    assert gauge(text, "tokenyard_desired_workers") == 2  # the warm pool: --min 2
    assert gauge(text, "tokenyard_autoscale_service_rate") > 0
    exporter.send_signal(signal.SIGTERM)
    assert exporter.wait(30) == 0
