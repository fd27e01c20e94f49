"""The command line end to end: `serve` on one machine; `gateway` + `worker`s on one Valkey."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.servers import alive
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.fleet.launch import Launcher, Processes, free_port, wait_ready
from tokenyard.fleet.launch import tokenyard_command as tokenyard

pytestmark = pytest.mark.slow


def test_serve_starts_everything_and_stops_cleanly(tmp_path: Path, procs: Processes) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")}
    serve = procs.start(
        "serve",
        tokenyard("serve", "--engine", "sim", "--model", "tiny", "--port", str(port),
                  "--data-dir", str(tmp_path / "valkey")),
        env=env,
    )  # fmt: skip
    wait_ready(f"{base}/readyz", procs, timeout_s=120)

    submitted = subprocess.run(
        tokenyard("submit", "hello yard", "--url", base, "--max-tokens", "12"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    assert submitted.stdout.strip()

    assert (tmp_path / "valkey" / "appendonlydir").exists()  # the AOF is on
    serve.send_signal(signal.SIGINT)
    assert serve.wait(90) == 0


def start_line(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> str:
    """The first line of serve's output that names the engine."""
    assert proc.stdout is not None
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        ready, _, _ = select.select([proc.stdout], [], [], give_up - time.monotonic())
        line = proc.stdout.readline().decode() if ready else ""
        if " engine " in line:
            return line.strip()
        assert line or not ready, "serve ended without naming its engine"
    raise AssertionError("serve did not name its engine in time")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_serve_says_which_engine_runs_and_why(tmp_path: Path, procs: Processes) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")}
    env["COLUMNS"] = "400"  # one line however long the broker URL
    serve = procs.start(
        "serve",
        tokenyard("serve", "--workers", "auto", "--min", "0", "--port", str(free_port()),
                  "--data-dir", str(tmp_path / "valkey")),
        env=env,
        stdout=subprocess.PIPE,
    )  # fmt: skip
    # the default engine is auto (tests/unit/test_engine_auto.py: the decision)
    assert "engine hf (vllm not installed)" in start_line(serve)
    serve.send_signal(signal.SIGTERM)  # SIGINT would meet the gateway not yet serving
    assert serve.wait(60) == 0


def descendants(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            found |= {int(child), *descendants(int(child))}
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_serve_leaves_no_server_or_worker_behind(tmp_path: Path, procs: Processes) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")}
    serve = procs.start(
        "serve",
        tokenyard("serve", "--engine", "sim", "--model", "tiny", "--port", str(port),
                  "--workers", "2", "--data-dir", str(tmp_path / "valkey")),
        env=env,
    )  # fmt: skip
    wait_ready(f"http://127.0.0.1:{port}/readyz", procs, timeout_s=120)
    children = descendants(serve.pid)
    assert len(children) >= 3  # Valkey and two workers

    serve.kill()  # no shutdown runs: the kernel tells the children
    serve.wait(30)
    give_up = time.monotonic() + 60
    while (left := {pid for pid in children if alive(pid)}) and time.monotonic() < give_up:
        time.sleep(0.2)
    assert not left, f"orphans left running: {sorted(left)}"


def test_distributed_gateway_and_two_workers_survive_a_killed_worker(
    valkey: EmbeddedServer, procs: Processes, tmp_path: Path
) -> None:
    launcher = Launcher(procs, valkey.url, f"d{uuid.uuid4().hex[:8]}")
    shared = launcher.broker_args
    env = {**os.environ, "TOKENYARD_BROKER_LEASE_S": "2"}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    launcher.gateway(port, "--engine", "sim", env=env)
    workers = [
        launcher.worker("--engine", "sim", "--max-seqs", "8", "--lease-s", "2", env=env)
        for _ in range(2)
    ]
    wait_ready(f"{base}/readyz", procs, timeout_s=120)

    async def ask(client: httpx.AsyncClient, i: int) -> str:
        reply = await client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": f"car {i}", "max_tokens": 40, "temperature": 0},
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 40
        return str(body["choices"][0]["text"])

    async def load() -> list[str]:
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            tasks = [asyncio.create_task(ask(client, i)) for i in range(100)]
            await asyncio.sleep(1.0)
            workers[0].send_signal(signal.SIGKILL)  # midway: its jobs must be redelivered
            return await asyncio.gather(*tasks)

    answers = asyncio.run(load())
    assert len(answers) == 100 and all(answers)
    status = subprocess.run(
        tokenyard("status", *shared), capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0, status.stderr
    assert "live workers of tiny" in status.stdout

    # the load generator against tokenyard itself, streaming through the same stack
    report_path = tmp_path / "report.json"
    bench = subprocess.run(
        tokenyard("bench", "--base-url", f"{base}/v1", "--model", "tiny", "--concurrency", "4",
                  "--requests", "12", "--output-len", "8", "--prompt-len", "4", "--ignore-eos",
                  "--quiet", "--output", str(report_path)),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    [level] = json.loads(report_path.read_text())["levels"]
    assert level["requests"] == {"sent": 12, "completed": 12, "failed": 0}
    assert level["tokens"]["output"] == 12 * 8
    assert 0 < level["ttft_ms"]["p50"] <= level["e2e_ms"]["p50"]
