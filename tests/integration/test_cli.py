"""The command line end to end: `serve` on one machine; `gateway` + `worker`s on one Valkey."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.servers import alive
from tokenyard.broker.redis.embedded import EmbeddedServer

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tokenyard(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenyard", *args]


def wait_ready(base: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        assert proc.poll() is None, "process exited before it was ready"
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{base} never became ready")


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def test_serve_starts_everything_and_stops_cleanly(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")}
    serve = subprocess.Popen(
        tokenyard("serve", "--engine", "sim", "--model", "tiny", "--port", str(port),
                  "--data-dir", str(tmp_path / "valkey")),
        env=env,
    )  # fmt: skip
    procs.append(serve)
    wait_ready(base, serve)

    submitted = subprocess.run(
        tokenyard("submit", "hello yard", "--url", base, "--max-tokens", "12"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    assert submitted.stdout.strip()

    assert (tmp_path / "valkey" / "appendonlydir").exists()  # the AOF is on
    serve.send_signal(signal.SIGINT)
    assert serve.wait(90) == 0


def descendants(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            found |= {int(child), *descendants(int(child))}
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_serve_leaves_no_server_or_worker_behind(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")}
    serve = subprocess.Popen(
        tokenyard("serve", "--engine", "sim", "--model", "tiny", "--port", str(port),
                  "--workers", "2", "--data-dir", str(tmp_path / "valkey")),
        env=env,
    )  # fmt: skip
    procs.append(serve)
    wait_ready(f"http://127.0.0.1:{port}", serve)
    children = descendants(serve.pid)
    assert len(children) >= 3  # Valkey and two workers

    serve.kill()  # no shutdown runs: the kernel tells the children
    serve.wait(30)
    give_up = time.monotonic() + 60
    while (left := {pid for pid in children if alive(pid)}) and time.monotonic() < give_up:
        time.sleep(0.2)
    assert not left, f"orphans left running: {sorted(left)}"


def test_distributed_gateway_and_two_workers_survive_a_killed_worker(
    valkey: EmbeddedServer, procs: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    prefix = f"d{uuid.uuid4().hex[:8]}"
    shared = ["--broker", valkey.url, "--prefix", prefix]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "TOKENYARD_BROKER_LEASE_S": "2"}
    gateway = subprocess.Popen(
        tokenyard("gateway", *shared, "--engine", "sim", "--port", str(port)), env=env
    )
    workers = [
        subprocess.Popen(
            tokenyard("worker", *shared, "--engine", "sim", "--max-seqs", "8", "--lease-s", "2"),
            env=env,
        )
        for _ in range(2)
    ]
    procs += [gateway, *workers]
    wait_ready(base, gateway)

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
